"""Prefix caching's figures from `blink bench` result files (issue 23's measurements; bench/device_prefix.sh).

    python bench/prefix_compare.py --on ON.json --off OFF.json          # caching on vs off, same workload
    python bench/prefix_compare.py --on ON.json --loads health.jsonl    # + per-backend load balance

For each file: TTFT P50, output throughput, the prompt tokens the server prefilled (prompt - cached, from usage)
against the workload's unavoidable minimum (prompt - reusable); with --off the on/off ratios the issue's
targets name (TTFT P50 at least 5x lower, output throughput at least 1.5x higher, multi-turn prefill at most
1.2x the minimum). --loads: lines of `/health` JSON sampled during the run; the time-averaged outstanding tokens
per backend and the larger / smaller ratio (target: at most 1.5).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def figures(doc: dict) -> dict:
    """The figures of one run (one result document)."""
    m, w = doc["metrics"], doc["workload"]
    cache = m.get("prefix_cache") or {"cached_tokens": 0, "prompt_tokens": m["total_input_tokens"], "hit_rate": 0.0}
    unavoidable = w["total_prompt_len"] - w.get("reusable_prompt_tokens", 0)
    prefilled = cache["prompt_tokens"] - cache["cached_tokens"]
    return {"label": doc["label"], "workload": w["name"], "ttft_p50_ms": m["ttft_ms"]["median"],
            "output_tok_s": m["output_throughput_tok_s"], "hit_rate": cache["hit_rate"],
            "prefilled_tokens": prefilled, "unavoidable_tokens": unavoidable,
            "prefill_over_minimum": prefilled / unavoidable if unavoidable else None, "failed": m["failed"]}


def ratios(on: dict, off: dict) -> dict:
    """Caching on against off: how much lower TTFT P50 is, how much higher output throughput is."""
    ttft = off["ttft_p50_ms"] / on["ttft_p50_ms"] if on["ttft_p50_ms"] else None
    throughput = on["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None
    return {"ttft_p50_lower_x": ttft, "output_throughput_higher_x": throughput}


def load_balance(samples: list[dict]) -> dict:
    """Mean outstanding tokens per backend over `/health` samples, and the larger over the smaller."""
    sums: dict[str, float] = {}
    for sample in samples:
        for backend in sample.get("backends", ()):
            sums[backend["addr"]] = sums.get(backend["addr"], 0.0) + backend.get("outstanding_tokens", 0)
    means = {addr: total / max(len(samples), 1) for addr, total in sums.items()}
    low, high = (min(means.values()), max(means.values())) if means else (0.0, 0.0)
    requests = {b["addr"]: b.get("requests", 0) for b in (samples[-1].get("backends", ()) if samples else ())}
    return {"mean_outstanding_tokens": means, "requests": requests,
            "imbalance_x": high / low if low else (None if high else 1.0)}


def read_samples(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a sample cut by the run's end
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--on", type=Path, required=True, help="result JSON with prefix caching on")
    p.add_argument("--off", type=Path, help="the same workload with prefix caching off")
    p.add_argument("--loads", type=Path, help="/health samples (JSON lines) taken during the --on run")
    args = p.parse_args(argv)
    report = {"on": figures(json.loads(args.on.read_text()))}
    if args.off:
        report["off"] = figures(json.loads(args.off.read_text()))
        report["on_vs_off"] = ratios(report["on"], report["off"])
    if args.loads:
        report["load_balance"] = load_balance(read_samples(args.loads))
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
