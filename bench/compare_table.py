"""Issue 5's comparison table from `blink bench` JSON files: one row per system and interference level.

    python bench/compare_table.py bench/results/<files or folders> [--rate inf] [--requests N]

Columns: throughput, P50/P99 TTFT, P50/P99 TPOT, backend CPU per token, energy per token, and each
system's interfered/isolated ratios (throughput, P99 TTFT, P99 TPOT). Runs are grouped by `label` and
interference threads; only runs at `--rate` (default: all at once) and, when given, with `--requests`
requests are kept, so every row is the same work. When several files hold the same system and level,
the last by file name (they carry a UTC timestamp) wins. The published vLLM v0.13 H100 anchors from
../shared/BENCH.md are printed beside the table (another GPU: compare as ratios). Prints Markdown.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ANCHORS = ("vLLM v0.13, H100, Llama-3-8B, ShareGPT (Blink paper): 7,475 tok/s isolated, 1,961 tok/s with 24 "
           "interfering threads (0.26x); P99 TTFT 150 ms, P99 TPOT 14.4 ms isolated")


def load(paths: list[str], rate: float, requests: int | None) -> dict[tuple[str, int], tuple[Path, dict]]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    runs: dict[tuple[str, int], tuple[Path, dict]] = {}
    for f in sorted(files, key=lambda f: f.name):
        doc = json.loads(f.read_text())
        if "metrics" not in doc or "arrivals" not in doc:
            continue  # another benchmark's file
        doc_rate = float(doc["arrivals"]["rate"])
        if not (doc_rate == rate or (math.isinf(rate) and math.isinf(doc_rate))):
            continue
        if requests is not None and doc["metrics"]["num_requests"] != requests:
            continue
        level = (doc.get("interference") or {}).get("threads", 0)
        runs[(doc["label"], level)] = (f, doc)
    return runs


def _server(doc: dict, kind: str, key: str) -> float | None:
    part = (doc.get("server") or {}).get(kind) or {}
    return part.get(key) if part.get("available") else None


def rows(runs: dict[tuple[str, int], tuple[Path, dict]]) -> list[str]:
    out = ["| system | interference | output tok/s | TTFT P50 / P99 | TPOT P50 / P99 | backend CPU per token "
           "| energy per token | vs isolated: tok/s, P99 TTFT, P99 TPOT | file |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (label, level), (f, doc) in sorted(runs.items()):
        m = doc["metrics"]
        cpu, energy = _server(doc, "cpu", "cpu_s_per_token"), _server(doc, "nvml", "energy_mj_per_token")
        base = runs.get((label, 0))
        ratios = "-"
        if level and base:
            b = base[1]["metrics"]
            ratios = (f"{m['output_throughput_tok_s'] / b['output_throughput_tok_s']:.3f}x, "
                      f"{m['ttft_ms']['p99'] / b['ttft_ms']['p99']:.2f}x, {m['tpot_ms']['p99'] / b['tpot_ms']['p99']:.2f}x")
        elif level:
            ratios = "no isolated run"
        out.append(
            f"| {label} | {level or 'isolated'} | {m['output_throughput_tok_s']:,.0f} | "
            f"{m['ttft_ms']['median']:.1f} / {m['ttft_ms']['p99']:.1f} ms | "
            f"{m['tpot_ms']['median']:.2f} / {m['tpot_ms']['p99']:.2f} ms | "
            f"{f'{cpu * 1e6:.2f} us' if cpu is not None else 'not measured'} | "
            f"{f'{energy:.0f} mJ' if energy is not None else 'not measured'} | {ratios} | `{f.name}` |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--rate", type=float, default=math.inf, help="arrival rate of the runs to compare (default inf)")
    ap.add_argument("--requests", type=int, default=None, help="keep runs of exactly this many requests")
    args = ap.parse_args(argv)
    runs = load(args.paths, args.rate, args.requests)
    if not runs:
        print("no matching runs", file=sys.stderr)
        return 1
    print("\n".join(rows(runs)))
    print(f"\nAnchor: {ANCHORS}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
