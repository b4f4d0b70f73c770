"""FP8 on the GPU (run on the device machine, skipped elsewhere): the FP8 GEMV and GEMM against their
dequantized reference, and the persistent loop giving host mode's tokens bit for bit with FP8 weights and an
FP8 KV cache (`--quantization fp8 --kv-cache-dtype fp8`)."""
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

    x = torch.randn(m, k, device="cuda").to(torch.bfloat16) * torch.logspace(-2, 2, m, device="cuda")[:, None]
    q, s = one_kernel(x)
    q_ref, s_ref = quantize_tokens(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() / 8 + 1e-3).all()  # at most one rounding step


@pytest.mark.parametrize("m", [1, 8, 64, 256])
def test_the_fp8_gemm_is_the_dequantized_operands_product(m):
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(4096, 2048, device="cuda", generator=gen) * 0.02
    x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    wq = quantize_weight(w)
    xq, xs = quantize_tokens(x)
    reference = (xq.float() * xs) @ wq.dequantize().t()
    torch.testing.assert_close(fp8_linear(x, wq).float(), reference, rtol=2e-2, atol=2e-3)


def _fp8_runner(model, cfg):
    from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig

    model.quantization = "fp8"
    return GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                                 context_len=512, num_kv_blocks=96, sampling_extensions=False,
                                                 kv_cache_dtype="fp8"),
                     progress=False, keep_graphs=True)


def test_persistent_gives_host_tokens_with_fp8_weights_and_kv(served):  # noqa: F811
    cfg, model = _peaky_model()
    runner = _fp8_runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert type(runner.weights.layers[0].gate_up).__name__ == "Fp8Weight"
    host_tokens, host_fin, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    s = served(runner, cfg)
    slots = s.submit(_specs())
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert [s.finishes[x][0] for x in slots] == host_fin == [FinishReason.LENGTH] * 4
    assert [s.tokens[x] for x in slots] == host_tokens
