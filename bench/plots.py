"""PNG plots of `blink bench` results: P99 TTFT, P99 TPOT and output throughput against request rate.

    python bench/plots.py bench/results/ [more files or folders] --out bench/results/sweep.png

One line per system (the run's `label`), one column per interference level (isolated first, then
each number of interfering threads), side by side with shared y axes per metric. Runs at rate inf have
no place on a rate axis and are left out (listed on stderr). When several files hold the same system,
level and rate, the last one by file name (they carry a UTC timestamp) wins.

    python bench/plots.py FILES --bars [--requests 128] --out bench/results/compare.png

--bars: the all-at-once runs instead (issue 5's comparison): per metric, one group of bars per system,
one bar per interference level, plus a panel of interfered / isolated ratios (output tok/s, P99 TPOT).

    python bench/plots.py GPU_HOST_FILES --steps [--anchors bench/data/issue22_anchors.json] --out FILE.png

--steps: `bench/gpu_host.py` results (issue 22's sweeps, e.g. bf16 beside FP8): per file, decode tokens a second
at each batch (batch / step) for the bare graph replay, host mode and persistent mode, and the step over its
floor; the anchors (served saturation figures of peers and goals) as horizontal lines on the tokens panel. A
bare step's tokens a second is an upper bound of what serving at that batch gives (no prefill, no scheduling).
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
    return _save(fig, out)


def _save(fig, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def load_saturation(paths: list[str], requests: int | None = None) -> dict[tuple[str, int], dict]:
    """(label, interfering threads) -> metrics of the all-at-once runs (of `requests` requests if given)."""
    runs: dict[tuple[str, int], dict] = {}
    for f in result_files(paths):
        doc = json.loads(f.read_text())
        if "metrics" not in doc or "arrivals" not in doc or not math.isinf(float(doc["arrivals"]["rate"])):
            continue
        if requests is not None and doc["metrics"].get("num_requests") != requests:
            continue
        runs[(doc["label"], (doc.get("interference") or {}).get("threads", 0))] = doc["metrics"]
    return runs


def plot_bars(runs: dict[tuple[str, int], dict], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no all-at-once run to plot")
    levels = sorted({level for _, level in runs})
    labels = sorted({label for label, _ in runs})
    width = 0.8 / len(levels)
    fig, axes = plt.subplots(1, len(METRICS) + 1, figsize=(4.6 * (len(METRICS) + 1), 4.2), squeeze=False)
    panels = [(name, get, True) for name, get in METRICS]
    panels.append(("interfered / isolated: tok/s (solid), P99 TPOT (hatched)", None, False))
    for ax, (name, get, log) in zip(axes[0], panels):
        for j, level in enumerate(levels):
            xs, ys, extra = [], [], []
            for i, label in enumerate(labels):
                m, base = runs.get((label, level)), runs.get((label, 0))
                if m is None:
                    continue
                if get is not None:
                    xs.append(i + (j - (len(levels) - 1) / 2) * width)
                    ys.append(get(m))
                elif level and base:
                    x = i + (j - (len(levels) - 1) / 2) * width
                    xs.append(x - width / 4)
                    ys.append(m["output_throughput_tok_s"] / base["output_throughput_tok_s"])
                    extra.append((x + width / 4, m["tpot_ms"]["p99"] / base["tpot_ms"]["p99"]))
            if get is None and not level:
                continue
            bw = width if get is not None else width / 2
            bars = ax.bar(xs, ys, bw, color=f"C{j}", label=_title(level))
            ax.bar_label(bars, fmt=lambda v: f"{v:,.0f}" if v >= 100 else f"{v:.3g}", fontsize=6, rotation=90, padding=2)
            if extra:
                bars = ax.bar([x for x, _ in extra], [y for _, y in extra], bw, color=f"C{j}", hatch="//",
                              alpha=0.6)
                ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="k", lw=0.8)
        ax.margins(y=0.25)
        ax.set_xticks(range(len(labels)), labels, fontsize="small")
        ax.set_title(name, fontsize="small")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="x-small")
    return _save(fig, out)


def load_steps(paths: list[str]) -> dict[str, list[dict]]:
    """`gpu_host.py` result files -> {label: rows}, the label naming the file's GPU, weights and KV cache."""
    steps = {}
    for f in result_files(paths):
        doc = json.loads(f.read_text())
        if doc.get("bench") != "gpu_host" or not doc.get("rows"):
            continue
        weights = doc.get("quantization") or "bf16"
        kv = doc.get("kv_cache_dtype") or "auto"
        label = f"{weights} weights" + (f", {kv} KV" if kv != "auto" else "") + f" ({doc.get('gpu', '?')}, {doc.get('commit', '?')})"
        steps[label] = sorted(doc["rows"], key=lambda r: r["batch"])
    return steps


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def plot_steps(steps: dict[str, list[dict]], anchors: list[dict], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not steps:
        raise ValueError("no bench/gpu_host.py result to plot")
    fig, (tok_ax, over_ax) = plt.subplots(1, 2, figsize=(13, 5))
    modes = [("bare", lambda r: r["bare_step_ms"], "-"), ("host", lambda r: (r.get("host") or {}).get("step_ms_median"), "--"),
             ("persistent", lambda r: (r.get("persistent") or {}).get("step_ms_mean"), ":")]
    for i, (label, rows) in enumerate(steps.items()):
        for mode, get, style in modes:
            pts = [(r["batch"], r["batch"] / get(r) * 1e3) for r in rows if _finite(get(r))]
            if pts:
                tok_ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{label}: {mode}")
        over = [(r["batch"], r["bare_step_ms"] / r["floor_ms"]) for r in rows if _finite(r.get("floor_ms"))]
        if over:
            over_ax.plot(*zip(*over), marker="o", color=f"C{i}", label=label)
    styles = ["-", "--", ":", "-."]
    for j, a in enumerate(anchors):  # in the legend: close values would overlap as labels on the lines
        tok_ax.axhline(a["tok_s"], color=f"{0.15 + 0.1 * (j % 6):.2f}", lw=0.9, ls=styles[j % len(styles)],
                       label=f"{a['label']}: {a['tok_s']:,}")
    for ax in (tok_ax, over_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoding, one token each)")
        ax.grid(True, alpha=0.3)
    tok_ax.set_yscale("log")
    tok_ax.set_ylabel("decode tokens / s (batch / step)")
    tok_ax.set_title("step throughput; lines: served saturation anchors", fontsize="small")
    tok_ax.legend(fontsize=6)
    over_ax.axhline(1.0, color="k", lw=0.8)
    over_ax.set_ylabel("bare step / floor (bytes at copy bandwidth)")
    over_ax.set_title("bare step over its floor", fontsize="small")
    over_ax.legend(fontsize=6)
    return _save(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="result JSON files or folders holding them")
    p.add_argument("--out", default="bench/results/sweep.png")
    p.add_argument("--bars", action="store_true", help="all-at-once runs as bars per system and interference level")
    p.add_argument("--requests", type=int, default=None, help="--bars: keep runs of exactly this many requests")
    p.add_argument("--steps", action="store_true", help="bench/gpu_host.py sweeps: tokens a second by batch, by mode")
    p.add_argument("--anchors", default=None, help="--steps: a JSON file of {anchors: [{label, tok_s}]} lines")
    args = p.parse_args(argv)
    if args.steps:
        anchors = json.loads(Path(args.anchors).read_text())["anchors"] if args.anchors else []
        print(plot_steps(load_steps(args.paths), anchors, args.out))
    elif args.bars:
        print(plot_bars(load_saturation(args.paths, args.requests), args.out))
    else:
        print(plot(load_runs(args.paths), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
