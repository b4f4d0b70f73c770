"""bench/ab_summary.py: bench/device_ab.sh's runs of two trees, summarized by tree, model and batch."""
import json

import pytest

from bench.ab_summary import main


def _run(root, rev, rnd, model, steps):
    folder = root / f"{rev}-{rnd}"
    folder.mkdir()
    rows = [{"batch": b, "bare_step_ms": ms, "floor_ms": 2.0} for b, ms in steps.items()]
    (folder / f"gpu_host-{rev}-{model.split(':')[-1]}.json").write_text(
        json.dumps({"commit": rev, "model": model, "gpu": "NVIDIA H100 80GB HBM3", "rows": rows}))


def test_medians_and_the_difference_by_model_and_batch(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    for rnd, (old, new) in enumerate([(3.10, 3.00), (3.12, 3.02), (3.11, 3.40)], start=1):
        _run(runs, "aaa1111", rnd, "random:qwen3-30b-a3b", {1: old, 8: old + 1})
        _run(runs, "bbb2222+dirty", rnd, "random:qwen3-30b-a3b", {1: new, 8: new + 1})
    assert main([str(runs), "--old", "aaa1111", "--new", "bbb2222+dirty", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "ab-bbb2222-dirty-vs-aaa1111.json").read_text())
    one = summary["models"]["random:qwen3-30b-a3b"]["1"]
    assert one["old_ms"] == [3.10, 3.12, 3.11] and one["new_ms"] == [3.00, 3.02, 3.40]   # run order kept
    assert one["delta_us"] == pytest.approx((3.02 - 3.11) * 1e3)                          # medians, not means
    assert one["new_over_floor"] == pytest.approx(3.02 / 2.0)
    assert summary["models"]["random:qwen3-30b-a3b"]["8"]["delta_us"] == pytest.approx((4.02 - 4.11) * 1e3)
    assert "| random:qwen3-30b-a3b | 1 | 3.100 / 3.120 / 3.110 | 3.000 / 3.020 / 3.400 | -90.0 |" in capsys.readouterr().out


def test_a_run_of_another_tree_or_of_one_tree_only_is_refused(tmp_path):
    _run(tmp_path, "aaa1111", 1, "random:llama-3-8b", {1: 5.5})
    with pytest.raises(SystemExit, match="runs of one tree only"):
        main([str(tmp_path), "--old", "aaa1111", "--new", "bbb2222"])
    _run(tmp_path, "ccc3333", 2, "random:llama-3-8b", {1: 5.4})
    with pytest.raises(SystemExit, match="stamped 'ccc3333'"):
        main([str(tmp_path), "--old", "aaa1111", "--new", "bbb2222"])
