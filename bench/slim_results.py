"""Strip per-request records out of result JSON files, keeping every aggregate figure.

    python bench/slim_results.py [FILES or folders; default bench/results/] [--check]

A run's summary is what git keeps (`bench/RESULTS.md` cites it); its per-request records go to the
git-ignored `NAME.records.json.gz` beside it (`blink.bench.results.write_summary`). Records are:
- `requests`: the list of per-request dicts `blink bench` wrote before summaries and records were split
  (its `metrics` already hold every aggregate);
- a top-level list of at least `MIN_SAMPLES` numbers (per-request timings, e.g. `http_ms`): replaced in
  the summary by `<key>_summary` (count, mean, P50, P90, P99, max), so no figure drawn from it is lost.
Idempotent: a file with nothing to strip is left alone. `--check` changes nothing and exits 1 when a file
still holds records.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blink.bench.results import RECORDS_SUFFIX, write_summary  # noqa: E402

MIN_SAMPLES = 20
DEFAULT_DIR = Path(__file__).resolve().parent / "results"


def _is_samples(value) -> bool:
    return (isinstance(value, list) and len(value) >= MIN_SAMPLES
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def sample_summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"count": len(ordered), "mean": statistics.fmean(ordered), "p50": _percentile(ordered, 0.5),
            "p90": _percentile(ordered, 0.9), "p99": _percentile(ordered, 0.99), "max": ordered[-1]}


def split_records(doc: dict) -> tuple[dict, dict]:
    """(summary, records): `doc` without its per-request lists, and those lists by key."""
    summary, records = {}, {}
    for key, value in doc.items():
        if key == "requests" and isinstance(value, list):
            records[key] = value
        elif _is_samples(value):
            records[key] = value
            summary[f"{key}_summary"] = sample_summary(value)
        else:
            summary[key] = value
    return summary, records


def result_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    return [f for f in files if not f.name.endswith(RECORDS_SUFFIX)]


def slim(path: Path, check: bool = False) -> int:
    """Bytes the file's records take in it (0: nothing to strip); rewrites it unless `check`."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        return 0
    summary, records = split_records(doc)
    if not records:
        return 0
    before = path.stat().st_size
    if not check:
        write_summary(path, summary, records)
    return before - (0 if check else path.stat().st_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=[str(DEFAULT_DIR)])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file holds records")
    args = ap.parse_args(argv)
    found = 0
    for path in result_files(args.paths):
        saved = slim(path, args.check)
        if saved:
            found += 1
            print(f"{path.name}: {saved / 1e6:.2f} MB of records {'to strip' if args.check else 'moved out'}")
    print(f"{found} file(s) {'hold records' if args.check else 'slimmed'}", file=sys.stderr)
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
