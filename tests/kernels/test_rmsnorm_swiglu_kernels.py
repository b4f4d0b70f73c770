"""Fused residual-add + RMSNorm, RMSNorm and SwiGLU against float32 torch references."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from kernels.rmsnorm import add_rmsnorm, rmsnorm  # noqa: E402
from kernels.swiglu import swiglu  # noqa: E402


def _shapes(device):
    # (rows, hidden): odd row counts, a non-power-of-2 width (SmolLM2's 576), Llama-3-8B's 4096
    return [(5, 64), (3, 576)] if device == "cpu" else [(1, 4096), (37, 4096), (512, 4096), (7, 576), (64, 8192)]


def _ref_rmsnorm(h32: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_matches_reference(device, dtype):
    gen = torch.Generator().manual_seed(0)
    for rows, hidden in _shapes(device):
        x = torch.randn(rows, hidden, generator=gen).mul(3).to(device, dtype)
        w = torch.randn(hidden, generator=gen).to(device, dtype)
        out = torch.full_like(x, float("nan"))
        rmsnorm(x, w, 1e-5, out=out)
        assert not out.isnan().any()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.float(), _ref_rmsnorm(x.float(), w, 1e-5), atol=tol, rtol=tol)


def test_add_rmsnorm_matches_reference_and_updates_residual_in_place(device):
    gen = torch.Generator().manual_seed(1)
    for rows, hidden in _shapes(device):
        # x as a strided view (every other row of a wider buffer), like a slice of a fused output
        x = torch.randn(rows, 2, hidden, generator=gen).to(device, torch.bfloat16)[:, 0]
        residual = torch.randn(rows, hidden, generator=gen).mul(4).to(device, torch.bfloat16)
        w = torch.randn(hidden, generator=gen).to(device, torch.bfloat16)
        expected_sum = x.float() + residual.float()
        out = torch.full((rows, hidden), float("nan"), dtype=torch.bfloat16, device=device)
        out, res_out = add_rmsnorm(x, residual, w, 1e-6, out=out, residual_out=residual)
        assert res_out.data_ptr() == residual.data_ptr() and not out.isnan().any()
        torch.testing.assert_close(res_out, expected_sum.to(torch.bfloat16), atol=0, rtol=0)
        torch.testing.assert_close(out.float(), _ref_rmsnorm(res_out.float(), w, 1e-6), atol=3e-2, rtol=2e-2)


def test_rmsnorm_rejects_bad_shapes(device):
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(x, torch.ones(9, dtype=torch.bfloat16, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(x, torch.zeros(3, 8, dtype=torch.bfloat16, device=device), torch.ones(8, device=device), 1e-5)


def test_swiglu_matches_reference(device):
    gen = torch.Generator().manual_seed(2)
    shapes = [(3, 40), (2, 1536 * 2)] if device == "cpu" else [(1, 2 * 14336), (97, 2 * 14336), (512, 2 * 1536)]
    for rows, width in shapes:
        gate_up = torch.randn(rows, width, generator=gen).mul(4).to(device, torch.bfloat16)
        out = torch.full((rows, width // 2), float("nan"), dtype=torch.bfloat16, device=device)
        swiglu(gate_up, out=out)
        gate, up = gate_up.float().chunk(2, dim=-1)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, atol=2e-2, rtol=1e-2)


def test_swiglu_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(2, 7, dtype=torch.bfloat16, device=device))
