"""Per-token FP8 quantization of activations (models/fp8.py's `quantize_tokens`) in one kernel (Triton).

Written as torch ops it is seven kernels per projection (widen, abs, max, divide, clamp, ...), about 900 per
Llama-3-8B step inside the bucket graph: more time than the FP8 GEMMs save at batch 256 (bench/NOTES.md).
One program per token row: a pass for the row's largest magnitude, a pass that scales and casts.
Graph-capturable: the grid comes from shapes only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, k, x_stride, q_stride, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * x_stride, q_ptr + row * q_stride
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < k)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (bf16/fp16/fp32, last dim contiguous) -> (FP8 e4m3 [T, K], float32 scales [T, 1])."""
    check("x", x, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        _quant_kernel[(t,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=1024, num_warps=4)
    return q, scale
