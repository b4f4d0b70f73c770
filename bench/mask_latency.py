"""BENCHMARK-ONLY: the latency of constrained decoding's token -> mask path through a real gateway, on a CPU.

    .venv/bin/python bench/mask_latency.py [--streams 16] [--workers 1] [--step-ms 7] [--duration-s 20]
                                           [--preset llama-3-8b] [--schema bench/data/device_schema.json]
                                           [--grammar-concurrency 0 1 2]
                                           [--out bench/results]

The fake engine (`bench/traffic_engine.py`, constrained mode) steps every `--step-ms` like a GPU's decode
steps; each row samples a seeded random token its mask allows (EOS as soon as allowed), and a row whose next
mask is not in the ring yet skips the step, as the real engine's does. `--streams` clients keep one streamed
chat completion each under a JSON schema (`response_format`) going for `--duration-s`, against `blink gateway`
with `--workers` processes. The engine records, per token, the time from publishing token i to seeing the
mask of token i + 1 in the ring (mask latency) and the steps rows skipped for a late mask. Prints P50/P99/max
mask latency, the tokens whose mask took over one step, the skipped fraction (of row-steps), how many tokens
waited 0, 1, 2, 3+ steps for their mask, and the gateway's CPU per streamed token (its processes' user + system
time over the run; with the poller spinning, its spin too). `--preset` picks the vocabulary (its size, BOS and
EOS: llama-3-8b's 128,256 tokens as on the GPU) and `--schema` a JSON schema file (bench/data/device_schema.json
is the GPU benchmark's) in place of the small one below.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ring_traffic import cpu_s, gateway_in_front  # noqa: E402
from traffic_engine import MASK_PRESET, MODEL_NAME, mask_traffic_engine  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "active": {"type": "boolean"}}, "required": ["name", "age", "tags", "active"], "additionalProperties": False}
KEY = "traffic-key"


async def one_stream(session, url: str, deadline: float, counts: dict, schema: dict) -> None:
    """Streamed constrained chats one after another until `deadline`; counts requests, chunks and errors."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 200,
            "stream": True, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "person", "schema": schema}}}
    while time.monotonic() < deadline:
        async with session.post(f"{url}/chat/completions", json=body) as resp:
            if resp.status != 200:
                counts["errors"] += 1
                counts["last_error"] = (await resp.text())[:300]
                await asyncio.sleep(0.1)
                continue
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    counts["chunks"] += 1
                    if b'"error"' in line:
                        counts["errors"] += 1
                        counts["last_error"] = line[:300].decode(errors="replace")
        counts["requests"] += 1


async def clients(url: str, streams: int, duration_s: float, schema: dict) -> dict:
    import aiohttp

    counts = {"requests": 0, "chunks": 0, "errors": 0}
    deadline = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=duration_s + 120)
    conn = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
                                     connector=conn) as session:
        await asyncio.gather(*(one_stream(session, url, deadline, counts, schema) for _ in range(streams)))
    return counts


def run(streams: int, workers: int, step_ms: float, duration_s: float, poll_spin_s: float | None = None,
        preset: str = MASK_PRESET, schema: dict | None = None, grammar_concurrency: int = 0) -> dict:
    schema = SCHEMA if schema is None else schema
    stats_path = Path(tempfile.mkdtemp(prefix="blink-masklat-")) / "engine.json"
    with mask_traffic_engine(step_ms / 1e3, str(stats_path), preset) as (_, control, _pid):
        settings = {"grammar_concurrency": grammar_concurrency} if grammar_concurrency else None
        with gateway_in_front(control, workers=workers, poll_spin_s=poll_spin_s, settings=settings) as (url, pids):
            asyncio.run(clients(url, min(streams, 2), 2.0, schema))  # warm: the tokenizer, the grammar's compile
            t0, cpu0 = time.monotonic(), cpu_s(pids)
            counts = asyncio.run(clients(url, streams, duration_s, schema))
            wall_s, gateway_cpu_s = time.monotonic() - t0, cpu_s(pids) - cpu0
    engine = json.loads(stats_path.read_text())
    # the engine's counts include the warm-up's few tokens
    return {"streams": streams, "workers": workers, "poll_spin_s": poll_spin_s, "preset": preset,
            "grammar_concurrency": grammar_concurrency, "wall_s": wall_s,
            "gateway_cpu_s": gateway_cpu_s, "gateway_cpu_us_per_token": 1e6 * gateway_cpu_s / max(counts["chunks"], 1),
            **counts, **engine}


def summary(r: dict) -> str:
    def us(key: str) -> str:
        return "-" if r[key] is None else f"{r[key]:.0f}"
    skipped = "-" if r["skipped_fraction"] is None else f"{100 * r['skipped_fraction']:.2f}%"
    spin = "" if r["poll_spin_s"] is None else f" spin {r['poll_spin_s']:g}"
    spin += f" at once {r['grammar_concurrency']}" if r.get("grammar_concurrency") else ""
    return (f"streams {r['streams']:3d} workers {r['workers']}{spin}: {r['masks']} masks, latency "
            f"P50 {us('mask_latency_us_p50')} us P99 {us('mask_latency_us_p99')} us max {us('mask_latency_us_max')} us; over one step "
            f"({r['step_ms']:g} ms) {r['mask_over_one_step']}; skipped steps {r['skipped_steps']}/{r['row_steps']} "
            f"({skipped}); tokens by steps waited {steps_waited(r['tokens_by_steps_waited'])}; skipped steps by the "
            f"token's index {' '.join(f'{k}:{n}' for k, n in (r.get('skipped_by_token_index') or {}).items())}; "
            f"requests {r['requests']} errors {r['errors']}; gateway CPU "
            f"{r['gateway_cpu_us_per_token']:.0f} us/token"
            f"\n  skipped steps by second of the run: {' '.join(map(str, r.get('skipped_by_second') or []))}")


def steps_waited(counts: list[int]) -> str:
    """The engine's histogram of steps a constrained token waited for its mask, as "0:n 1:n 2:n 3+:n"."""
    return f"0:{counts[0]} 1:{counts[1]} 2:{counts[2]} 3+:{sum(counts[3:])}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[16])
    p.add_argument("--workers", type=int, nargs="+", default=[1])
    p.add_argument("--step-ms", type=float, default=7.0, help="the fake engine's step period")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--poll-spin-s", type=float, default=None,
                   help="the gateway's poll_spin_s (default its own); 0: its poller never spins, which on a machine "
                        "with few cores leaves them to the engine, the client and the mask threads")
    p.add_argument("--preset", default=MASK_PRESET,
                   help="the vocabulary's model preset (size, BOS, EOS); llama-3-8b: 128,256 tokens")
    p.add_argument("--schema", default=None, help="a JSON schema file for every request (default: a small one)")
    p.add_argument("--grammar-concurrency", type=int, nargs="+", default=[0],
                   help="the gateway's grammar_concurrency, each a run (0: automatic, the cores shared among the "
                        "workers, 2 to 8)")
    p.add_argument("--label", default="", help="a name for this set of runs (before/after)")
    p.add_argument("--out", default=None, help="a folder: the results as JSON there")
    args = p.parse_args(argv)
    schema = json.loads(Path(args.schema).read_text()) if args.schema else None
    results = []
    for workers in args.workers:
        for streams in args.streams:
            for at_once in args.grammar_concurrency:
                r = run(streams, workers, args.step_ms, args.duration_s, args.poll_spin_s, args.preset, schema,
                        at_once)
                print(summary(r), flush=True)
                results.append(r)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = Path(args.out) / f"mask_latency{'_' + args.label if args.label else ''}_{os.getpid()}.json"
        name.write_text(json.dumps({"label": args.label, "results": results}, indent=1))
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
