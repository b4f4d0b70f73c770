"""The batch-1 GEMV against a float32 torch reference: ragged N and K, bias, strided weight rows."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from kernels.gemv import gemv  # noqa: E402


def _cases(device):
    # (N, K): one row block short, a K tail shorter than BLOCK_K, Llama-3-8B's qkv and o
    return [(13, 70), (40, 600)] if device == "cpu" else [(13, 70), (1000, 4100), (6144, 4096), (4096, 4096)]


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_reference(device, with_bias):
    gen = torch.Generator().manual_seed(1)
    for n, k in _cases(device):
        x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
        wide = torch.randn(n, k + 8, generator=gen).div(k ** 0.5).to(device, torch.bfloat16)
        w = wide[:, :k]                                       # strided rows
        b = torch.randn(n, generator=gen).to(device, torch.bfloat16) if with_bias else None
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=device)
        gemv(x, w, b, out=out)
        ref = x.float() @ w.float().t() + (b.float() if with_bias else 0)
        assert not out.isnan().any()
        rel = (out.float() - ref).norm() / ref.norm()
        assert rel < 1e-2, f"N={n} K={k}: relative error {rel:.2e}"


def test_gemv_rejects_more_than_one_row(device):
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8, device=device), torch.zeros(4, 8, device=device))


def _rms(h, w, eps):  # kernels/rmsnorm.py's roundings, in torch
    normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return (normed.float() * w.float()).to(h.dtype)


@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_with_the_norm_fused_matches_norm_then_gemv(device, with_residual):
    """norm=(residual, weight, eps): the GEMV of RMSNorm(x + residual) (or of RMSNorm(x)), every program computing
    the norm itself, program 0 writing x + residual; the same as the norm kernel followed by the GEMV."""
    gen = torch.Generator().manual_seed(2)
    for n, k in _cases(device):
        x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
        res = torch.randn(1, k, generator=gen).to(device, torch.bfloat16) if with_residual else None
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, torch.bfloat16)
        w = torch.randn(n, k, generator=gen).div(k ** 0.5).to(device, torch.bfloat16)
        res_out = torch.full((1, k), float("nan"), dtype=torch.bfloat16, device=device) if with_residual else None
        out = gemv(x, w, norm=(res, nw, 1e-5), residual_out=res_out)
        h = (x.float() + res.float()).to(torch.bfloat16) if with_residual else x
        if with_residual:
            assert torch.equal(res_out, h)
        normed = _rms(h, nw, 1e-5)
        plain = gemv(normed, w)
        rel = (out.float() - plain.float()).norm() / plain.float().norm()
        assert rel < 2e-3, f"N={n} K={k}: relative error {rel:.2e} against the norm, then the GEMV"
        ref = normed.float() @ w.float().t()
        assert (out.float() - ref).norm() / ref.norm() < 1e-2


def test_gemv_swiglu_matches_gemv_then_swiglu(device):
    from kernels.swiglu import swiglu

    gen = torch.Generator().manual_seed(3)
    for n, k in _cases(device):
        x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(2 * n, k, generator=gen).div(k ** 0.5).to(device, torch.bfloat16)
        fused = gemv(x, w, swiglu=True)
        assert fused.shape == (1, n)
        unfused = swiglu(gemv(x, w))
        assert torch.equal(fused, unfused), f"N={n} K={k}: {(fused.float() - unfused.float()).abs().max()}"


def test_gemv_norm_with_a_residual_needs_its_own_output(device):
    x = torch.zeros(1, 8, dtype=torch.bfloat16, device=device)
    w = torch.zeros(4, 8, dtype=torch.bfloat16, device=device)
    nw = torch.ones(8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="residual_out"):
        gemv(x, w, norm=(x.clone(), nw, 1e-5))
    res = x.clone()
    with pytest.raises(ValueError, match="of its own"):
        gemv(x, w, norm=(res, nw, 1e-5), residual_out=res)
