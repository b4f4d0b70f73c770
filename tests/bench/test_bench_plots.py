"""bench/plots.py writes a PNG from result JSON files."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import ROOT

pytest.importorskip("matplotlib")


def load_plots():
    spec = importlib.util.spec_from_file_location("bench_plots", ROOT / "bench" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(label: str, rate, threads: int, scale: float) -> dict:
    stats = lambda v: {"mean": v, "median": v, "p90": v, "p99": v, "count": 1}  # noqa: E731
    return {"label": label, "arrivals": {"rate": rate}, "interference": {"threads": threads} if threads else None,
            "metrics": {"ttft_ms": stats(100 * scale), "tpot_ms": stats(10 * scale),
                        "output_throughput_tok_s": 1000 / scale}}


def test_plots_write_a_png(tmp_path):
    plots = load_plots()
    for i, (label, threads, scale) in enumerate([("blink", 0, 1), ("blink", 12, 1.1), ("hf", 0, 2), ("hf", 12, 6)]):
        for rate in (1, 2, 4, "inf"):
            path = tmp_path / f"{i}_{rate}.json"
            path.write_text(json.dumps(fake_run(label, rate, threads, scale * (rate if rate != "inf" else 8))))
    runs = plots.load_runs([str(tmp_path)])
    assert set(runs) == {("blink", 0), ("blink", 12), ("hf", 0), ("hf", 12)}
    assert set(runs[("hf", 12)]) == {1.0, 2.0, 4.0}  # rate inf has no place on the axis
    out = plots.main([str(tmp_path), "--out", str(tmp_path / "sweep.png")])
    png = (tmp_path / "sweep.png").read_bytes()
    assert out == 0 and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
