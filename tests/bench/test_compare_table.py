"""bench/compare_table.py: one row per system and interference level, same-work runs only, ratios
against the system's own isolated run, and a clear mark where a figure was not measured."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import compare_table  # noqa: E402


def _doc(label, threads, tok_s, p99_ttft, p99_tpot, rate="inf", requests=128, cpu=True):
    stats = lambda p50, p99: {"median": p50, "p99": p99}  # noqa: E731
    return {"label": label, "arrivals": {"rate": rate}, "interference": {"threads": threads} if threads else None,
            "metrics": {"num_requests": requests, "output_throughput_tok_s": tok_s, "ttft_ms": stats(1.0, p99_ttft),
                        "tpot_ms": stats(1.0, p99_tpot)},
            "server": {"cpu": {"available": cpu, "cpu_s_per_token": 2e-6}, "nvml": {"available": False}}}


def test_rows_compare_each_system_with_its_own_isolated_run(tmp_path, capsys):
    docs = {"a_iso.json": _doc("blink", 0, 1000.0, 100.0, 10.0), "b_i24.json": _doc("blink", 24, 990.0, 110.0, 10.5),
            "c_iso.json": _doc("peer", 0, 200.0, 700.0, 100.0, cpu=False),
            "d_i24.json": _doc("peer", 24, 150.0, 1400.0, 120.0, cpu=False),
            "e_rate.json": _doc("blink", 0, 5.0, 1.0, 1.0, rate=8.0),  # another rate: not the same work
            "f_n.json": _doc("blink", 12, 5.0, 1.0, 1.0, requests=300)}  # another request count
    for name, doc in docs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    assert compare_table.main([str(tmp_path), "--requests", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = [line for line in lines if line.startswith("| blink") or line.startswith("| peer")]
    assert len(body) == 4
    blink24 = next(line for line in body if line.startswith("| blink | 24"))
    assert "0.990x, 1.10x, 1.05x" in blink24 and "2.00 us" in blink24 and "not measured" in blink24
    peer24 = next(line for line in body if line.startswith("| peer | 24"))
    assert "0.750x, 2.00x, 1.20x" in peer24 and peer24.count("not measured") == 2
    assert any("7,475 tok/s" in line for line in lines)


def test_nothing_matching_says_so(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"bench": "gpu_host"}))
    assert compare_table.main([str(tmp_path)]) == 1
    assert "no matching runs" in capsys.readouterr().err
