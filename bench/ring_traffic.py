"""BENCHMARK-ONLY: the gateway in front of a fake engine (`bench/traffic_engine.py`): its added TTFT, and
streamed tokens per second with their added latency.

    .venv/bin/python bench/ring_traffic.py ttft [--samples 300] [--out bench/results]

`ttft`: the engine runs in its own process, spinning, so it answers a request within microseconds.
1. direct: a ShmProducer in this process submits a 1-token request and polls for the token; the median
   is the ring round trip (IPC + the fake engine's poll);
2. HTTP: the gateway is started in front of the same ring; a raw aiohttp client (no SDK overhead) sends
   streaming `max_tokens=1` completions one after another; TTFT = request sent -> first chunk with a
   choice, as BENCH.md defines it; the official `openai` client is measured too.
The gateway's added TTFT = median(HTTP) - median(direct). Writes JSON (commit, machine) and prints a row.

    .venv/bin/python bench/ring_traffic.py stream [--streams 512] [--tokens 200] [--tok-s 50] [--no-probe]
                                                  [--poll-spin-s 0] [--client-tick-ms 1] [--idle-wait-s 900]
                                                  [--isolate] [--tokens-spread 0.5 --refill-s 10]

`stream`: the gateway on the last core, engine and client on the others; N concurrent streams. Per-token
latency from the publish time each token id encodes: to the client's receipt, and (unless --no-probe) to
the gateway's hand-off of the chunk to its socket (`bench/gateway_probe.py` wraps the gateway's stream
writes), the gateway's added latency. Percentiles over all tokens, the steady state (published after every
stream started) and the all-open part of it (before the first stream ended: no set-ups, no ends); CPU use
per process, and the gateway's CPU per token in those windows. The gateway spin-polls while tokens flow,
so its CPU use is its whole core whatever its work: `--poll-spin-s 0` measures the work.
The client (`bench/stream_client.py`) shares a core with the engine and must not hold it up: raw sockets
and one epoll loop that reads every byte into each stream's buffer and parses them after the run; by default
it reads every 1 ms, so that the gateway's writes do not pay for waking it on loopback. The engine publishes
each step's due tokens at once, vectorized, at SCHED_FIFO where allowed (it stands in for a GPU, which a
client does not delay) and reports its lateness and the gaps between its steps. A SCHED_IDLE busy loop keeps
the engine's core from halting (`bench/keep_awake.py`; `--let-cores-halt` leaves it out). It first waits for
the cores to be idle (other developers' runs share this machine) and reports what others (and the
hypervisor: steal, per core too) took of the cores during the run.
With BLINK_ROUNDS=FILE (and the probe) the result also has `poll_rounds_all_open` (`bench/stream_rounds.py`:
the poller's rounds and what filled the gaps between them: the gateway's own work, or its thread not
running), with BLINK_GC_EVENTS=FILE `gc_all_open` (the collections in the all-open window, those over 1 ms).
`--workers N` runs the N processes of `blink gateway --workers N`, one per gateway core; `--keep-alive` sends
each refill on the ended stream's connection. `--tls` serves HTTPS (a throwaway certificate made with
`openssl`; the gateway's own TLS, `gateway/tls.py`) and the client speaks it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink.bench.results import commit, write_summary  # noqa: E402
from protocols.ring import FinishReason, RequestSpec  # noqa: E402
from protocols.shm import attach_ring  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402
from tests.conftest import _wait_health, free_port  # noqa: E402
from isolate_cores import isolate_cores  # noqa: E402
from keep_awake import keep_awake  # noqa: E402
from traffic_engine import MODEL_NAME, lag_us, traffic_engine  # noqa: E402


def direct_ttft_ms(ring_name: str, samples: int) -> list[float]:
    prod, out = ShmProducer(attach_ring(ring_name)), []
    for i in range(samples):
        t0 = time.perf_counter()
        slot = prod.submit(RequestSpec(i, [5, 6, 7, 8], 1, temperature=0.0))
        while not prod.poll(slot).tokens:
            pass
        out.append(1e3 * (time.perf_counter() - t0))
        while prod.poll(slot).finish is FinishReason.NONE:
            pass
        prod.release(slot)
    return out


async def http_ttft_ms(url: str, key: str, samples: int) -> list[float]:
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 1, "stream": True}
    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        for _ in range(samples + 5):
            t0 = time.perf_counter()
            async with session.post(f"{url}/completions", json=body) as resp:
                ttft = None
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                        ttft = 1e3 * (time.perf_counter() - t0)
            out.append(ttft)
    return out[5:]  # the first few open the connection and warm the gateway


def openai_ttft_ms(url: str, key: str, samples: int) -> list[float]:
    from openai import OpenAI

    client, out = OpenAI(base_url=url, api_key=key, max_retries=0), []
    for _ in range(samples + 5):
        t0 = time.perf_counter()
        ttft = None
        for chunk in client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=1, stream=True):
            if ttft is None and chunk.choices:
                ttft = 1e3 * (time.perf_counter() - t0)
        out.append(ttft)
    return out[5:]


def self_signed_certificate(cwd: Path) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 (its own CA; EC P-256, as an operator's would be): (cert, key)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", "key.pem", "-out", "cert.pem", "-days", "1", "-subj", "/CN=blink-bench",
                    "-addext", "subjectAltName=IP:127.0.0.1"], cwd=cwd, check=True, capture_output=True)
    return str(cwd / "cert.pem"), str(cwd / "key.pem")


def _wait_https(url: str, proc: subprocess.Popen, context: ssl.SSLContext, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the gateway did not answer {url} within {timeout_s:g} s")


@contextlib.contextmanager
def gateway_in_front(control: str, cores: set[int] | None = None, probe: str | None = None,
                     profile: str | None = None, poll_spin_s: float | None = None, extra: Sequence[str] = (),
                     nice: int = 0, workers: int = 1, tls: tuple[str, str] | None = None,
                     settings: dict | None = None):
    """`blink gateway` on that backend (gRPC off, key traffic-key); yields its /v1 URL and its pids. With
    `probe`, the gateway runs under `bench/gateway_probe.py` and writes its emit times and token ids there;
    with `profile`, a cProfile dump. With `workers` N > 1, the N worker processes of `--workers N` on one port,
    started here as its supervisor would (one usage table), worker i pinned to the i-th of `cores` (modulo)
    and writing `probe`.i (and BLINK_ROUNDS.i). `tls`: (certificate, key): HTTPS. `settings`: more of the
    gateway's config-file fields (GatewayConfig), e.g. {"grammar_concurrency": 1}."""
    port = free_port()
    env = {**os.environ, "BLINK_API_KEY": "traffic-key", "BLINK_LOG_LEVEL": "WARNING"}
    args = ["--port", str(port), "--grpc-port", "0", "--backend", control, "--log-level", "WARNING", *extra]
    if tls:
        args += ["--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]]
    fields = dict(settings or {})
    if poll_spin_s is not None:  # 0: no back-to-back polls, so its CPU time is its work, not its spinning
        fields["poll_spin_s"] = poll_spin_s
    if fields:
        config = Path(f"/tmp/blink-traffic-gateway-{os.getpid()}.yaml")
        config.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
        args += ["--config", str(config)]
    table = f"/dev/shm/blink-traffic-limits-{os.getpid()}" if workers > 1 else None
    if table:
        from gateway.policy.quotas import create_shared_table

        create_shared_table(table)
    procs = []
    try:
        for i in range(workers):
            worker_args, worker_env = args, env
            if table:
                worker_args = [*args, "--workers", str(workers), "--worker-index", str(i), "--limits-table", table]
                if env.get("BLINK_ROUNDS"):
                    worker_env = {**env, "BLINK_ROUNDS": worker_file(env["BLINK_ROUNDS"], i, workers)}
            if probe or profile:
                cmd = [sys.executable, str(Path(__file__).resolve().parent / "gateway_probe.py"),
                       worker_file(probe, i, workers) if probe else "",
                       worker_file(profile, i, workers) if profile else "", *worker_args]
            else:
                cmd = [sys.executable, "-m", "blink.cli", "gateway", *worker_args]
            core = {sorted(cores)[i % len(cores)]} if cores and workers > 1 else cores

            def placed(core=core) -> None:  # in the gateway's process before it starts: its cores and its priority
                if core:
                    os.sched_setaffinity(0, core)
                if nice:
                    os.setpriority(os.PRIO_PROCESS, 0, nice)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=worker_env, preexec_fn=placed if core or nice else None))
        if tls:
            _wait_https(f"https://127.0.0.1:{port}/health", procs[0], ssl.create_default_context(cafile=tls[0]))
        else:
            _wait_health(f"http://127.0.0.1:{port}/health", procs[0], 60)
        _wait_listening(port, workers, procs)
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1", [p.pid for p in procs]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        if table:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(table)


def _wait_listening(port: int, num: int, procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """Until `num` sockets listen on `port` (/proc/net/tcp): the kernel spreads connections over the workers
    listening when they arrive, so every worker must be there before the clients connect."""
    deadline = time.monotonic() + timeout_s
    while True:
        listening = sum(1 for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                        if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A")
        if listening >= num:
            return
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"{listening} of {num} gateway workers listen on port {port}")
        time.sleep(0.05)


def worker_file(path: str, index: int, workers: int) -> str:
    """Where worker `index` of `workers` writes what one gateway would write to `path`."""
    return path if workers == 1 else f"{path}.{index}"


def record(result: dict, out: str, name: str, records: dict | None = None) -> None:
    """Stamp commit and machine, write the summary JSON under `out` (per-request `records`, if any, beside
    it in the git-ignored `.records.json.gz`)."""
    result.update(commit=commit(short=True) or "unknown", machine=f"{platform.machine()}, {os.cpu_count()} cores")
    path = write_summary(Path(out) / f"{name}-{result['commit']}.json", result, records)
    print(f"wrote {path}")


def ttft(args: argparse.Namespace) -> None:
    with traffic_engine(0.0) as (ring, control, _):
        direct = direct_ttft_ms(ring, args.samples)  # before the gateway: a ring has one producer
        with gateway_in_front(control) as (url, _):
            http = asyncio.run(http_ttft_ms(url, "traffic-key", args.samples))
            sdk = openai_ttft_ms(url, "traffic-key", args.samples)
    med = {k: statistics.median(v) for k, v in (("direct", direct), ("http", http), ("openai", sdk))}
    result = {"bench": "gateway_ttft", "samples": args.samples, "direct_ms_median": med["direct"], "http_ms_median": med["http"],
              "openai_ms_median": med["openai"], "gateway_added_ttft_ms_median": med["http"] - med["direct"],
              "http_ms_p99": statistics.quantiles(http, n=100)[98]}
    record(result, args.out, "gateway_ttft", {"direct_ms": direct, "http_ms": http, "openai_ms": sdk})
    print(f"TTFT median: ring round trip {med['direct']:.3f} ms, over HTTP (aiohttp) {med['http']:.3f} ms "
          f"(P99 {result['http_ms_p99']:.3f}), openai client {med['openai']:.3f} ms; "
          f"gateway adds {result['gateway_added_ttft_ms_median']:.3f} ms at the median")


def stream_clients(url: str, key: str, streams: int, max_tokens: int, gateway_pid: int | list[int] | None = None,
                   tick_s: float = 0.0, connect_batch: int = 0, at_end: Callable[[], None] | None = None,
                   refill_s: float = 0.0, tokens_spread: float = 0.0, keep_alive: bool = False,
                   ssl_context: ssl.SSLContext | None = None) -> dict:
    """`streams` concurrent streaming completions (`bench/stream_client.py`); per-token publish-to-receipt
    latency from the ids. With `gateway_pid`: the gateway's CPU per token received after every stream
    started (steady state). `at_end` is called when every stream is done, before the bodies are parsed.
    `tokens_spread` f: each stream asks for a whole number of tokens drawn uniformly from max_tokens * (1 -+ f)
    (seeded); `refill_s`: ended streams are replaced for that long (the all-open window then has set-ups and
    ends at the workload's own pace, and lasts until the first end that is not replaced)."""
    import random

    from stream_client import run_streams

    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    marks = {}  # the gateway's CPU seconds and the time when the last stream started, the first ended

    def mark(name: str):
        return (lambda stats: marks.update({name: (cpu_s(gateway_pid), time.monotonic_ns(), thread_sched_ns(gateway_pid))})) \
            if gateway_pid else None

    def done() -> None:
        marks["done"] = cpu_s(gateway_pid), time.monotonic_ns(), thread_sched_ns(gateway_pid)
        if at_end is not None:
            at_end()
    warm_up = run_streams(url, key, {**body, "max_tokens": 2}, 8, tick_s, ssl_context=ssl_context)[0]  # once-only work
    assert all(c.ok for c in warm_up), "warm-up requests failed"
    gc.collect()
    gc.freeze()  # the client's collections must not walk torch's objects (imported with the engine's code)
    rng, low, high = random.Random(0), round(max_tokens * (1 - tokens_spread)), round(max_tokens * (1 + tokens_spread))
    lengths = iter(lambda: rng.randint(max(low, 1), high), None) if tokens_spread else None
    counters, stats, wall = run_streams(url, key, body, streams, tick_s, mark("started"), mark("first_end"),
                                        connect_batch, on_done=done if gateway_pid else at_end, refill_s=refill_s,
                                        lengths=lengths, keep_alive=keep_alive, ssl_context=ssl_context)
    samples = list(zip(stats.times_ns, (lag_us(t, r) for t, r in zip(stats.tokens, stats.times_ns))))
    windows = {"steady_ns": sorted(stats.first_ns)[streams - 1],  # every stream has started: the ramp is over
               # until here, every stream was open (no stream had ended, or each one ended was replaced)
               "first_end_ns": stats.refill_end_ns}
    cpu, received = {}, np.sort(np.frombuffer(stats.times_ns, dtype=np.int64))
    if gateway_pid and "started" in marks:  # tokens received by a mark: the client parses them after the run
        cpu_end = marks["done"]
        for name, (cpu1, t1, (run1, wait1)) in (("steady", cpu_end), ("all_open", marks.get("first_end", cpu_end))):
            (cpu0, t0, (run0, wait0)), tokens1 = marks["started"], int(np.searchsorted(received, t1, side="right"))
            tokens0 = int(np.searchsorted(received, t0, side="right"))
            if tokens1 > tokens0:
                cpu[f"gateway_cpu_us_per_token_{name}"] = 1e6 * (cpu1 - cpu0) / (tokens1 - tokens0)
            # The gateway's event-loop thread over the window: waiting on its core's run queue (another thread
            # of this machine ran), and neither running nor runnable: asleep (the poller's timer) or its vCPU
            # not run by the host (steal, not always counted as such).
            cpu[f"gateway_thread_runqueue_ms_{name}"] = (wait1 - wait0) / 1e6
            cpu[f"gateway_thread_lost_ms_{name}"] = (t1 - t0 - (run1 - run0) - (wait1 - wait0)) / 1e6
    counts = [c.num_tokens for c in counters]
    return {"streams": streams, "max_tokens": max_tokens, "client_tick_s": tick_s, "wall_s": wall,
            "tokens": sum(counts), "requests": len(counters),
            "complete_streams": sum(c.ok and c.num_tokens == c.max_tokens for c in counters),
            "refill_s": refill_s, "tokens_spread": tokens_spread, "keep_alive": keep_alive,
            "tok_s": sum(counts) / wall, **windows, "ramp_s": (windows["steady_ns"] - stats.t0_ns) / 1e9,
            "all_open_s": (windows["first_end_ns"] - windows["steady_ns"]) / 1e9,
            "samples": samples, **cpu, **lag_stats("lag_us", samples, windows)}


def cpu_s(pid: int | Sequence[int]) -> float:
    """User + system CPU seconds of a process (or, summed, of several) so far (/proc/PID/stat)."""
    if not isinstance(pid, int):
        return sum(cpu_s(p) for p in pid)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_sched_ns(pid: int | Sequence[int]) -> tuple[int, int]:
    """Nanoseconds a process's main thread (or, summed, those of several) has run on a core and waited on a
    run queue so far (/proc/PID/task/PID/schedstat)."""
    if not isinstance(pid, int):
        run_wait = [thread_sched_ns(p) for p in pid]
        return sum(r for r, _ in run_wait), sum(w for _, w in run_wait)
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(run_ns), int(wait_ns)


def lag_stats(name: str, samples: list[tuple[int, float]], windows: dict) -> dict:
    """Percentiles of (receipt ns, lag us) samples by publish time: all of them; `_steady`: published after
    every stream started; `_all_open`: and before the first stream ended that was not replaced (all streams
    open: no ends, or with --refill-s, each end replaced at once)."""
    out = {}
    steady_ns, first_end_ns = windows["steady_ns"], windows["first_end_ns"]
    for part, lags in (("", [lag for _, lag in samples]),
                       ("_steady", [lag for t, lag in samples if t - lag * 1e3 >= steady_ns]),
                       ("_all_open", [lag for t, lag in samples if steady_ns <= t - lag * 1e3 < first_end_ns])):
        lags.sort()
        if not lags:
            continue
        q = lambda f: lags[min(len(lags) - 1, int(f * len(lags)))]  # noqa: E731
        out.update({f"{name}{part}_p50": q(0.5), f"{name}{part}_p90": q(0.9), f"{name}{part}_p99": q(0.99),
                    f"{name}{part}_max": lags[-1], f"{name}{part}_samples": len(lags)})
    return out


def engine_steps(steps: list[int], windows: dict) -> dict:
    """The fake engine's steps that published while every stream was open: the time from one to the next
    (a step is due every ~0.55 ms; a longer gap means its core did not run it, and its next step publishes
    the overdue tokens in one burst), how many of those gaps were over 1 and 2 ms, and the gaps' CPU time."""
    s = np.array(steps, dtype=np.int64).reshape(-1, 4)  # [start ns, publish ns, tokens, thread CPU ns]
    s = s[(s[:, 0] >= windows["steady_ns"]) & (s[:, 0] < windows["first_end_ns"])]
    if len(s) < 2:
        return {}
    gaps, cpu = np.diff(s[:, 0]) / 1e3, np.diff(s[:, 3]) / 1e3
    return {"engine_steps_all_open": len(s), "engine_tokens_per_step_all_open": float(s[:, 2].mean()),
            "engine_gap_us_all_open_p50": float(np.median(gaps)), "engine_gap_us_all_open_p99": float(np.percentile(gaps, 99)),
            "engine_gap_us_all_open_max": float(gaps.max()), "engine_gaps_over_1_ms_all_open": int((gaps > 1e3).sum()),
            "engine_gaps_over_2_ms_all_open": int((gaps > 2e3).sum()),
            "engine_cpu_us_per_step_all_open": float(cpu.mean())}


def _cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has spent so far busy (not idle, iowait or stolen), and stolen by the
    hypervisor (cycles this VM's cores did not get) (/proc/stat, all cores)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - fields[3] - fields[4] - fields[7]) / tick, fields[7] / tick


def _cpu_idle_fraction(window_s: float) -> float:
    """Share of the machine's CPU time that was idle over `window_s`."""
    (busy0, steal0), t0 = _cpu_s(), time.monotonic()
    time.sleep(window_s)
    busy1, steal1 = _cpu_s()
    return 1 - (busy1 - busy0 + steal1 - steal0) / ((time.monotonic() - t0) * os.cpu_count())


def wait_for_idle(min_idle: float = 0.9, window_s: float = 2.0, timeout_s: float = 900.0) -> float:
    """Block until the cores were at least `min_idle` idle over one `window_s` (other developers' test runs
    share this machine); returns the seconds waited. Gives up (and says so) after `timeout_s`."""
    t0 = time.monotonic()
    while (idle := _cpu_idle_fraction(window_s)) < min_idle:
        if time.monotonic() - t0 > timeout_s:
            print(f"machine still busy ({idle:.0%} idle) after {timeout_s:g} s: measuring anyway")
            break
    return time.monotonic() - t0


def stream(args: argparse.Namespace) -> None:
    """The gateway on its own core(s), the fake engine and the clients on the others."""
    if args.idle_wait_s > 0:
        print(f"waited {wait_for_idle(timeout_s=args.idle_wait_s):.0f} s for idle cores")
    cores = sorted(os.sched_getaffinity(0))
    # the gateway on the last N cores, the engine and client on the others (on the first when there are none)
    gw_cores, other = set(cores[-args.gateway_cores:]), set(cores[:-args.gateway_cores]) or set(cores[:1])
    probe = None if args.no_probe else f"/tmp/blink-emit-lags-{os.getpid()}.json"
    engine_stats = Path(f"/tmp/blink-engine-stats-{os.getpid()}.json")
    tls = self_signed_certificate(Path(tempfile.mkdtemp(prefix="blink-bench-tls-"))) if args.tls else None
    client_tls = ssl.create_default_context(cafile=tls[0]) if tls else None
    with traffic_engine(args.tok_s, idle_s=0.0005, cores=other, stats_path=str(engine_stats)) as (_, control, engine):
        with gateway_in_front(control, gw_cores, probe=probe, profile=args.profile,
                              poll_spin_s=args.poll_spin_s, extra=args.gateway_arg, nice=args.gateway_nice,
                              workers=args.workers, tls=tls) as (url, gateway):
            os.sched_setaffinity(0, other)
            awake = set() if args.let_cores_halt else other - gw_cores
            with isolate_cores(gw_cores - other if args.isolate else set(), keep=set(gateway)) as moved, \
                    keep_awake(awake) as spinners:
                pids = {"gateway": gateway, "engine": engine, "client": os.getpid(),
                        **{f"keep_awake_{core}": pid for core, pid in zip(sorted(awake), spinners)}}
                result = with_cpu_use(pids, lambda at_end: stream_clients(
                    url, "traffic-key", args.streams, args.tokens, gateway, args.client_tick_ms / 1e3,
                    args.connect_batch, at_end, args.refill_s, args.tokens_spread, args.keep_alive, client_tls))
            result["threads_moved_off_gateway_cores"] = sorted(moved)
    result.update(json.loads(engine_stats.read_text()))
    engine_stats.unlink()
    result.update(engine_steps(result.pop("engine_steps"), result))
    if os.environ.get("BLINK_ROUNDS") and probe and args.workers == 1:  # the probed gateway wrote its poll rounds
        from stream_rounds import rounds_summary

        result["poll_rounds_all_open"] = rounds_summary(result, json.loads(Path(os.environ["BLINK_ROUNDS"]).read_text()))
    if os.environ.get("BLINK_GC_EVENTS") and probe and args.workers == 1:  # and each GC collection
        events = [e for e in json.loads(Path(os.environ["BLINK_GC_EVENTS"]).read_text())
                  if result["steady_ns"] < e[0] < result["first_end_ns"]]  # [end ns, duration ns, generation]
        result["gc_all_open"] = {"collections": len(events), "ms": sum(e[1] for e in events) / 1e6,
                                 "over_1_ms": [[round((e[0] - result["steady_ns"]) / 1e6), round(e[1] / 1e6, 1), e[2]]
                                               for e in events if e[1] > 1e6]}  # [at ms, ms, generation]
    emit = []
    for path in [worker_file(probe, i, args.workers) for i in range(args.workers)] if probe else []:
        emit += [(t, lag_us(token, t)) for t, token in json.loads(Path(path).read_text())]
        os.unlink(path)
    emit.sort()
    samples = result.pop("samples")
    if args.samples_out:  # every token's (time ns, lag us), for looking at a run's course
        np.savez_compressed(args.samples_out, emit=np.array(emit).reshape(-1, 2), client=np.array(samples).reshape(-1, 2))
    result = {"bench": "gateway_stream", "tls": bool(tls), "gateway_cores": sorted(gw_cores), "other_cores": sorted(other),
              "gateway_nice": args.gateway_nice, "gateway_cores_isolated": args.isolate,
              "keep_awake_cores": sorted(awake),
              "gateway_workers": args.workers, "gateway_poll_spin_s": args.poll_spin_s, "gateway_args": args.gateway_arg, "engine_tok_s_per_stream": args.tok_s, **result,
              **(lag_stats("emit_lag_us", emit, result) if emit else {})}
    record(result, args.out, f"gateway_stream_{args.streams}" + ("_noprobe" if args.no_probe else "")
           + ("" if args.poll_spin_s is None else f"_spin{args.poll_spin_s:g}")
           + ("" if args.client_tick_ms else "_woken") + ("_halt" if args.let_cores_halt else "")
           + (f"_nice{args.gateway_nice}" if args.gateway_nice else "") + (f"_w{args.workers}" if args.workers > 1 else "")
           + ("_iso" if args.isolate else "") + (f"_refill{args.refill_s:g}" if args.refill_s else "")
           + ("_keepalive" if args.keep_alive else "") + ("_tls" if args.tls else "") + (f"_spread{args.tokens_spread:g}" if args.tokens_spread else "")
           + (f"_{args.tag}" if args.tag else ""))
    print(summary(result))


def with_cpu_use(pids: dict[str, int], run: Callable[[Callable[[], None]], dict]) -> dict:
    """`run(at_end)`'s result with each process's CPU use over its `wall_s` (cores), the gateway's CPU per
    token, the machine's other CPU use and steal (per core too), and the connections listen backlogs dropped
    meanwhile. `run` calls `at_end()` when its streams are done (before it parses what it read)."""
    cpu0, (busy0, steal0), overflows0 = {name: cpu_s(pid) for name, pid in pids.items()}, _cpu_s(), listen_overflows()
    core_steal0, end = _steal_per_core(), {}

    def at_end() -> None:
        end.update(cpu={name: cpu_s(pid) for name, pid in pids.items()}, machine=_cpu_s(), core_steal=_steal_per_core())
    result = run(at_end)
    if not end:
        at_end()
    wall_s = result["wall_s"]
    result.update({f"{name}_cpu_util": (end["cpu"][name] - cpu0[name]) / wall_s for name in pids})
    # Cores' worth of CPU that others used meanwhile: other processes (other developers' runs share this
    # machine) and interrupts, and what the hypervisor did not give this VM (steal).
    busy1, steal1 = end["machine"]
    result["foreign_cpu_util"] = (busy1 - busy0) / wall_s - sum(result[f"{name}_cpu_util"] for name in pids)
    result["steal_cpu_util"] = (steal1 - steal0) / wall_s
    result["steal_cpu_util_per_core"] = [(s1 - s0) / wall_s for s0, s1 in zip(core_steal0, end["core_steal"])]
    result["listen_overflows"] = listen_overflows() - overflows0
    result["gateway_cpu_us_per_token"] = 1e6 * result["gateway_cpu_util"] * wall_s / max(result["tokens"], 1)
    return result


def _steal_per_core() -> list[float]:
    """CPU seconds stolen from each core so far (/proc/stat's cpuN lines)."""
    tick = os.sysconf("SC_CLK_TCK")
    return [int(line.split()[8]) / tick for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("cpu") and line[3].isdigit()]


def summary(r: dict) -> str:
    """A run's figures in a few lines (ms for latencies)."""
    def lags(name: str) -> str:
        return ", ".join(f"{part or 'all'} P50 {r[f'{name}{part}_p50'] / 1e3:.2f} / P99 {r[f'{name}{part}_p99'] / 1e3:.2f}"
                         for part in ("", "_steady", "_all_open") if f"{name}{part}_p50" in r)
    awake = "".join(f", keep-awake core {core} {r[f'keep_awake_{core}_cpu_util']:.0%}" for core in r.get("keep_awake_cores", ()))
    lines = [f"{r['streams']} streams x {r['max_tokens']} tokens at {r['engine_tok_s_per_stream']:g} tok/s each: "
             f"{r['tok_s']:.0f} tok/s delivered, {r['complete_streams']} of {r.get('requests', r['streams'])} complete; all started after {r['ramp_s']:.2f} s, "
             f"all open for {r['all_open_s']:.2f} s",
             f"  publish -> client (ms): {lags('lag_us')}"]
    if "emit_lag_us_p50" in r:
        lines.append(f"  publish -> gateway emit (ms): {lags('emit_lag_us')}")
    lines += [f"  CPU: gateway {r['gateway_cpu_util']:.0%} ({r['gateway_cpu_us_per_token']:.1f} us/token; steady "
              f"{r.get('gateway_cpu_us_per_token_steady', float('nan')):.1f}, all open "
              f"{r.get('gateway_cpu_us_per_token_all_open', float('nan')):.1f}), engine {r['engine_cpu_util']:.0%} "
              f"({r['engine_sched']}), client {r['client_cpu_util']:.0%}"
              f"{awake}; "
              f"others {r['foreign_cpu_util']:.0%}, "
              f"stolen {r['steal_cpu_util']:.0%}; listen overflows {r['listen_overflows']}",
              f"  gateway thread, all open: {r.get('gateway_thread_runqueue_ms_all_open', float('nan')):.1f} ms on the run "
              f"queue, {r.get('gateway_thread_lost_ms_all_open', float('nan')):.1f} ms neither running nor runnable",
              f"  engine publish lateness P50 {r['engine_late_us_p50'] / 1e3:.2f} ms, P99 {r['engine_late_us_p99'] / 1e3:.2f} ms, "
              f"max {r['engine_late_us_max'] / 1e3:.2f} ms; all open: steps every {r.get('engine_gap_us_all_open_p50', 0) / 1e3:.2f} ms "
              f"(P99 {r.get('engine_gap_us_all_open_p99', 0) / 1e3:.2f}), {r.get('engine_gaps_over_1_ms_all_open')} gaps over 1 ms, "
              f"{r.get('engine_gaps_over_2_ms_all_open')} over 2 ms, max {r.get('engine_gap_us_all_open_max', 0) / 1e3:.2f} ms; "
              f"{r.get('engine_cpu_us_per_step_all_open', 0):.0f} us CPU a step"]
    if "poll_rounds_all_open" in r:
        p = r["poll_rounds_all_open"]
        lines.append(f"  poll rounds, all open: {p['rounds']}, {p['cpu_us_per_update_in_rounds']:.1f} us CPU an update; "
                     f"gaps between rounds over 0.3 ms: {p['gaps_over_300_us']} ({p['gap_busy_over_300_us']} the gateway's "
                     f"own work, {p['gap_busy_ms']:.1f} ms), over 1 ms with the thread not running: "
                     f"{p['gap_stalled_over_1_ms']} ({p['gap_stalled_lost_ms']:.1f} ms lost); largest gap "
                     f"{p['largest_gap_ms']:.1f} ms")
    if "gc_all_open" in r:
        g = r["gc_all_open"]
        lines.append(f"  GC, all open: {g['collections']} collections, {g['ms']:.1f} ms; over 1 ms "
                     f"[at ms, ms, generation]: {g['over_1_ms']}")
    return "\n".join(lines)


def listen_overflows() -> int:
    """Connections the kernel dropped so far because a listen backlog was full (each waits a retransmit)."""
    head, values = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()
                    if line.startswith("TcpExt:")][:2]
    return int(values[head.index("ListenOverflows")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("ttft", help="the gateway's added time to first token")
    t.add_argument("--samples", type=int, default=300)
    t.add_argument("--out", default=str(ROOT / "bench" / "results"))
    st = sub.add_parser("stream", help="streamed tokens/s and per-token latency through the gateway")
    st.add_argument("--streams", type=int, default=512)
    st.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    st.add_argument("--tok-s", type=float, default=50.0, help="fake engine tokens/s per stream")
    st.add_argument("--gateway-cores", type=int, default=1, help="the last N cores are the gateway's")
    st.add_argument("--workers", type=int, default=1,
                    help="the gateway's worker processes (`--workers N`: one port, SO_REUSEPORT), one per gateway "
                         "core; e.g. --gateway-cores 2 --workers 2 on a 2-core machine, the engine and client then "
                         "sharing the first core")
    st.add_argument("--profile", help="write a cProfile dump of the gateway here")
    st.add_argument("--no-probe", action="store_true", help="leave out the gateway's emit-time probe (its own cost)")
    st.add_argument("--poll-spin-s", type=float, help="the gateway's poll_spin_s (0: its CPU use is its work per "
                    "token; by default it polls back to back while tokens flow, using its whole core)")
    st.add_argument("--idle-wait-s", type=float, default=900.0,
                    help="first wait up to this long for the cores to be 90%% idle over 2 s (0: don't)")
    st.add_argument("--client-tick-ms", type=float, default=1.0,
                    help="the client reads what arrived every this many ms (0: it is woken by each write, which "
                         "on loopback the gateway's send pays for; a client on another host costs it nothing)")
    st.add_argument("--connect-batch", type=int, default=0,
                    help="open this many connections every 5 ms (0: all at once)")
    st.add_argument("--let-cores-halt", action="store_true",
                    help="no SCHED_IDLE busy loop on the engine's and client's cores (`bench/keep_awake.py`): "
                         "they halt when idle, and a halted vCPU wakes when the host runs it again")
    st.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                    help="passed to `blink gateway` (repeatable), e.g. --gateway-arg=--no-setup-pacing")
    st.add_argument("--gateway-nice", type=int, default=0,
                    help="the gateway's nice value (-20 .. 19; below 0 needs root): at -20 the kernel's own threads "
                         "and the gateway's helper threads on its core wait rather than preempt its event loop")
    st.add_argument("--isolate", action="store_true",
                    help="move every other thread that can run elsewhere off the gateway's cores for the run "
                         "(`bench/isolate_cores.py`), as isolcpus= or systemd's CPUAffinity= would on an appliance")
    st.add_argument("--tokens-spread", type=float, default=0.0,
                    help="each stream asks for a number of tokens drawn uniformly from tokens * (1 -+ F), so that "
                         "streams end at different times (0: every stream asks for --tokens)")
    st.add_argument("--refill-s", type=float, default=0.0,
                    help="for this many seconds from the start, replace each stream that ends with a new one: "
                         "--streams stay open while requests start and end (with --tokens-spread, spread out)")
    st.add_argument("--keep-alive", action="store_true",
                    help="with --refill-s: send each replacement on the connection of the stream it replaces "
                         "(HTTP/1.1 keep-alive, as the openai client's connection pool does) instead of a new one")
    st.add_argument("--tls", action="store_true", help="HTTPS: the gateway serves TLS (a throwaway certificate "
                    "made here with openssl) and the client speaks it")
    st.add_argument("--tag", help="appended to the result file's name (repeated runs)")
    st.add_argument("--samples-out", help="also write every token's emit and client (time, lag) here (.npz)")
    st.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    (ttft if args.cmd == "ttft" else stream)(args)


if __name__ == "__main__":
    main()
