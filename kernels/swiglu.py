"""Fused SwiGLU (Triton): out = silu(gate) * up over the output of the merged gate_up projection.

Computed in float32 and rounded once. The wrapper is graph-capturable: a fixed grid from the shapes,
no host sync, no device value read on the host; launch once before capture (the first launch compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, pdl_launch, pdl_on
from .pdl import pdl_enter

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 1024


@triton.jit
def _swiglu_kernel(gate_up_ptr, out_ptr, in_stride, out_stride, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * out_stride + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [T, 2*I] (gate in [:, :I], up in [:, I:]; rows may be strided) -> out [T, I] of the same
    dtype. Graph-capturable; no host sync."""
    check("gate_up", gate_up, dtype=_DTYPES, ndim=2)
    num_rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even last dim (gate and up halves), got {width}")
    inter = width // 2
    if out is None:
        out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    check("out", out, dtype=gate_up.dtype, shape=(num_rows, inter), device=gate_up.device)
    if num_rows:
        grid = (num_rows, triton.cdiv(inter, _BLOCK))
        _swiglu_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=_BLOCK, PDL=pdl_on(),
                             num_warps=4, **pdl_launch())
    return out
