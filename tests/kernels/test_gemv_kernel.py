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
