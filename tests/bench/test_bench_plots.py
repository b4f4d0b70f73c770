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


def test_steps_plots_gpu_host_sweeps_beside_anchors(tmp_path):
    """--steps: each bench/gpu_host.py file a line per mode (tokens a second = batch / step), labelled by its weights
    and KV dtype; non-finite modes (persistent not run: NaN) left out; anchors as lines; other files ignored."""
    plots = load_plots()
    rows = lambda scale: [{"batch": b, "bare_step_ms": (4 + b / 32) * scale, "floor_ms": 3.8 + b / 64,  # noqa: E731
                           "host": {"step_ms_median": (4.1 + b / 30) * scale},
                           "persistent": {"step_ms_mean": float("nan") if b == 256 else (4 + b / 31) * scale}}
                          for b in (1, 64, 256)]
    (tmp_path / "a.json").write_text(json.dumps({"bench": "gpu_host", "gpu": "G", "commit": "c1", "quantization": None,
                                                 "kv_cache_dtype": "auto", "rows": rows(1.0)}))
    (tmp_path / "b.json").write_text(json.dumps({"bench": "gpu_host", "gpu": "G", "commit": "c1", "quantization": "fp8",
                                                 "kv_cache_dtype": "fp8", "rows": rows(0.7)}))
    (tmp_path / "c.json").write_text(json.dumps(fake_run("blink", 1, 0, 1)))
    steps = plots.load_steps([str(tmp_path)])
    assert set(steps) == {"bf16 weights (G, c1)", "fp8 weights, fp8 KV (G, c1)"}
    anchors = tmp_path / "anchors.json"
    anchors.write_text(json.dumps({"anchors": [{"label": "peer", "tok_s": 10000}]}))
    out = tmp_path / "steps.png"
    assert plots.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--steps", "--anchors", str(anchors),
                       "--out", str(out)]) == 0
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with pytest.raises(ValueError, match="gpu_host"):
        plots.plot_steps({}, [], tmp_path / "none.png")
