"""The summary of bench/device_ab.sh: two trees' bare steps, run alternately, side by side.

    python bench/ab_summary.py RUNS_DIR --old REV --new REV [--out DIR]

RUNS_DIR holds one folder per run, each with bench/gpu_host.py's JSON (stamped with its tree's revision). Prints a
table (each run's step, the medians, new - old, new over its floor) and writes DIR/ab-NEW-vs-OLD.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def collect(runs_dir: Path, old: str, new: str) -> dict:
    """{model: {batch: {"old": [(step_ms, floor_ms)...], "new": [...]}}} in run order (folder names), plus the GPU."""
    by_model: dict = {}
    gpus = set()
    for path in sorted(runs_dir.glob("*/gpu_host-*.json"), key=lambda p: (int(p.parent.name.rsplit("-", 1)[-1]), p)):
        run = json.loads(path.read_text())
        side = {old: "old", new: "new"}.get(run.get("commit"))
        if side is None:
            raise SystemExit(f"{path}: stamped {run.get('commit')!r}, neither --old {old} nor --new {new}")
        gpus.add(run.get("gpu"))
        for row in run["rows"]:
            cell = by_model.setdefault(run["model"], {}).setdefault(row["batch"], {"old": [], "new": []})
            cell[side].append((row["bare_step_ms"], row["floor_ms"]))
    return {"gpus": sorted(g for g in gpus if g), "models": by_model}


def summarize(collected: dict, old: str, new: str) -> dict:
    models = {}
    for model, batches in collected["models"].items():
        for batch, cell in sorted(batches.items()):
            if not cell["old"] or not cell["new"]:
                raise SystemExit(f"{model} batch {batch}: runs of one tree only (old {len(cell['old'])}, "
                                 f"new {len(cell['new'])})")
            old_ms, new_ms = ([s for s, _ in cell[k]] for k in ("old", "new"))
            floor = statistics.median(f for k in ("old", "new") for _, f in cell[k])
            models.setdefault(model, {})[str(batch)] = {
                "old_ms": old_ms, "new_ms": new_ms, "floor_ms": [f for k in ("old", "new") for _, f in cell[k]],
                "old_median_ms": statistics.median(old_ms), "new_median_ms": statistics.median(new_ms),
                "delta_us": (statistics.median(new_ms) - statistics.median(old_ms)) * 1e3,
                "new_over_floor": statistics.median(new_ms) / floor}
    return {"bench": "device_ab", "old": old, "new": new, "gpus": collected["gpus"],
            "what": "bench/gpu_host.py --bare-only bare steps (the new tree's script for both), the two trees alternated on one machine",
            "models": models}


def table(summary: dict) -> str:
    lines = [f"| model | batch | old {summary['old']} ms | new {summary['new']} ms | new - old us | new / floor |",
             "|---|---|---|---|---|---|"]
    for model, batches in summary["models"].items():
        for batch, r in batches.items():
            runs = lambda ms: " / ".join(f"{x:.3f}" for x in ms)
            lines.append(f"| {model} | {batch} | {runs(r['old_ms'])} | {runs(r['new_ms'])} | {r['delta_us']:+.1f} | "
                         f"{r['new_over_floor']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", type=Path)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--out", type=Path, default=None, help="where ab-NEW-vs-OLD.json goes (none: print only)")
    args = ap.parse_args(argv)
    summary = summarize(collect(args.runs_dir, args.old, args.new), args.old, args.new)
    print(table(summary))
    if args.out is not None:
        name = f"ab-{args.new}-vs-{args.old}.json".replace("+", "-")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
