"""Recompute recorded bare-step floors without the embedding table (issue 22's and issue 25's definition).

Until 2026-12-08 `bench/gpu_host.py` counted the whole embedding table in a step's floor, which a decode step
does not read (it looks up one row a token); the issues define the floor without it. This reads `gpu_host.py`
JSON files (or any JSON holding their rows, such as `h100_steps-58fcd7b.json`) and prints, for each row, the floor
the current `gpu_host.py` would report: the recorded floor x (bytes moved - the table's unread bytes) / bytes moved,
where bytes moved = achieved GB/s x step time (both recorded) and the unread bytes come from the model's preset.

    python bench/refloor.py bench/results/h100_steps-58fcd7b.json --out bench/results/refloor-58fcd7b.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_backend.models.presets import PRESETS  # noqa: E402


def model_of(label: str) -> str | None:
    """The preset a run's label or model name points at (longest match first: "qwen3-30b-a3b" before "qwen3-32b")."""
    label = label.lower().replace("random:", "")
    for name in sorted(PRESETS, key=len, reverse=True):
        if name in label:
            return name
    return "llama-3-8b" if "llama" in label else "qwen3-30b-a3b" if "moe" in label else None


def rows_in(obj, path: str = "", model: str | None = None):
    """(path, preset, row) for every recorded bare-step row under obj."""
    if isinstance(obj, dict):
        model = model_of(str(obj.get("model", ""))) or model
        if "bare_step_ms" in obj and "floor_ms" in obj and obj.get("achieved_gbps"):
            yield path, model, obj
        for key, value in obj.items():
            yield from rows_in(value, f"{path}/{key}", model_of(key) or model)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from rows_in(value, f"{path}[{i}]", model)


def refloor(row: dict, preset: str, bytes_per_param: int = 2) -> dict:
    """The row's floor without the embedding table's unread rows (bf16 tables: the table stays bf16 under fp8)."""
    cfg = PRESETS[preset]
    moved = row["achieved_gbps"] * row["bare_step_ms"] * 1e6
    unread = cfg.unread_embedding_params(row["batch"]) * bytes_per_param
    floor = row["floor_ms"] * (moved - unread) / moved
    return {"batch": row["batch"], "bare_step_ms": round(row["bare_step_ms"], 3),
            "floor_ms_recorded": round(row["floor_ms"], 3), "ratio_recorded": round(row["bare_step_ms"] / row["floor_ms"], 3),
            "unread_embedding_gb": round(unread / 1e9, 3), "floor_ms": round(floor, 3),
            "ratio": round(row["bare_step_ms"] / floor, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--model", default=None, help="preset for rows whose file does not name one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = []
    for name in args.files:
        for path, preset, row in rows_in(json.loads(Path(name).read_text())):
            preset = preset or args.model
            if preset is None:
                print(f"{name}{path}: no model named; pass --model", file=sys.stderr)
                continue
            r = {"file": Path(name).name, "row": path, "model": preset, **refloor(row, preset)}
            out.append(r)
            print(f"{r['file']}{path} {preset} batch {r['batch']}: {r['bare_step_ms']} ms, floor "
                  f"{r['floor_ms_recorded']} -> {r['floor_ms']} ms, ratio {r['ratio_recorded']} -> {r['ratio']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "refloor", "what": __doc__.splitlines()[0], "rows": out},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
