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

from ._common import check, next_pow2, pdl_launch, pdl_on
from .pdl import pdl_release, pdl_wait
from .rmsnorm import rms_rstd, rms_scale

# (BLOCK_N, BLOCK_K, num_warps). On an H100 (bench/gemv_probe.py --sweep over the batch-1 projections of
# Llama-3-8B, Qwen3-30B-A3B, Qwen3-32B and Phi-4: bench/results/gemv_probe-27ce01b-h100.json) this tile is within
# 1.4% of each shape's best; the earlier per-projection tiles (tuned on an H200 for Llama-3-8B) lost 2-15%.
DEFAULT_CONFIG = (2, 1024, 4)
NARROW_CONFIG = (1, 1024, 8)  # under 512 rows (an MoE router: 128 x 2,048): 2.26 us against 3.7 before


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """The tile for an [n, k] bf16 weight (an FP8 one takes BLOCK_K twice this: the same bytes a program)."""
    return NARROW_CONFIG if n < 512 else DEFAULT_CONFIG


@triton.jit
def norm_chunk(x_ptr, res_ptr, nw_ptr, cols, ok, rstd, NORM: tl.constexpr):
    """Columns `cols` of the GEMV's input as float32: x itself (NORM 0), or RMSNorm(x) (1) or RMSNorm(x + residual)
    (2) with the row's `rstd`, rounded as kernels/rmsnorm.py rounds (the sum to the activation dtype, the normalised
    value, then the product with the weight)."""
    x = tl.load(x_ptr + cols, mask=ok, other=0.0)
    if NORM == 0:
        return x.to(tl.float32)
    act = x.dtype
    h = x.to(tl.float32)
    if NORM == 2:
        h = (h + tl.load(res_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(act).to(tl.float32)
    return rms_scale(h, rstd, tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32), act)


@triton.jit
def norm_rstd(x_ptr, res_ptr, res_out_ptr, k, eps, write, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """1 / RMS of the row (x, or x + residual rounded to the activation dtype) as kernels/rmsnorm.py computes it,
    the whole row at once; where `write` (one program of the grid) the sum goes to `res_out_ptr` as well."""
    cols = tl.arange(0, BLOCK)
    ok = cols < k
    x = tl.load(x_ptr + cols, mask=ok, other=0.0)
    h = x.to(tl.float32)
    if NORM == 2:
        h_act = (h + tl.load(res_ptr + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + cols, h_act, mask=ok & write)
        h = h_act.to(tl.float32)
    return rms_rstd(h, k, eps)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, n, k, w_stride, up_offset, eps,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                 ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program i: rows [i * BLOCK_N, (i + 1) * BLOCK_N) of W x. The first weight tile loads before the wait for the
    previous kernel (weights do not depend on it). NORM 1 / 2: x is first RMS-normalised (x + residual with 2;
    program 0 writes that sum to res_out_ptr), so the norm needs no launch of its own. SWIGLU: row r also reads row
    r + up_offset and the output is silu(gate) * up, rounded as kernels/swiglu.py rounds it."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * w_stride
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < k
    tile_ok = row_ok[:, None] & col_ok[None, :]
    w = tl.load(row_ptr + cols[None, :], mask=tile_ok, other=0.0)
    if SWIGLU:
        w_up = tl.load(row_ptr + up_offset + cols[None, :], mask=tile_ok, other=0.0)
    pdl_wait(PDL)  # kernels/pdl.py
    rstd = 1.0
    if NORM != 0:
        rstd = norm_rstd(x_ptr, res_ptr, res_out_ptr, k, eps, tl.program_id(0) == 0, NORM, ROW_BLOCK)
    x = norm_chunk(x_ptr, res_ptr, nw_ptr, cols, col_ok, rstd, NORM)[None, :]
    acc = w.to(tl.float32) * x
    if SWIGLU:
        acc_up = w_up.to(tl.float32) * x
    for k0 in range(BLOCK_K, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        tile_ok = row_ok[:, None] & col_ok[None, :]
        x = norm_chunk(x_ptr, res_ptr, nw_ptr, cols, col_ok, rstd, NORM)[None, :]
        acc += tl.load(row_ptr + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * x
        if SWIGLU:
            acc_up += tl.load(row_ptr + up_offset + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32) * x
    pdl_release(PDL)
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:  # FP8 rows: W = q * scale[row]
        y *= tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    act = out_ptr.dtype.element_ty
    if SWIGLU:
        up = tl.sum(acc_up, axis=1)
        if HAS_SCALE:
            up *= tl.load(s_ptr + up_offset // w_stride + rows, mask=row_ok, other=0.0)
        gate = y.to(act).to(tl.float32)  # each rounded as the GEMV would write it; silu as swiglu.py: unrounded
        y = gate / (1.0 + tl.exp(-gate)) * up.to(act).to(tl.float32)
    tl.store(out_ptr + rows, y.to(act), mask=row_ok)


def check_norm(who: str, x: torch.Tensor, norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
               residual_out: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None, float, int]:
    """A one-row kernel's `norm` argument (residual or None, norm weight, eps) checked against x [1, K]:
    (residual, weight, eps, the kernels' NORM: 0 none, 1 RMSNorm(x), 2 RMSNorm(x + residual))."""
    if norm is None:
        return None, None, 0.0, 0
    res, norm_w, eps = norm
    k = x.shape[1]
    check("norm weight", norm_w, dtype=x.dtype, shape=(k,), device=x.device)
    if res is None:
        return None, norm_w, eps, 1
    check("residual", res, dtype=x.dtype, shape=(1, k), device=x.device)
    if residual_out is None:
        raise ValueError(f"{who} with a residual needs residual_out (the sum x + residual is written there)")
    check("residual_out", residual_out, dtype=x.dtype, shape=(1, k), device=x.device)
    if not res.is_contiguous() or residual_out.data_ptr() in (x.data_ptr(), res.data_ptr()):
        raise ValueError("residual must be contiguous and residual_out a tensor of its own")
    return res, norm_w, eps, 2


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
         scale: torch.Tensor | None = None, norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
         residual_out: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] (rows may be strided, last dim contiguous); bias: [N] or None.
    Returns out [1, N] in x's dtype, like F.linear(x, weight, bias). With `scale` ([N] float32), `weight` is
    FP8 e4m3 and row r means weight[r] * scale[r] (models/fp8.py): half the bytes of a bf16 row.
    `norm` = (residual or None, norm weight [K], eps): the GEMV's input is RMSNorm(x + residual) * norm weight
    (`rmsnorm.add_rmsnorm`; without a residual `rmsnorm.rmsnorm(x)`), computed by every program, and x + residual
    is written to `residual_out` ([1, K], not aliasing x or the residual). `swiglu`: weight is [2 I, K], gate rows
    then up rows, and out is silu(gate) * up, [1, I] (`swiglu.swiglu` of the plain GEMV's output)."""
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
    if swiglu:
        if n % 2 or bias is not None:
            raise ValueError(f"swiglu takes gate and up rows without a bias, got {n} rows"
                             f"{' and a bias' if bias is not None else ''}")
        n //= 2
    res, norm_w, eps, norm_code = check_norm("gemv", x, norm, residual_out)
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    check("out", out, dtype=x.dtype, shape=(1, n), device=x.device)
    block_n, block_k, warps = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale if scale is not None else x, bias if bias is not None else x, out,
        res if res is not None else x, norm_w if norm_w is not None else x,
        residual_out if residual_out is not None else x, n, k, weight.stride(0), n * weight.stride(0), float(eps),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        NORM=norm_code, SWIGLU=swiglu, ROW_BLOCK=next_pow2(k) if norm_code else 1,  # no norm: one compile for any K
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_on(), num_warps=warps, **pdl_launch())
    return out
