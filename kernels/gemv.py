"""y = W x (+ b) for one token: the batch-1 decode GEMMs as a weight-streaming GEMV (Triton).

At batch 1 a step is a read of every weight once; cuBLAS's small-M kernels stream the large matrices
near the copy bandwidth but the 4096-wide attention projections well under it (see bench/NOTES.md).
Here each program owns BLOCK_N output rows and walks K in BLOCK_K chunks, accumulating in float32; many
small programs keep enough loads in flight for the whole HBM. Graph-capturable: the grid comes from
shapes only; launch once per shape before capture (the first launch compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, pdl_launch, pdl_on
from .pdl import pdl_release, pdl_wait

# (BLOCK_N, BLOCK_K, num_warps). On an H100 (bench/gemv_probe.py --sweep over the batch-1 projections of
# Llama-3-8B, Qwen3-30B-A3B, Qwen3-32B and Phi-4: bench/results/gemv_probe-27ce01b-h100.json) this tile is within
# 1.4% of each shape's best; the earlier per-projection tiles (tuned on an H200 for Llama-3-8B) lost 2-15%.
DEFAULT_CONFIG = (2, 1024, 4)
NARROW_CONFIG = (1, 1024, 8)  # under 512 rows (an MoE router: 128 x 2,048): 2.26 us against 3.7 before


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """The tile for an [n, k] bf16 weight (an FP8 one takes BLOCK_K twice this: the same bytes a program)."""
    return NARROW_CONFIG if n < 512 else DEFAULT_CONFIG


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, n, k, w_stride,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_wait(PDL)  # kernels/pdl.py
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        w = tl.load(row_ptr + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    pdl_release(PDL)
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:  # FP8 rows: W = q * scale[row]
        y *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] (rows may be strided, last dim contiguous); bias: [N] or None.
    Returns out [1, N] in x's dtype, like F.linear(x, weight, bias). With `scale` ([N] float32), `weight` is
    FP8 e4m3 and row r means weight[r] * scale[r] (models/fp8.py): half the bytes of a bf16 row."""
    check("x", x, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    if x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}; use F.linear for more")
    n, k = weight.shape
    if scale is None:
        check("weight", weight, dtype=x.dtype, shape=(n, x.shape[1]), device=x.device)
    else:
        check("weight", weight, dtype=(torch.float8_e4m3fn,), shape=(n, x.shape[1]), device=x.device)
        check("scale", scale, dtype=(torch.float32,), shape=(n,), device=x.device)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if bias is not None:
        check("bias", bias, dtype=x.dtype, shape=(n,), device=x.device)
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    check("out", out, dtype=x.dtype, shape=(1, n), device=x.device)
    block_n, block_k, warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, scale if scale is not None else x,
                                             bias if bias is not None else x, out, n, k, weight.stride(0),
                                             HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
                                             BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_on(), num_warps=warps,
                                             **pdl_launch())
    return out
