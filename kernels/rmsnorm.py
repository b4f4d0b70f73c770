"""RMSNorm and fused residual-add + RMSNorm (Triton), matching Hugging Face Llama's numerics:
the residual sum is rounded to the activation dtype, normalised in float32, rounded back, then
multiplied by the weight.

Wrappers are graph-capturable: they check host metadata only, launch one kernel with a fixed grid of
one program per row, and never sync or read device values on the host. Launch each once before
capture (the first launch compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2, pdl_launch, pdl_on
from .pdl import pdl_release, pdl_wait

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def rms_rstd(h, n, eps, AXIS: tl.constexpr = 0):
    """1 / RMS of the float32 row `h` (its `n` real columns, the padding zeros; rows along AXIS 1 of a tile): the
    formula of every norm here and of the norms fused into other kernels (kernels/gemv.py, kernels/rope_kv.py,
    kernels/moe.py, kernels/paged_attention.py)."""
    return 1.0 / tl.sqrt(tl.sum(h * h, axis=AXIS) / n + eps)


@triton.jit
def rms_scale(h, rstd, w, act: tl.constexpr):
    """Hugging Face Llama's roundings of a normalised row: h * rstd rounded to the activation dtype `act`, times the
    weight (float32), rounded again; float32 out."""
    return ((h * rstd).to(act).to(tl.float32) * w).to(act).to(tl.float32)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                    x_stride, res_stride, out_stride, res_out_stride, hidden, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    pdl_wait(PDL)  # kernels/pdl.py
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h_act = (h + r).to(res_out_ptr.dtype.element_ty)   # rounded like a torch add in bf16
        tl.store(res_out_ptr + row * res_out_stride + cols, h_act, mask=mask)
        h = h_act.to(tl.float32)
    rstd = rms_rstd(h, hidden, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_release(PDL)
    act = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_stride + cols, rms_scale(h, rstd, w, act).to(act), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = rmsnorm(x) * weight.

    x: [T, hidden] bf16/fp16/fp32 (rows may be strided, last dim contiguous); weight: [hidden];
    out: [T, hidden] of x's dtype, may alias x. Graph-capturable; no host sync.
    """
    out = _prepare(x, weight, out)
    _launch(x, x, weight, out, out, eps, has_residual=False)
    return out


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; out = rmsnorm(residual_out) * weight. Returns (out, residual_out).

    x, residual: [T, hidden] of one dtype; residual_out may alias residual (in-place update) and out
    may alias x. Graph-capturable; no host sync.
    """
    out = _prepare(x, weight, out)
    check("residual", residual, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    if residual_out is None:
        residual_out = torch.empty_like(x)
    check("residual_out", residual_out, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    _launch(x, residual, weight, out, residual_out, eps, has_residual=True)
    return out, residual_out


def _prepare(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    check("x", x, dtype=_DTYPES, ndim=2)
    check("weight", weight, dtype=_DTYPES, shape=(x.shape[1],), device=x.device)
    if out is None:
        out = torch.empty_like(x)
    check("out", out, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    return out


def _launch(x, residual, weight, out, residual_out, eps: float, has_residual: bool) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    _rmsnorm_kernel[(num_rows,)](
        x, residual, weight, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0), hidden, float(eps),
        HAS_RESIDUAL=has_residual, BLOCK=next_pow2(hidden), PDL=pdl_on(), num_warps=row_warps(hidden),
        **pdl_launch())


def row_warps(hidden: int) -> int:
    """Warps for one row of `hidden`: with the row's block (next power of two) they fix its reduction order,
    which kernels/rope_kv.py's fused q/k norm repeats."""
    block = next_pow2(hidden)
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
