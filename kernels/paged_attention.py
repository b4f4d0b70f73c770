"""Paged attention over a mixed batch of prefill chunks and decode tokens, in one launch (Triton).

Every query token attends causally over its own sequence's context (keys at positions <= its own),
reading K/V from the paged cache through the block table. Nothing is planned on the host: the kernels
read `num_seqs`, `q_start`, `ctx_lens` and `block_tables` from device memory, and the grid depends
only on static shapes (the bucket), so one CUDA graph serves every batch of that bucket.

Work decomposition (FlashAttention-style, online softmax over key tiles of BLOCK_N):
- A query tile is up to BLOCK_Q consecutive tokens of ONE sequence times the G query heads sharing
  a KV head (GQA): BLOCK_M >= BLOCK_Q * G rows. Sequence s has ceil(q_len_s / BLOCK_Q) tiles whose
  ids start at q_start[s] // BLOCK_Q + s, so T // BLOCK_Q + S tile ids always suffice. A program finds
  its sequence by counting the sequences whose first tile id is <= its own (a vector compare over
  q_start). Surplus tile ids find no work.
- Split-K: grid axis 2 has NUM_SPLITS (static, from the bucket's shape). A tile whose key range is
  long uses up to NUM_SPLITS of them, at least SPLIT_KEYS keys each (decided on device from the
  lengths): each split writes a float32 partial output and log-sum-exp and `_attn_reduce_kernel`
  merges them. A tile that uses one split writes `out` directly, so short contexts cost no partials.
  The reduce needs no metadata: every (token, head) of a tile has a log-sum-exp in each of its
  NUM_SPLITS slots after the tile kernel (-inf where a split had no keys: weight 0), or +inf in
  slot 0 where there is nothing to merge (the tile wrote `out` directly, or the token is padding).
  Its chain of dependent loads is then the partials alone (at batch 1 it read the token's sequence,
  its lengths and its split count first: ~1 us a layer).
  A bucket whose sequences alone give two programs an SM takes one split (NUM_SPLITS 1: no partials, no reduce
  launch): measured (bench/attn_probe.py, H200, 256 decodes of 416 keys) 121 us a layer against 216 with the four
  splits a 4,096-token context asked for, and 418 against 474 with contexts spread over 64-3,000 keys; idle split
  programs and the reduce cost more than a long context's tail.
- Padding tokens (seq_ids_of_token < 0 or >= num_seqs) get zeros: program (i, kv_head, 0) zeroes
  those among tokens [i * BLOCK_Q, (i + 1) * BLOCK_Q) (T // BLOCK_Q + S >= ceil(T / BLOCK_Q)).
- One token (a batch-1 step, `rope` given): the tile kernel also does what kernels/rope_kv.py's launch would
  do before it: each program rotates (and, for Qwen3, RMS-normalises) its query rows as it loads them, and the
  program of the last split, the one whose keys end at the new token, writes the token's rotated K and its V into
  the cache, then a block barrier lets its own loop read them; no other program reads that key. One launch a
  layer less on the step's critical path. At more tokens a sequence's new keys are read by other programs (other
  tiles, other splits), so `rope_and_cache_kv` runs first.
- An FP8 cache (`--kv-cache-dtype fp8`) widens its K and V tiles in the loop; the dots then run in float16, not the
  activations' bfloat16: e4m3 widens to float16 in one instruction per two values (to bfloat16 it took a second
  per value, 192 conversions a tile pair against 64 in the compiled loop), and float16 holds every e4m3 value,
  every probability and any query under 65,504 (larger ones are clamped) at least as finely as bfloat16.
Loads are masked to the sequence's key range and the block table's width, so padding, a context of 1
and ragged tails never read out of bounds.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2, num_sms, pdl_launch, pdl_on
from .pdl import pdl_enter
from .rope_kv import check_rope_args, rope_and_cache_kv, rope_rows

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
_SPLIT_KEYS = 256                 # fewest keys worth a split of their own
_PARTIAL_BYTES = 64 << 20         # cap on the float32 partials of one call


@triton.jit
def _tile_keys(ctx_len, q_len, tile_q0, max_keys, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
               NUM_SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr):
    """Key range of the tile whose first query is `tile_q0` (within its sequence), and how it splits:
    returns (kv_end, splits used, keys per split). Shared by both kernels so they agree."""
    tile_q_num = tl.minimum(tl.maximum(q_len - tile_q0, 0), BLOCK_Q)
    kv_end = tl.where(tile_q_num > 0, ctx_len - q_len + tile_q0 + tile_q_num, 0)
    kv_end = tl.minimum(kv_end, max_keys)
    used = tl.minimum(tl.maximum(tl.cdiv(kv_end, SPLIT_KEYS), 1), NUM_SPLITS)
    per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), used) * BLOCK_N
    return kv_end, used, per_split


@triton.jit
def _attn_tile_kernel(
        q_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
        seq_ids_ptr, q_start_ptr, ctx_lens_ptr, block_tables_ptr, num_seqs_ptr,
        scale_log2, num_tokens, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
        cache_kv_stride, bt_stride, max_blocks,
        k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_norm_ptr, k_norm_ptr,
        k_stride_t, k_stride_h, v_stride_t, v_stride_h, cos_stride, sin_stride, max_pos, eps,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        MAX_SEQS_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLIT_KEYS: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_seqs = tl.load(num_seqs_ptr)
    rows = tl.arange(0, BLOCK_M)
    row_tok = rows // GROUP                       # token index inside the tile
    row_head = kvh * GROUP + rows % GROUP         # query head of the row
    row_real = rows < BLOCK_Q * GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    # padding tokens among [tile * BLOCK_Q, +BLOCK_Q) get zeros (see module doc)
    pad_tok = tile * BLOCK_Q + row_tok
    in_range = row_real & (pad_tok < num_tokens) & (split == 0)
    pad_seq = tl.load(seq_ids_ptr + pad_tok, mask=in_range, other=0)
    pad = in_range & ((pad_seq < 0) | (pad_seq >= num_seqs))
    tl.store(out_ptr + pad_tok.to(tl.int64)[:, None] * o_stride_t + row_head[:, None] * o_stride_h + d[None, :],
             tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty), mask=pad[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:  # nothing to merge for padding (see the module doc)
        tl.store(part_lse_ptr + (pad_tok.to(tl.int64) * NUM_HEADS + row_head) * NUM_SPLITS, float("inf"), mask=pad)

    # which sequence owns this tile id: the last one whose first tile id is <= tile
    s_idx = tl.arange(0, MAX_SEQS_P)
    s_live = s_idx < num_seqs
    first_tile = tl.load(q_start_ptr + s_idx, mask=s_live, other=0) // BLOCK_Q + s_idx
    seq = tl.sum((s_live & (first_tile <= tile)).to(tl.int32), axis=0) - 1
    seq_ok = seq >= 0
    seq = tl.maximum(seq, 0)
    q_lo = tl.load(q_start_ptr + seq)
    q_len = tl.where(seq_ok, tl.load(q_start_ptr + seq + 1) - q_lo, 0)
    ctx_len = tl.load(ctx_lens_ptr + seq)
    tile_q0 = (tile - (q_lo // BLOCK_Q + seq)) * BLOCK_Q       # first query of the tile, within the sequence
    q_local = tile_q0 + row_tok
    tok = (q_lo + q_local).to(tl.int64)
    q_pos = ctx_len - q_len + q_local                          # keys at positions <= q_pos are visible

    kv_end, used, per_split = _tile_keys(ctx_len, q_len, tile_q0, max_blocks * PAGE,
                                         BLOCK_Q, BLOCK_N, NUM_SPLITS, SPLIT_KEYS)
    row_ok = row_real & (q_local < q_len) & (split < used)
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_end, kv_lo + per_split)
    kv_hi = tl.where(split < used, kv_hi, 0)

    if ROPE:  # one token (module doc): its q rows and its K/V row rotated (and normed: ROPE 2) here
        HALF: tl.constexpr = HEAD_DIM // 2
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr).to(tl.int64), 0), max_pos - 1)  # padding rows: any value
        cos_row, sin_row = cos_ptr + pos * cos_stride, sin_ptr + pos * sin_stride
        q = rope_rows(q_ptr + tok * q_stride_t + row_head * q_stride_h, row_ok, cos_row, sin_row, q_norm_ptr,
                      HEAD_DIM, eps, ROPE == 2, HALF, BLOCK_D).to(q_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr).to(tl.int64)
        if (tile == 0) & (split == used - 1) & (slot >= 0):   # the split whose keys end at the new one writes it
            first = rows < 1
            k_row = rope_rows(k_ptr + kvh * k_stride_h + rows * 0, first, cos_row, sin_row, k_norm_ptr,
                              HEAD_DIM, eps, ROPE == 2, HALF, BLOCK_D)
            dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d
            tl.store(dst[None, :] + rows[:, None] * 0, k_row.to(cache_ptr.dtype.element_ty),
                     mask=first[:, None] & d_ok[None, :])
            v_row = tl.load(v_ptr + kvh * v_stride_h + d, mask=d_ok, other=0.0)
            tl.store(dst + cache_kv_stride, v_row.to(cache_ptr.dtype.element_ty), mask=d_ok)
        tl.debug_barrier()  # the block's stores above are seen by its loads below
    else:
        q = tl.load(q_ptr + tok[:, None] * q_stride_t + row_head[:, None] * q_stride_h + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:  # an FP8 cache: the dots in float16 (module doc)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head_ptr = cache_ptr + kvh * HEAD_DIM
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_hi
        block = tl.load(block_tables_ptr + seq * bt_stride + k_pos // PAGE, mask=k_ok, other=0)
        slot_off = (block.to(tl.int64) * PAGE + k_pos % PAGE) * (NUM_KV_HEADS * HEAD_DIM)
        k_t = tl.load(kv_head_ptr + slot_off[None, :] + d[:, None],
                      mask=k_ok[None, :] & d_ok[:, None], other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k_t) * scale_log2
        s = tl.where(k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_head_ptr + cache_kv_stride + slot_off[:, None] + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]; an FP8 cache
        # (--kv-cache-dtype fp8, unscaled as vLLM's default) widens here to q's type (float16 then)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    direct = used == 1
    tl.store(out_ptr + tok[:, None] * o_stride_t + row_head[:, None] * o_stride_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=o_mask & direct)
    if NUM_SPLITS > 1:
        # every slot of a live row gets a log-sum-exp: the split's (-inf past `used`: weight 0), or +inf in slot 0
        # when the tile wrote `out` directly (the reduce then leaves the row alone)
        part = (tok * NUM_HEADS + row_head) * NUM_SPLITS + split              # [BLOCK_M]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask & ~direct)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        lse = tl.where(direct, float("inf"), lse)
        live_row = row_real & (q_local < q_len)
        tl.store(part_lse_ptr + part, lse, mask=live_row & (~direct | (split == 0)))


@triton.jit
def _attn_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, o_stride_t, o_stride_h,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, PDL: tl.constexpr):
    """Merge the partials of (token, head) whose tile used several splits; +inf in slot 0 means none (written
    directly, or padding: the module doc)."""
    pdl_enter(PDL)  # kernels/pdl.py
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    part = (tok * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + part, mask=sp < NUM_SPLITS, other=float("-inf"))
    # slot 0 decides: a padding row's other slots are stale (anything, NaN included); a merged row's are all written
    merge = tl.load(part_lse_ptr + (tok * NUM_HEADS + head) * NUM_SPLITS) != float("inf")
    top = tl.max(lse, axis=0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    has = (lse != float("-inf")) & merge                                    # splits with keys
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))            # 0 for splits without keys
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=has[:, None] & d_ok[None, :], other=0.0)
    w = tl.where(has, w, 0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + tok * o_stride_t + head * o_stride_h + d, res.to(out_ptr.dtype.element_ty),
             mask=d_ok & merge)


def paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, seq_ids_of_token: torch.Tensor,
                    q_start: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor,
                    num_seqs: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    num_splits: int | None = None, block_m: int | None = None, block_n: int | None = None,
                    split_keys: int = _SPLIT_KEYS, rope: dict | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context. Returns out.

    q: [T, H, D] bf16/fp16 (rows/heads may be strided, last dim contiguous), already rotated;
    layer_cache: [2, num_blocks, block_size, KVH, D] contiguous, this step's K/V already written;
    seq_ids_of_token: [T] int32 (-1 = padding); q_start: [S+1] int32 cumulative query offsets;
    ctx_lens: [S] int32 tokens in cache after this step, new ones included; block_tables: [S, max_blocks]
    int32; num_seqs: [1] int32 live sequences (rows >= num_seqs are ignored). Token q_start[s] + i of
    sequence s sits at position ctx_lens[s] - q_len_s + i and sees keys 0 .. that position.
    out: [T, H, D] of q's dtype; rows of padding tokens are written with zeros.
    num_splits, block_m, block_n, split_keys override the static choices (tests, tuning); num_warps and num_stages
    the tile kernel's (bench/attn_probe.py).
    rope: kernels/rope_kv.py's `rope_and_cache_kv` arguments after q and layer_cache (k, v, positions, cos, sin,
    slot_mapping; q_norm, k_norm, eps for Qwen3): q is then not yet rotated and this step's K/V not yet written.
    At one token the tile kernel does both itself (one launch a layer less); otherwise `rope_and_cache_kv` runs
    first.
    Graph-capturable: grid and launch parameters come from shapes only; no host sync, no .item().
    Launch once per bucket shape before capture (the first launch compiles).
    """
    _check_args(q, layer_cache, seq_ids_of_token, q_start, ctx_lens, block_tables, num_seqs)
    num_tokens, num_heads, head_dim = q.shape
    if rope is not None:
        check_rope_args(q, rope["k"], rope["v"], rope["positions"], rope["cos"], rope["sin"], rope["slot_mapping"],
                        layer_cache, rope.get("q_norm"), rope.get("k_norm"))
        if num_tokens != 1:
            rope_and_cache_kv(q, layer_cache=layer_cache, **rope)
            rope = None
    if out is None:
        out = torch.empty_like(q)
    check("out", out, dtype=q.dtype, shape=tuple(q.shape), device=q.device)
    if num_tokens == 0:
        return out
    cfg = _config(num_tokens, q_start.shape[0] - 1, num_heads, layer_cache.shape[3], head_dim,
                  block_tables.shape[1] * layer_cache.shape[2], num_sms(q.device), num_splits, block_m, block_n)
    _launch(q, layer_cache, seq_ids_of_token, q_start, ctx_lens, block_tables, num_seqs, scale, out,
            dict(cfg, split_keys=split_keys, tile_launch=dict(num_warps=num_warps or 4, **(
                {} if num_stages is None else {"num_stages": num_stages}))), rope)
    return out


@functools.cache
def _config(num_tokens: int, max_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
            max_ctx_len: int, sms: int, num_splits: int | None, block_m: int | None,
            block_n: int | None) -> dict:
    """Static launch parameters for one bucket shape."""
    group = num_heads // num_kv_heads
    prefill_heavy = num_tokens >= 128 and num_tokens >= 4 * max_seqs   # tiles of several tokens pay off
    block_m = max(block_m or (64 if prefill_heavy else 16), next_pow2(group), 16)
    block_q = block_m // group
    block_n = block_n or (64 if head_dim <= 128 else 32)
    num_tiles = num_tokens // block_q + max_seqs
    if num_splits is None and max_seqs * num_kv_heads >= 2 * sms:
        num_splits = 1                                         # the sequences fill the GPU (module doc)
    if num_splits is None:
        fill = -(-2 * sms // (num_tiles * num_kv_heads))      # enough programs for the GPU
        long_ctx = 4 if max_ctx_len >= 4096 else 1             # keep one long decode off the critical path
        cap = max(1, _PARTIAL_BYTES // (num_tokens * num_heads * head_dim * 4))
        num_splits = min(_MAX_SPLITS, max(fill, long_ctx), cap, max(1, -(-max_ctx_len // _SPLIT_KEYS)))
    return dict(group=group, block_m=block_m, block_q=block_q, block_n=block_n, num_tiles=num_tiles,
                num_splits=max(1, num_splits), max_seqs_p=next_pow2(max(max_seqs, 1)),
                block_d=max(16, next_pow2(head_dim)))


def _rope_args(q: torch.Tensor, rope: dict | None) -> tuple[list, int]:
    """The tile kernel's RoPE arguments (placeholders without `rope`) and its ROPE constexpr: 0, 1, 2 = normed."""
    if rope is None:
        return [q] * 8 + [0] * 7 + [0.0], 0
    k, v, cos, sin = rope["k"], rope["v"], rope["cos"], rope["sin"]
    q_norm, k_norm = rope.get("q_norm"), rope.get("k_norm")
    ptrs = [k, v, rope["positions"], cos, sin, rope["slot_mapping"], q if q_norm is None else q_norm,
            q if k_norm is None else k_norm]
    return (ptrs + [k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), cos.shape[0],
                    float(rope.get("eps", 1e-6))], 1 if q_norm is None else 2)


def _launch(q, layer_cache, seq_ids, q_start, ctx_lens, block_tables, num_seqs, scale, out, cfg, rope=None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page, splits = layer_cache.shape[3], layer_cache.shape[2], cfg["num_splits"]
    rope_args, rope_code = _rope_args(q, rope)
    part_o = part_lse = out                       # unused placeholders when not splitting
    if splits > 1:
        part_o = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
    common = dict(PAGE=page, BLOCK_Q=cfg["block_q"], BLOCK_N=cfg["block_n"], NUM_SPLITS=splits,
                  SPLIT_KEYS=cfg["split_keys"], NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=cfg["block_d"],
                  PDL=pdl_on(), **pdl_launch())
    _attn_tile_kernel[(cfg["num_tiles"], num_kv_heads, splits)](
        q, layer_cache, out, part_o, part_lse, seq_ids, q_start, ctx_lens, block_tables, num_seqs,
        float(scale) * _LOG2E, num_tokens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        layer_cache.stride(0), block_tables.stride(0), block_tables.shape[1], *rope_args,
        NUM_KV_HEADS=num_kv_heads, ROPE=rope_code, GROUP=cfg["group"], MAX_SEQS_P=cfg["max_seqs_p"],
        BLOCK_M=cfg["block_m"], **cfg["tile_launch"], **common)
    if splits > 1:
        _attn_reduce_kernel[(num_tokens, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=cfg["block_d"], NUM_SPLITS=splits, SPLITS_P=next_pow2(splits), PDL=pdl_on(), num_warps=4,
            **pdl_launch())


def _check_args(q, layer_cache, seq_ids, q_start, ctx_lens, block_tables, num_seqs) -> None:
    check("q", q, dtype=(torch.bfloat16, torch.float16), ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    check("layer_cache", layer_cache, dtype=(q.dtype, torch.float8_e4m3fn), shape=(2, None, None, None, head_dim), device=q.device)
    if not layer_cache.is_contiguous():
        raise ValueError("layer_cache must be contiguous ([2, num_blocks, block_size, KVH, D], e.g. kv_cache[layer])")
    if num_heads % layer_cache.shape[3]:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's {layer_cache.shape[3]} KV heads")
    check("seq_ids_of_token", seq_ids, dtype=torch.int32, shape=(num_tokens,), device=q.device)
    check("q_start", q_start, dtype=torch.int32, ndim=1, device=q.device)
    max_seqs = q_start.shape[0] - 1
    if max_seqs < 1:
        raise ValueError(f"q_start must be [S+1] with S >= 1, got {tuple(q_start.shape)}")
    check("ctx_lens", ctx_lens, dtype=torch.int32, shape=(max_seqs,), device=q.device)
    check("block_tables", block_tables, dtype=torch.int32, shape=(max_seqs, None), device=q.device)
    check("num_seqs", num_seqs, dtype=torch.int32, shape=(1,), device=q.device)
