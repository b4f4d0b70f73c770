"""bench/fp8_gemm_probe.py's pure parts on made-up timings (no GPU, no Triton): arguments, which tiles run at
which M, L2-defeating weight copies, the rates, the tolerance, the per-M decision and main's JSON."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import fp8_gemm_probe as probe  # noqa: E402


def test_arguments_default_to_every_m_and_both_shapes_and_refuse_bad_values(capsys):
    args = probe.parse_args([])
    assert args.m == [1, 8, 16, 32, 64, 128, 256, 512] and args.shapes == ["o", "gate_up"]
    assert probe.parse_args(["--m", "4,300", "--shapes", "o"]).m == [4, 300]
    for bad, said in ((["--m", "1,x"], "comma-separated integers"), (["--m", "0"], ">= 1"),
                      (["--shapes", "qkv"], "unknown ['qkv']")):
        with pytest.raises(SystemExit):
            probe.parse_args(bad)
        assert said in capsys.readouterr().err


def test_each_m_runs_the_tiles_of_its_tier():
    small, mid, large = probe.candidates_for(1), probe.candidates_for(32), probe.candidates_for(256)
    assert probe.candidates_for(16) == small and probe.candidates_for(17) == mid == probe.candidates_for(64)
    assert probe.candidates_for(65) == large == probe.candidates_for(4096)
    assert all(cfg[0] == 16 for cfg in small)             # no tile taller than the smallest tl.dot for M <= 16
    assert {cfg[6] for cfg in small} == {True, False} and any(cfg[5] > 1 for cfg in small)  # swap and split-K
    assert len(small) + len(mid) + len(large) == len(probe.CANDIDATES)


def test_config_names_show_split_k_only_when_split():
    assert probe.config_name((16, 64, 128, 4, 4, 1, False)) == "16x64x128 w4 s4"
    assert probe.config_name((16, 64, 128, 4, 4, 4, True)) == "16x64x128 w4 s4 k/4"


def test_weight_copies_in_rotation_outgrow_l2():
    for shape, (n, k) in probe.SHAPES.items():
        for num_bytes in (n * k, 2 * n * k):
            copies = probe.copies_for(num_bytes)
            assert copies >= 2 and copies * num_bytes >= probe.L2_DEFEAT_BYTES
            assert (copies - 1) * num_bytes < probe.L2_DEFEAT_BYTES or copies == 2


def test_rates_count_weight_bytes_once_and_two_flops_per_multiply_add():
    bf16 = probe.make_row("o", 256, "bf16", "cuBLAS", 100.0, 0.01, 0.5)
    fp8 = probe.make_row("o", 256, "swap", "x", 100.0, 0.01, 1.5)
    assert bf16["weight_gbps"] == pytest.approx(4096 * 4096 * 2 / 100e3)
    assert fp8["weight_gbps"] == pytest.approx((4096 * 4096 + 4096 * 4) / 100e3)
    assert bf16["tflops"] == pytest.approx(2 * 256 * 4096 * 4096 / 100e6)
    assert bf16["ok"] and not fp8["ok"]


def test_tolerance_passes_bf16_rounding_and_fails_a_percent_off():
    ref = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    max_err, ratio = probe.tolerance_ratio(ref.to(torch.bfloat16), ref)
    assert 0 < max_err and ratio <= 0.5
    assert probe.tolerance_ratio((ref * 1.02).to(torch.bfloat16), ref)[1] > 1.0


def _rows():
    return [probe.make_row("gate_up", 256, "bf16", "cuBLAS", 300.0, 0.0, 0.1),
            probe.make_row("gate_up", 256, "today", "128x128x64 w8 s3", 400.0, 0.0, 0.2),
            probe.make_row("gate_up", 256, "swap", "128x128x64 w8 s3", 250.0, 0.0, 0.2),
            probe.make_row("gate_up", 256, "nk", "fast but wrong", 100.0, 5.0, 40.0),
            probe.error_row("gate_up", 256, "w8a8", "quant+_scaled_mm", "RuntimeError: refused"),
            probe.make_row("o", 1, "bf16", "cuBLAS", 20.0, 0.0, 0.1),
            probe.make_row("o", 1, "today", "16x64x128 w4 s4", 25.0, 0.0, 0.1)]


def test_the_decision_takes_the_fastest_correct_row_per_shape_and_m():
    best = {(b["shape"], b["m"]): b for b in probe.best_per_case(_rows())}
    big, one = best[("gate_up", 256)], best[("o", 1)]
    assert big["winner"] == "swap 128x128x64 w8 s3" and big["winner_us"] == 250.0
    assert big["weight_only_vs_bf16"] == pytest.approx(300 / 250)
    assert one["winner"] == "bf16 cuBLAS" and one["weight_only_vs_bf16"] == pytest.approx(20 / 25)


def test_table_keeps_error_rows_and_ends_with_the_decision():
    rows = _rows()
    lines = probe.format_table(rows, probe.best_per_case(rows)).splitlines()
    assert len(lines) == 1 + len(rows) + 2
    assert "RuntimeError: refused" in next(line for line in lines if " w8a8 " in line)
    assert " NO" in next(line for line in lines if "fast but wrong" in line)
    assert lines[-2].startswith("best gate_up") and "1.20x bf16" in lines[-2]


def test_main_writes_the_json_and_fails_when_a_variant_misses(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(probe, "measure_shape", lambda shape, ms: [r for r in _rows() if r["shape"] == shape])
    monkeypatch.setattr(probe, "_environment", lambda: {"gpu": "made-up H100"})
    monkeypatch.setenv("BLINK_COMMIT", "abc1234")
    monkeypatch.delenv("OUT", raising=False)
    assert probe.main(["--out", str(tmp_path)]) == 1     # the wrong row and the error row
    result = json.loads((tmp_path / "fp8_gemm_probe-abc1234.json").read_text())
    assert result["gpu"] == "made-up H100" and result["commit"] == "abc1234" and len(result["rows"]) == 7
    assert {b["shape"] for b in result["best"]} == {"o", "gate_up"}
    monkeypatch.setattr(probe, "measure_shape", lambda shape, ms: [r for r in _rows()[:3] if r["shape"] == shape])
    assert probe.main(["--out", str(tmp_path), "--shapes", "gate_up"]) == 0
    assert "best gate_up" in capsys.readouterr().out


@pytest.mark.parametrize("m", [3, 40, 130])
def test_every_candidate_kernel_matches_the_dequantized_weight_in_triton_s_interpreter(m, monkeypatch):
    """bench/fp8_gemm_kernels.py on the CPU through Triton's interpreter (needs Triton; fp16 activations, as the
    interpreter mishandles bf16): each tile, swap and split-K of m's tier against float32 x @ (q * scale)^T."""
    import importlib

    from gpu_backend.models.fp8 import quantize_weight

    monkeypatch.setenv("TRITON_INTERPRET", "1")     # read when Triton and the kernels load: import afresh
    pytest.importorskip("triton")
    sys.modules.pop("fp8_gemm_kernels", None)
    kernels = importlib.import_module("fp8_gemm_kernels")
    gen = torch.Generator().manual_seed(m)
    n, k = 256, 512
    fw = quantize_weight(torch.randn(n, k, generator=gen) * k ** -0.5, fp8_activations=False)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    ref = x.float() @ fw.dequantize().t()
    for cfg in probe.candidates_for(m):
        out = kernels.w8_nk_mm(x, fw.q, fw.scale, cfg)
        assert out.shape == (m, n) and out.dtype == x.dtype
        assert probe.tolerance_ratio(out, ref)[1] < 0.5, probe.config_name(cfg)
    sys.modules.pop("fp8_gemm_kernels", None)
