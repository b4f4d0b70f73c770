"""A model of the saturation benchmark (issue 22): the ShareGPT-shaped workload, all requests at once, served by
continuous batching with chunked prefill, each step costing what `bench/gpu_host.py` measured for its bare step.
Not a measurement: a planning tool that says which batch sizes the run's time goes to, and what a faster step at
some batch sizes would give, before a GPU is spent on it.

    python bench/saturation_model.py --steps bench/results/i20-after-gpu_host-bc0a527efb445dd5f532fee203760e735ca2d81f.json
    python bench/saturation_model.py --step 1:5.866,8:6.525,64:8.237,256:16.918 --budgets 2048:1024 \
        --what-if 256-:0.7

The schedule (FCFS, as the engine's): admit waiting requests while fewer than max_num_seqs run; each step decodes
one token of every running request whose prompt is done, and gives the rest of the max_num_batched_tokens budget
to prompts in admission order (a prompt's last chunk samples its first token). A step's time is the bare step at
(decode rows + prefill tokens x --prefill-cost) rows, interpolated between the measured batches, extrapolated past the largest with its last slope. Contexts are
modelled only with `--kv-gbps` (the attention's KV read rate, from bench/attn_probe.py): a step then also costs
the KV reads of its decode rows' contexts past the bare steps' own (`--step-ctx`); without it the bare steps'
contexts stand in. Checked against the served figures on one H100 (bf16,
bc0a527's steps): 9,205 / 10,493 / 10,989 tok/s predicted for 512:256 / 1024:512 / 2048:1024 against 10,374 /
10,849 / 10,944 served (bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink.bench.workloads import sharegpt  # noqa: E402

RANGES = ((1, 16), (16, 64), (64, 256), (256, 512), (512, 1 << 30))  # decode rows a step, for the time split


def step_curve(points: dict[int, float], what_if: list[tuple[int, int, float]] = ()) -> Callable[[float], float]:
    """ms a step at n rows: piecewise linear through the measured (batch, ms) points, flat below the first,
    the last segment's slope past the last; each (lo, hi, factor) of `what_if` scales the steps of lo <= n < hi."""
    xs = sorted(points)
    ys = [points[x] for x in xs]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0

    def ms(n: float) -> float:
        if n <= xs[0]:
            base = ys[0]
        elif n >= xs[-1]:
            base = ys[-1] + (n - xs[-1]) * slope
        else:
            i = bisect.bisect_right(xs, n)
            base = ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        for lo, hi, factor in what_if:
            if lo <= n < hi:
                return base * factor
        return base
    return ms


def simulate(requests: list[tuple[int, int]], step_ms: Callable[[float], float], max_num_seqs: int,
             max_num_batched_tokens: int, prefill_cost: float = 1.0, kv_ms_per_token: float = 0.0,
             step_ctx: float = 0.0) -> dict:
    """(prompt_len, output_len) requests, all waiting at t=0 -> output tok/s, duration, mean time to the first
    token, and the seconds and tokens of the steps by decode rows (RANGES). With `kv_ms_per_token`, a step also
    costs that for every context token its decode rows hold past `step_ctx` each (the bare steps' own context;
    shorter contexts give time back): attention's reads at the real contexts."""
    waiting = list(range(len(requests)))[::-1]  # popped from the end: admission order
    running: list[int] = []
    prompt_left = [p for p, _ in requests]
    output_left = [o for _, o in requests]
    first_token_s = [0.0] * len(requests)
    t = 0.0
    tokens = 0
    by_rows = {r: [0.0, 0] for r in RANGES}
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(waiting.pop())
        decode = [i for i in running if prompt_left[i] == 0]
        budget = max_num_batched_tokens - len(decode)
        prefill = 0
        emitting = list(decode)  # and the prompts whose last chunk is in this step: their first token
        for i in running:
            if budget <= 0:
                break
            if prompt_left[i]:
                take = min(budget, prompt_left[i])
                prompt_left[i] -= take
                budget -= take
                prefill += take
                if not prompt_left[i]:
                    emitting.append(i)
        extra = 0.0
        if kv_ms_per_token:
            ctx = sum(requests[i][0] + requests[i][1] - output_left[i] for i in decode)
            extra = (ctx - len(decode) * step_ctx) * kv_ms_per_token
        dt = (step_ms(len(decode) + prefill * prefill_cost) + extra) / 1e3
        t += dt
        cell = next(by_rows[r] for r in RANGES if r[0] <= max(len(decode), 1) < r[1])
        cell[0] += dt
        cell[1] += len(emitting)
        for i in emitting:
            if output_left[i] == requests[i][1]:
                first_token_s[i] = t
            output_left[i] -= 1
            tokens += 1
        running = [i for i in running if output_left[i] > 0]
    return {"output_tok_s": tokens / t if t else 0.0, "duration_s": t, "tokens": tokens,
            "mean_first_token_s": sum(first_token_s) / len(requests) if requests else 0.0,
            "by_decode_rows": {f"{lo}-{hi if hi < 1 << 30 else ''}": {"s": round(s, 3), "tokens": n}
                               for (lo, hi), (s, n) in by_rows.items()}}


def _pairs(text: str, kind: Callable = int) -> list[tuple]:
    return [tuple(kind(v) for v in item.split(":")) for item in text.split(",") if item]


def _what_if(text: str) -> list[tuple[int, int, float]]:
    """'256-:0.7,64-256:0.9' -> [(256, inf, 0.7), (64, 256, 0.9)]."""
    out = []
    for item in filter(None, text.split(",")):
        span, factor = item.split(":")
        lo, _, hi = span.partition("-")
        out.append((int(lo), int(hi) if hi else 1 << 30, float(factor)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--steps", help="a bench/gpu_host.py JSON: its rows' batch and bare_step_ms")
    src.add_argument("--step", help="batch:ms pairs, comma-separated")
    ap.add_argument("--budgets", default="512:256,1024:512,2048:1024",
                    help="max_num_batched_tokens:max_num_seqs pairs (default the three measured on the H100)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-cost", type=float, default=0.5,
                    help="a prompt token's cost in decode rows (0.5: the fit to the served H100 figures, module doc)")
    ap.add_argument("--kv-gbps", type=float, default=0.0,
                    help="model contexts: the attention's KV read rate in GB/s (bench/attn_probe.py; 0: contexts "
                         "not modelled, every step as the bare step's own)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=131072,
                    help="KV bytes a context token holds over all layers (Llama-3-8B bf16: 32 x 2 x 8 x 128 x 2)")
    ap.add_argument("--step-ctx", type=float, default=0.0,
                    help="the bare steps' context (default: the --steps file's ctx_len, else 416)")
    ap.add_argument("--what-if", default="", help="lo-hi:factor, comma-separated: steps of lo <= rows < hi "
                    "scaled by factor (hi empty: no bound)")
    ap.add_argument("--out", help="write the predictions as JSON here")
    args = ap.parse_args(argv)
    if args.steps:
        doc = json.loads(Path(args.steps).read_text())
        points = {int(r["batch"]): float(r["bare_step_ms"]) for r in doc["rows"]}
        file_ctx = doc["rows"][-1].get("ctx_len")
        source = {"file": args.steps, "commit": doc.get("commit"), "gpu": doc.get("gpu")}
    else:
        points = {int(b): float(ms) for b, ms in _pairs(args.step, float)}
        source = {"step": args.step}
        file_ctx = None
    requests = [(r.prompt_len, r.output_len) for r in sharegpt(args.requests, args.seed).requests]
    step_ctx = float(args.step_ctx or file_ctx or 416)
    kv_ms = args.kv_bytes_per_token / (args.kv_gbps * 1e6) if args.kv_gbps else 0.0
    curve = step_curve(points, _what_if(args.what_if))
    result = {"bench": "saturation_model", "source": source, "steps_ms": points, "what_if": args.what_if,
              "prefill_cost": args.prefill_cost, "kv_gbps": args.kv_gbps, "step_ctx": step_ctx,
              "kv_bytes_per_token": args.kv_bytes_per_token, "requests": args.requests, "seed": args.seed, "runs": []}
    for tokens_budget, seqs in _pairs(args.budgets):
        run = simulate(requests, curve, seqs, tokens_budget, args.prefill_cost, kv_ms, step_ctx)
        result["runs"].append({"budget": f"{tokens_budget}:{seqs}", **run})
        split = ", ".join(f"{k} rows {v['s']:.1f} s / {v['tokens']:,} tok" for k, v in run["by_decode_rows"].items())
        print(f"{tokens_budget}:{seqs}: {run['output_tok_s']:,.0f} tok/s, {run['duration_s']:.1f} s, mean first "
              f"token {run['mean_first_token_s']:.2f} s; {split}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
