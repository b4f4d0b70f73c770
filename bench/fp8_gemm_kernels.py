"""bench/fp8_gemm_probe.py's weight-only FP8 GEMM variants: y = x (q * scale[:, None])^T, x [M, K] bf16,
q [N, K] float8_e4m3fn, scale [N] float32. Needs Triton.

Unlike kernels/fp8_gemm.py's `_w8a16_kernel` (which reads the weight as a [BLOCK_K, BLOCK_N] tile of W^T), every
variant here loads the FP8 tile as [BLOCK_N, BLOCK_K], contiguous along K as it is stored, widens it in
registers and multiplies with `tl.trans` on one side:
  SWAP=False  acc[BLOCK_M, BLOCK_N] += x_tile @ trans(w_tile)      (the activations as the left operand);
  SWAP=True   acc[BLOCK_N, BLOCK_M] += w_tile @ trans(x_tile)      (the widened weight as the left operand: on
              Hopper the left operand of a wgmma may come from registers, the right one must sit in shared
              memory, so the widened weight need not be written back to shared memory; and few tokens
              fill the narrow side of the instruction instead of the 64-row one).
SPLIT_K > 1 splits K over a third grid axis: each program writes a float32 partial [SPLIT_K, M, N] and
`_split_sum_kernel` adds them and casts (one more launch, for few tokens where N / BLOCK_N programs leave SMs idle).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K, SWAP): bench/fp8_gemm_probe.py's CANDIDATES rows
Config = tuple[int, int, int, int, int, int, bool]


@triton.jit
def _w8_nk_kernel(x_ptr, w_ptr, s_ptr, out_ptr, m, n, k, x_stride, w_stride, out_stride, K_PER_SPLIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  SWAP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    k_start = tl.program_id(2) * K_PER_SPLIT
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride      # [BLOCK_N, BLOCK_K], contiguous along K
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    if SWAP:
        res = tl.trans(acc * scale[:, None])                    # [BLOCK_M, BLOCK_N]
    else:
        res = acc * scale[None, :]
    out = out_ptr + tl.program_id(2).to(tl.int64) * m * n + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def w8_nk_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config: Config,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) times (q [N, K] FP8 * scale [N])^T -> out [M, N] bf16, with `config`'s tiles.
    Graph-capturable (the split-K partials are allocated per call from torch's graph pool)."""
    block_m, block_n, block_k, warps, stages, split_k, swap = config
    m, k = x.shape
    n = q.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # each split takes whole BLOCK_K chunks, so only the last chunk of K can be partial
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    dest = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w8_nk_kernel[grid](x, q, scale, dest, m, n, k, x.stride(0), q.stride(0), n, K_PER_SPLIT=k_per_split,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, SWAP=swap,
                        num_warps=warps, num_stages=stages)
    if split_k > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](dest, out, m * n, SPLIT_K=split_k, BLOCK=block,
                                                          num_warps=4)
    return out
