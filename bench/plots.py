"""PNG plots of `blink bench` results: P99 TTFT, P99 TPOT and output throughput against request rate.

    python bench/plots.py bench/results/ [more files or folders] --out bench/results/sweep.png

One line per system (the run's `label`), one column per interference level (isolated first, then
each number of interfering threads), side by side with shared y axes per metric. Runs at rate inf have
no place on a rate axis and are left out (listed on stderr). When several files hold the same system,
level and rate, the last one by file name (they carry a UTC timestamp) wins.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

METRICS = [("P99 TTFT (ms)", lambda m: m["ttft_ms"]["p99"]),
           ("P99 TPOT (ms)", lambda m: m["tpot_ms"]["p99"]),
           ("output throughput (tok/s)", lambda m: m["output_throughput_tok_s"])]


def result_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    return sorted(files, key=lambda f: f.name)


def load_runs(paths: list[str]) -> dict[tuple[str, int], dict[float, dict]]:
    """(label, interfering threads) -> {rate: metrics}, finite rates only."""
    runs: dict[tuple[str, int], dict[float, dict]] = {}
    for f in result_files(paths):
        doc = json.loads(f.read_text())
        rate = float(doc["arrivals"]["rate"])
        if math.isinf(rate):
            print(f"{f}: rate inf, not plotted", file=sys.stderr)
            continue
        level = (doc.get("interference") or {}).get("threads", 0)
        runs.setdefault((doc["label"], level), {})[rate] = doc["metrics"]
    return runs


def _title(level: int) -> str:
    return "isolated" if level == 0 else f"{level} interfering threads"


def plot(runs: dict[tuple[str, int], dict[float, dict]], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no run with a finite request rate to plot")
    levels = sorted({level for _, level in runs})
    labels = sorted({label for label, _ in runs})
    fig, axes = plt.subplots(len(METRICS), len(levels), figsize=(5 * len(levels), 3.2 * len(METRICS)),
                             sharex=True, sharey="row", squeeze=False)
    for col, level in enumerate(levels):
        for row, (name, get) in enumerate(METRICS):
            ax = axes[row][col]
            for label in labels:
                points = sorted(runs.get((label, level), {}).items())
                xs = [rate for rate, m in points if get(m) is not None]
                ys = [get(m) for _, m in points if get(m) is not None]
                if xs:
                    ax.plot(xs, ys, marker="o", label=label, color=f"C{labels.index(label)}")
            ax.set_xscale("log")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(name)
            ax.grid(True, alpha=0.3)
            if row == 0:
                ax.set_title(_title(level))
                ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="result JSON files or folders holding them")
    p.add_argument("--out", default="bench/results/sweep.png")
    args = p.parse_args(argv)
    print(plot(load_runs(args.paths), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
