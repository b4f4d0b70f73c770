"""FP8 on the GPU (run on the device machine, skipped elsewhere): the FP8 GEMV, the W8A8 GEMM and the
weight-only GEMM against their dequantized reference, and the persistent loop giving host mode's tokens bit for
bit with FP8 weights (both `--quantization` schemes) and an FP8 KV cache (`--kv-cache-dtype fp8`)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

from test_gpu_runner import _drive, _peaky_model, _specs  # noqa: E402
from test_persistent import CONFIG, served  # noqa: E402,F401
from gpu_backend.models.fp8 import fp8_linear, quantize_tokens, quantize_weight  # noqa: E402
from protocols.ring import FinishReason  # noqa: E402


@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 512), (6144, 4096)])
def test_the_fp8_gemv_is_the_dequantized_rows_product(n, k):
    from kernels.gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    wq = quantize_weight(w)
    out = gemv(x, wq.q, scale=wq.scale)
    reference = x.float() @ wq.dequantize().t()
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-3)  # bf16 output rounding


@pytest.mark.parametrize("m,k", [(1, 2048), (7, 4096), (256, 14336)])
def test_the_one_kernel_quantizer_matches_the_torch_ops(m, k):
    from kernels.fp8_quant import quantize_tokens as one_kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) * torch.logspace(-2, 2, m, device="cuda")[:, None]
    q, s = one_kernel(x)
    q_ref, s_ref = quantize_tokens(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # at most one rounding step: an eighth of the value for normal e4m3 numbers, 2^-9 among the subnormals (the
    # kernel's division is not torch's bit for bit, so a value on a rounding boundary may land on either side)
    assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() / 8 + 2 ** -9).all()


@pytest.mark.parametrize("m", [1, 8, 64, 256])
def test_the_fp8_gemm_is_the_dequantized_operands_product(m):
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(4096, 2048, device="cuda", generator=gen) * 0.02
    x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    wq = quantize_weight(w)
    xq, xs = quantize_tokens(x)
    reference = (xq.float() * xs) @ wq.dequantize().t()
    torch.testing.assert_close(fp8_linear(x, wq).float(), reference, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("m,n,k", [(2, 4096, 4096), (8, 1000, 576), (64, 6144, 4096), (200, 3072, 1536),
                                   (256, 4096, 14336)])
def test_the_weight_only_fp8_gemm_is_x_times_the_dequantized_rows(m, n, k):
    from kernels.fp8_gemm import fp8_weight_only_mm

    gen = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    wq = quantize_weight(w, fp8_activations=False)
    reference = x.float() @ wq.dequantize().t() + b.float()
    out = fp8_weight_only_mm(x, wq.q, wq.scale, b)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-3)  # bf16 output rounding
    torch.testing.assert_close(fp8_linear(x, wq, b, weight_only_mm=fp8_weight_only_mm), out, rtol=0, atol=0)
    # the default path rounds the dequantized weight to bf16 before its GEMM (the kernel scales its float32 sums):
    # near-zero outputs differ by a few bf16 steps of the operands, so the two meet within a looser bound
    dequantized = fp8_linear(x, wq, b)
    torch.testing.assert_close(out.float(), dequantized.float(), rtol=2e-2, atol=2e-2)


def _fp8_runner(model, cfg, scheme: str = "fp8"):
    from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig

    model.quantization = scheme
    return GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                                 context_len=512, num_kv_blocks=96, sampling_extensions=False,
                                                 kv_cache_dtype="fp8"),
                     progress=False, keep_graphs=True)


@pytest.mark.parametrize("scheme", ["fp8", "fp8-partial"])
def test_persistent_gives_host_tokens_with_fp8_weights_and_kv(served, scheme):  # noqa: F811
    cfg, model = _peaky_model()
    runner = _fp8_runner(model.to(device="cuda", dtype=torch.bfloat16), cfg, scheme)
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    layer = runner.weights.layers[0]
    assert type(layer.gate_up).__name__ == "Fp8Weight" and layer.gate_up.fp8_activations == (scheme == "fp8")
    assert (type(layer.down).__name__ == "Fp8Weight") == (scheme == "fp8")  # fp8-partial keeps down in bf16
    host_tokens, host_fin, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    s = served(runner, cfg)
    slots = s.submit(_specs())
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert [s.finishes[x][0] for x in slots] == host_fin == [FinishReason.LENGTH] * 4
    assert [s.tokens[x] for x in slots] == host_tokens
