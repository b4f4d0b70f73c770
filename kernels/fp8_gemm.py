"""y = x W^T (+ b) with FP8 e4m3 weight rows and bf16/fp16 activations, for more than one token (Triton).

`--quantization fp8` keeps activations dense (weight-only FP8, models/fp8.py): at one token kernels/gemv.py
streams the FP8 rows; for more tokens this kernel does, instead of writing a dequantized bf16 copy of the
weight per call. Each program owns a BLOCK_M x BLOCK_N tile of the output, walks K in BLOCK_K chunks, widens
the FP8 weight tile to the activation dtype in registers and multiplies on the tensor cores (float32
accumulation); the per-row scales multiply the tile once at the end (W = q * scale[row], so
x W^T = (x q^T) * scale). The weight is read as FP8, once per M tile. Graph-capturable: the grid comes from
shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, m, n, k, x_stride, w_stride, out_stride,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * w_stride      # the [BLOCK_K, BLOCK_N] tile of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
    acc *= tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def config_for(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m tokens: few tokens read the weight once with
    narrow N tiles (many programs keep the memory system busy); many tokens take square tiles (compute)."""
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 64, 8, 3


def fp8_weight_only_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, last dim contiguous); q [N, K] float8_e4m3fn; scale [N] float32; bias [N] or None.
    Returns out [M, N] in x's dtype: x @ (q * scale[:, None]).T (+ bias), as models/fp8.py's `fp8_linear` does
    for a weight-only `Fp8Weight`."""
    check("x", x, dtype=(torch.bfloat16, torch.float16), ndim=2)
    m, k = x.shape
    n = q.shape[0]
    check("q", q, dtype=(torch.float8_e4m3fn,), shape=(n, k), device=x.device)
    check("scale", scale, dtype=(torch.float32,), shape=(n,), device=x.device)
    if bias is not None:
        check("bias", bias, dtype=x.dtype, shape=(n,), device=x.device)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check("out", out, dtype=x.dtype, shape=(m, n), device=x.device)
    if m:
        block_m, block_n, block_k, warps, stages = config_for(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _w8a16_kernel[grid](x, q, scale, bias if bias is not None else scale, out, m, n, k,
                            x.stride(0), q.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out
