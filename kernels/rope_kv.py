"""RoPE on q and k (Hugging Face rotate_half: pairs (i, i + D/2)) fused with the paged KV-cache write.

One program per token: q is rotated in place; k is rotated and written, with v, into its cache slot
(`slot_mapping[t] = block_id * block_size + offset`). Rows whose slot is negative are padding: nothing
is written to the cache for them. `k` itself is left unrotated: attention reads K from the cache only.

With `q_norm` and `k_norm` (Qwen3's per-head RMSNorm) a second kernel, `_qk_norm_rope_kv_kernel`, runs one
program per (token, head) row: it normalises the row as kernels/rmsnorm.py does (float32 sum of squares over
head_dim, rounded to the activation dtype, times the weight, rounded again), then rotates those rounded values,
so q and the cache hold bit for bit what the separate `rmsnorm(q)`, `rmsnorm(k)`, `rope_and_cache_kv` launches
gave (tested on an H100). Every kernel here, and the one-token attention, rotates with one function,
`rope_rows`. It saves those two RMSNorm launches (and, at
T > 1, the copies that flattened the strided q and k views) per layer: 96 launches a step for a 48-layer
Qwen3. Its GPU timing is not measured yet.

The wrappers are graph-capturable: one launch with a grid fixed by the shapes, no host sync, no device value
read on the host; launch once before capture (the first launch compiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2, pdl_launch, pdl_on
from .pdl import pdl_enter
from .rmsnorm import rms_rstd, rms_scale, row_warps

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
                    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    cos_stride, sin_stride, cache_kv_stride, max_pos,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr, DIM_P: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_pos - 1)  # padding rows: any value
    cos_row, sin_row = cos_ptr + pos * cos_stride, sin_ptr + pos * sin_stride
    d = tl.arange(0, DIM_P)
    d_ok = d < HEAD_DIM

    h = tl.arange(0, HEADS_P)
    q_rows = q_ptr + t * q_stride_t + h * q_stride_h
    q = rope_rows(q_rows, h < NUM_HEADS, cos_row, sin_row, q_ptr, HEAD_DIM, 0.0, 0, HALF, DIM_P)
    tl.store(q_rows[:, None] + d[None, :], q.to(q_ptr.dtype.element_ty), mask=(h < NUM_HEADS)[:, None] & d_ok[None, :])

    slot = tl.load(slot_ptr + t).to(tl.int64)
    kh = tl.arange(0, KV_HEADS_P)
    kv_ok = (kh < NUM_KV_HEADS) & (slot >= 0)
    k = rope_rows(k_ptr + t * k_stride_t + kh * k_stride_h, kv_ok, cos_row, sin_row, k_ptr, HEAD_DIM, 0.0, 0, HALF,
                  DIM_P)
    # cache row of this slot: [NUM_KV_HEADS, HEAD_DIM] contiguous
    ck_ptr = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + kh[:, None] * HEAD_DIM + d[None, :]
    vm = kv_ok[:, None] & d_ok[None, :]
    tl.store(ck_ptr, k.to(cache_ptr.dtype.element_ty), mask=vm)
    v = tl.load(v_ptr + t * v_stride_t + kh[:, None] * v_stride_h + d[None, :], mask=vm, other=0.0)
    tl.store(ck_ptr + cache_kv_stride, v.to(cache_ptr.dtype.element_ty), mask=vm)


@triton.jit
def rope_rows(row_ptrs, row_ok, cos_ptr, sin_ptr, w_ptr, head_dim, eps, NORM: tl.constexpr,
              HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head rows at `row_ptrs` [R] (RMSNorm with weight `w_ptr` when NORM, Qwen3's q/k norm) rotated by the cos/sin
    rows at `cos_ptr`, `sin_ptr` (the position's): -> [R, BLOCK_D] float32 in the head's own column order (each
    column with its rotation partner, d +- HALF, loaded beside it). The one rotation every kernel here runs: the
    RoPE + KV write (`_rope_kv_kernel`, `_qk_norm_rope_kv_kernel`) and the one-token attention, which rotates the
    rows it reads (kernels/paged_attention.py)."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    low = d < HALF
    partner = tl.where(low, d + HALF, d - HALF)
    j = tl.where(low, d, d - HALF)
    m = row_ok[:, None] & d_ok[None, :]
    x = tl.load(row_ptrs[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        act = row_ptrs.dtype.element_ty
        rstd = rms_rstd(x, head_dim, eps, 1)[:, None]
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = rms_scale(x, rstd, w, act)
        xp = rms_scale(xp, rstd, wp, act)
    cos = tl.load(cos_ptr + j, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + j, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return tl.where(low[None, :], x * cos - xp * sin, x * cos + xp * sin)


@triton.jit
def _qk_norm_rope_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, q_norm_ptr,
                            k_norm_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                            cos_stride, sin_stride, cache_kv_stride, max_pos, head_dim, eps,
                            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            DIM_P: tl.constexpr, PDL: tl.constexpr):
    """Qwen3's q/k RMSNorm + RoPE + KV write in one launch: saves the two RMSNorm launches a layer (96 a
    48-layer step); on an H100 2.2 us against 5.2 for the three launches at one token."""
    pdl_enter(PDL)  # kernels/pdl.py
    # grid (T, NUM_HEADS + NUM_KV_HEADS): program (t, h) owns q head h, or k and v head h - NUM_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + t).to(tl.int64), 0), max_pos - 1)  # padding rows: any value
    cos_row, sin_row = cos_ptr + pos * cos_stride, sin_ptr + pos * sin_stride
    one = tl.arange(0, 1)
    d = tl.arange(0, DIM_P)[None, :]
    d_ok = d < HEAD_DIM
    if head < NUM_HEADS:
        row_ptr = q_ptr + t * q_stride_t + head * q_stride_h
        r = rope_rows(row_ptr + one, one < 1, cos_row, sin_row, q_norm_ptr, head_dim, eps, 1, HALF, DIM_P)
        tl.store(row_ptr + d, r.to(q_ptr.dtype.element_ty), mask=d_ok)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:                                     # padding rows write nothing
            kh = head - NUM_HEADS
            r = rope_rows(k_ptr + t * k_stride_t + kh * k_stride_h + one, one < 1, cos_row, sin_row, k_norm_ptr,
                          head_dim, eps, 1, HALF, DIM_P)
            # cache row of this slot: [NUM_KV_HEADS, HEAD_DIM] contiguous
            ck_ptr = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + kh * HEAD_DIM
            tl.store(ck_ptr + d, r.to(cache_ptr.dtype.element_ty), mask=d_ok)
            v = tl.load(v_ptr + t * v_stride_t + kh * v_stride_h + d, mask=d_ok, other=0.0)
            tl.store(ck_ptr + cache_kv_stride + d, v.to(cache_ptr.dtype.element_ty), mask=d_ok)


def rope_and_cache_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                      layer_cache: torch.Tensor, q_norm: torch.Tensor | None = None,
                      k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Rotate q in place; write rotated k and v into `layer_cache` at `slot_mapping`. Returns q.

    q: [T, H, D]; k, v: [T, KVH, D] (views of a fused qkv output are fine: any row/head strides, last
    dim contiguous); positions: [T] int32/int64 (clamped to the table; padding rows may hold anything);
    cos, sin: [max_pos, D] (Hugging Face layout, halves equal) or [max_pos, D/2], float32 or q's dtype,
    Llama-3 scaling already applied; slot_mapping: [T] int64, -1 = padding row (not written);
    layer_cache: [2, num_blocks, block_size, KVH, D] contiguous (kv_cache[layer]).
    q_norm, k_norm: [D] (Qwen3), both or neither: each head row of q and k is RMS-normalised (epsilon `eps`)
    and times its weight, rounded to q's dtype as `kernels.rmsnorm.rmsnorm` rounds, before it is rotated;
    q is then normalised and rotated in place. Graph-capturable; no host sync.
    """
    num_tokens, num_heads, head_dim = check_rope_args(q, k, v, positions, cos, sin, slot_mapping, layer_cache,
                                                      q_norm, k_norm)
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q
    if q_norm is not None:
        _launch_qk_norm(q, k, v, positions, cos, sin, slot_mapping, layer_cache, q_norm, k_norm, eps)
        return q
    _rope_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, slot_mapping, layer_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), layer_cache.stride(0), cos.shape[0],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=next_pow2(num_heads), KV_HEADS_P=next_pow2(num_kv_heads), DIM_P=next_pow2(head_dim),
        PDL=pdl_on(), num_warps=4, **pdl_launch())
    return q


def _launch_qk_norm(q, k, v, positions, cos, sin, slot_mapping, layer_cache, q_norm, k_norm, eps: float) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # the block and warps kernels/rmsnorm.py gives a row of head_dim: the row's reduction order is then its own
    _qk_norm_rope_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, k, v, positions, cos, sin, slot_mapping, layer_cache, q_norm, k_norm,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), layer_cache.stride(0), cos.shape[0], head_dim, float(eps),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, DIM_P=next_pow2(head_dim),
        PDL=pdl_on(), num_warps=row_warps(head_dim),
        **pdl_launch())


def check_rope_args(q, k, v, positions, cos, sin, slot_mapping, layer_cache, q_norm=None,
                    k_norm=None) -> tuple[int, int, int]:
    """`rope_and_cache_kv`'s arguments (also kernels/paged_attention.py's `rope`): -> (T, H, D)."""
    check("q", q, dtype=_DTYPES, ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q head_dim must be even for RoPE, got {head_dim}")
    check("k", k, dtype=q.dtype, shape=(num_tokens, None, head_dim), device=q.device)
    check("v", v, dtype=q.dtype, shape=tuple(k.shape), device=q.device)
    check("positions", positions, dtype=(torch.int32, torch.int64), shape=(num_tokens,), device=q.device)
    check("slot_mapping", slot_mapping, dtype=torch.int64, shape=(num_tokens,), device=q.device)
    for name, table in (("cos", cos), ("sin", sin)):
        check(name, table, dtype=(torch.float32, q.dtype), ndim=2, device=q.device)
        if table.shape[1] not in (head_dim, head_dim // 2) or table.shape[0] != cos.shape[0]:
            raise ValueError(f"{name} must be [max_pos, {head_dim}] or [max_pos, {head_dim // 2}] like cos, "
                             f"got {tuple(table.shape)}")
    check("layer_cache", layer_cache, dtype=_DTYPES + (torch.float8_e4m3fn,), shape=(2, None, None, k.shape[1], head_dim), device=q.device)
    if not layer_cache.is_contiguous():
        raise ValueError("layer_cache must be contiguous ([2, num_blocks, block_size, KVH, D], e.g. kv_cache[layer])")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together: pass both (Qwen3's per-head norms) or neither")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None:
            check(name, weight, dtype=_DTYPES, shape=(head_dim,), device=q.device)
    return num_tokens, num_heads, head_dim
