"""`blink bench` (load generator, one run per request rate) and `blink bench interfere`.

    blink bench --url http://127.0.0.1:8000/v1 --workload sharegpt --sweep 1:64 --label blink-cpu
    blink bench --workload batch1 --max-output 128 --backend-pid 1234 --weight-bytes 16.1e9 --copy-gbps 3000
    blink bench --rates 4,inf --max-concurrency 64 --interference 12 --gateway-cores 14,15
    blink bench interfere --threads 12 --seconds 60 --gateway-cores 14,15
    blink bench --workload shared-prefix --num-requests 1000 --system-len 2000 --question-len 50 --answer-len 100
    blink bench --workload multi-turn --conversations 64 --turns 8 --user-len 64 --answer-len 128
    blink bench --endpoint chat --response-format schema.json --serve-pid 1234   # every request constrained

Also `python -m blink.bench ...` (needs only aiohttp and tqdm, not the serving stack).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

from .collectors import CpuCollector, NvmlCollector, child_pids_matching, roofline
from .interference import KINDS, Interference
from .loadgen import RESPONSE_FORMAT_TYPES, ArrivalConfig, ClientConfig, discover_model, run_requests
from .metrics import parse_slos, summarize
from .results import environment, format_table, write_run
from .workloads import WORKLOADS, BenchRequest, Workload, batch1, multi_turn, scaled, shared_prefix

NUM_SWEEP_RATES = 13


def parse_rates(rates: str | None, sweep: str | None) -> list[float]:
    """`--rates 1,2,inf` as given, or `--sweep LOW:HIGH`: 13 rates spaced geometrically."""
    if sweep:
        low, high = (float(x) for x in sweep.split(":"))
        if not 0 < low < high:
            raise ValueError(f"--sweep {sweep}: need 0 < LOW < HIGH")
        step = (high / low) ** (1 / (NUM_SWEEP_RATES - 1))
        return [round(low * step ** i, 4) for i in range(NUM_SWEEP_RATES)]
    return [float(x) for x in (rates or "inf").split(",")]


def parse_cores(text: str | None) -> list[int] | None:
    """`0-7,9` -> [0..7, 9]."""
    if not text:
        return None
    cores = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def add_interference_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cores", default=None, help="cores for the interference, e.g. 0-11 (default: all but the gateway's)")
    p.add_argument("--gateway-cores", default=None, help="cores to leave free for the gateway, e.g. 14,15")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"interference kinds among {','.join(KINDS)}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="OpenAI API base URL (ending in /v1)")
    p.add_argument("--api-key", default=None, help="default: $BLINK_API_KEY or $OPENAI_API_KEY")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions sends token-id prompts (exact lengths); chat sends w<id> words")
    p.add_argument("--label", default="blink", help="system name in the results and plots")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    p.add_argument("--max-input", type=int, default=None, help="truncate prompts to this many tokens")
    p.add_argument("--max-output", type=int, default=None, help="cap max_tokens")
    p.add_argument("--vocab-size", type=int, default=None, help="fold token ids below this (small vocabularies)")
    p.add_argument("--prompt-len", type=int, default=128, help="batch1: prompt tokens")
    p.add_argument("--output-len", type=int, default=256, help="batch1: output tokens")
    p.add_argument("--system-len", type=int, default=2000, help="shared-prefix: tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=50, help="shared-prefix: tokens of each user's question")
    p.add_argument("--answer-len", type=int, default=None,
                   help="shared-prefix and multi-turn: tokens of each answer (default 100 and 128)")
    p.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--user-len", type=int, default=64, help="multi-turn: tokens of each user message")
    p.add_argument("--temperature", type=float, default=None, help="default: the workload's (nano-vllm 0.6, else 0)")
    p.add_argument("--rates", default=None, help="comma-separated request rates per second, inf = all at once")
    p.add_argument("--sweep", default=None, help="LOW:HIGH: 13 rates spaced geometrically (overrides --rates)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs like ttft:500 tpot:50 e2el:10000 (ms)")
    p.add_argument("--warmup-requests", type=int, default=1, help="short requests sent before measuring")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds of silence before a stream fails")
    p.add_argument("--continuous-usage", action="store_true", help="ask for usage in every chunk (vLLM)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (servers that reject unknown fields; give the model no EOS instead)")
    p.add_argument("--response-format", default=None, metavar="FILE",
                   help="JSON file: an OpenAI response_format object, or a bare JSON schema (sent as json_schema); "
                        "every request carries it (completions: as structured_outputs) and no ignore_eos")
    p.add_argument("--out", default="bench/results", help="folder for the JSON files")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--backend-pid", type=int, default=None, help="backend process (tree) to charge CPU to")
    p.add_argument("--serve-pid", type=int, default=None,
                   help="`blink serve` process: its backend child is used, and its gateway child's CPU is reported")
    p.add_argument("--gateway-pid", type=int, default=None, help="gateway process (tree) whose CPU is reported")
    p.add_argument("--weight-bytes", type=float, default=None, help="model weight bytes for the roofline")
    p.add_argument("--kv-bytes-per-token", type=int, default=0, help="KV cache bytes per token (roofline)")
    p.add_argument("--copy-gbps", type=float, default=None, help="measured copy bandwidth in GB/s (roofline)")
    p.add_argument("--interference", type=int, default=0, help="interfering threads during each run")
    p.add_argument("--interference-seconds", type=float, default=900.0, help="upper bound per run")
    p.add_argument("--interference-settle", type=float, default=1.0, help="seconds of interference before measuring")
    add_interference_args(p)
    sub = p.add_subparsers(dest="bench_command")
    i = sub.add_parser("interfere", help="run only the interference generator for a bounded time")
    i.add_argument("--threads", type=int, required=True)
    i.add_argument("--seconds", type=float, required=True)
    add_interference_args(i)


def build_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "batch1":
        base = batch1(args.num_requests or 4, args.prompt_len, args.output_len, args.seed)
    elif args.workload == "shared-prefix":
        base = shared_prefix(args.num_requests or 64, args.system_len, args.question_len, args.answer_len or 100,
                             args.seed)
    elif args.workload == "multi-turn":
        base = multi_turn(args.conversations, args.turns, args.user_len, args.answer_len or 128, args.seed)
    else:
        base = WORKLOADS[args.workload](seed=args.seed)
        if args.num_requests and args.num_requests > len(base.requests):  # more than the default size
            base = WORKLOADS[args.workload](num_requests=args.num_requests, seed=args.seed)
    num_requests = None if args.workload == "shared-prefix" else args.num_requests  # already its N users
    return scaled(base, num_requests, args.max_input, args.max_output, args.vocab_size)


def backend_pid(args: argparse.Namespace) -> int | None:
    if args.backend_pid:
        return args.backend_pid
    if args.serve_pid:
        found = child_pids_matching(args.serve_pid, "blink.cli backend")
        if not found:
            raise SystemExit(f"--serve-pid {args.serve_pid}: no `blink.cli backend` process under it")
        return found[0]
    return None


def gateway_pid(args: argparse.Namespace) -> int | None:
    """--gateway-pid, else the gateway under --serve-pid (None where neither names one)."""
    if args.gateway_pid:
        return args.gateway_pid
    found = child_pids_matching(args.serve_pid, "blink.cli gateway") if args.serve_pid else []
    return found[0] if found else None


def load_response_format(path: str | None) -> dict | None:
    """`--response-format FILE`: a response_format object as is; anything else is a JSON schema to wrap."""
    if path is None:
        return None
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--response-format {path}: cannot read a JSON document ({exc})")
    if isinstance(value, dict) and value.get("type") in RESPONSE_FORMAT_TYPES:
        return value
    if not isinstance(value, (dict, bool)):
        raise SystemExit(f"--response-format {path}: expected a response_format object or a JSON schema")
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": value}}


def make_interference(args: argparse.Namespace, threads: int, seconds: float) -> Interference:
    return Interference(threads, seconds, parse_cores(args.cores), parse_cores(args.gateway_cores),
                        tuple(k for k in args.kinds.split(",") if k))


async def _warm_up(client: ClientConfig, workload: Workload, num: int) -> None:
    if num <= 0:
        return
    # reversed: no prefix of the measured prompts is left in a server's prefix cache by the warm-up
    reqs = tuple(BenchRequest(r.prompt_ids[:32][::-1], min(r.output_len, 4)) for r in workload.requests[:num])
    await run_requests(client, Workload("warmup", reqs), ArrivalConfig())


def measure(args, client: ClientConfig, workload: Workload, arrivals: ArrivalConfig, pid: int | None,
            gateway: int | None = None) -> dict:
    """One run: collectors and interference around the requests; the run's result document."""
    collectors = {"cpu": CpuCollector(pid) if pid else None, "nvml": NvmlCollector()}
    if gateway:
        collectors["gateway_cpu"] = CpuCollector(gateway)
    interference = make_interference(args, args.interference, args.interference_seconds) if args.interference else None
    with interference or contextlib.nullcontext():
        if interference:
            time.sleep(args.interference_settle)
        for c in filter(None, collectors.values()):
            c.start()
        records, duration_s = asyncio.run(run_requests(client, workload, arrivals, not args.no_progress))
        tokens = sum(r.completion_tokens for r in records if r.ok)
        server = {name: c.stop(tokens) if c else {"available": False, "reason": "not available: no --backend-pid"}
                  for name, c in collectors.items()}
        interfered = {**interference.describe(), "running_at_end": interference.num_running()} if interference else None
    metrics = summarize(records, duration_s, parse_slos(args.goodput))
    server["roofline"] = _roofline(args, metrics, records)
    return {"label": args.label, "model": client.model, "url": client.base_url, "endpoint": client.endpoint,
            "workload": workload.describe(), "arrivals": arrivals.describe(), "interference": interfered,
            "response_format": client.response_format,
            "metrics": metrics, "server": server, "requests": [r.to_json() for r in records]}


def _roofline(args, metrics: dict, records) -> dict:
    step_ms = metrics["tpot_ms"]["median"]
    step_s = step_ms / 1000 if step_ms else None
    batch = metrics["output_throughput_tok_s"] * step_s if step_s else 1.0  # Little's law: tokens per step
    ok = [r for r in records if r.ok]
    context = sum(r.prompt_len + r.completion_tokens / 2 for r in ok) / len(ok) if ok else 0.0
    return roofline(int(args.weight_bytes or 0), args.copy_gbps, step_s, max(batch, 1.0),
                    args.kv_bytes_per_token, context)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: interference stopped, temp dirs removed


@contextlib.contextmanager
def _stop_on_signals():
    """While inside: SIGTERM and SIGINT both unwind as KeyboardInterrupt. SIGINT's handler is set here too, not
    left to Python: a process started from a background job of a script (`cmd &`, nohup) inherits SIGINT ignored,
    and Python then installs no handler for it (found when the test suite ran as such a job). The handlers before
    come back on the way out: `main` called in-process (tests) must not leave a SIGTERM that raises in the caller,
    nor in a process it forks later (pyroute2 forks one per network namespace: such a child unwound into the test
    runner and ran tests beside it)."""
    before = signal.signal(signal.SIGTERM, _interrupt), signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "interfere":
        return run_interfere(args)
    with _stop_on_signals():
        return _run_bench(args)


def _run_bench(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("BLINK_API_KEY") or os.environ.get("OPENAI_API_KEY")
    try:
        model = args.model or asyncio.run(discover_model(args.url, api_key))
    except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise SystemExit(f"blink bench: cannot list models at {args.url}/models ({exc}); check --url and --api-key")
    try:
        client = ClientConfig(args.url.rstrip("/"), model, api_key, args.endpoint, args.temperature,
                              args.request_timeout, args.continuous_usage, not args.no_ignore_eos,
                              load_response_format(args.response_format))
    except ValueError as exc:  # a response_format file of the wrong shape
        raise SystemExit(f"blink bench: {exc}")
    workload, pid, gateway = build_workload(args), backend_pid(args), gateway_pid(args)
    asyncio.run(_warm_up(client, workload, args.warmup_requests))
    env, docs = environment(), []
    for rate in parse_rates(args.rates, args.sweep):
        arrivals = ArrivalConfig(rate, args.burstiness, args.seed, args.max_concurrency)
        doc = {**measure(args, client, workload, arrivals, pid, gateway), "environment": env}
        path = write_run(args.out, doc)
        docs.append(doc)
        print(f"rate {arrivals.describe()['rate']}: {path}", file=sys.stderr, flush=True)
    print(format_table(docs), flush=True)
    for doc in docs:
        print(prefix_reuse_line(doc), flush=True)
    return 0 if all(d["metrics"]["failed"] == 0 for d in docs) else 1


def prefix_reuse_line(doc: dict) -> str:
    """What the workload lets a prefix cache skip beside what the server reported skipping (usage)."""
    total, reusable = doc["workload"]["total_prompt_len"], doc["workload"]["reusable_prompt_tokens"]
    hits = doc["metrics"]["prefix_cache"]
    return (f"rate {doc['arrivals']['rate']}: prefix reuse the workload allows {reusable}/{total} prompt tokens "
            f"({reusable / max(total, 1):.1%}; unavoidable prefill {total - reusable}); measured hit rate "
            f"{hits['cached_tokens']}/{hits['prompt_tokens']} ({hits['hit_rate']:.1%}, usage cached_tokens)")


def run_interfere(args: argparse.Namespace) -> int:
    """Interference alone until `--seconds` pass or Ctrl-C/SIGTERM; always stopped and cleaned."""
    it = make_interference(args, args.threads, args.seconds)
    print(f"interference: {it.describe()}", flush=True)
    # an interrupt during start-up too: stopped, exit 0
    with _stop_on_signals(), contextlib.suppress(KeyboardInterrupt), it:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in it.workers):
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="blink bench", description=__doc__.split("\n")[0])
    add_bench_args(p)
    return run_bench(p.parse_args(argv))

