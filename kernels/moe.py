"""Fused mixture of experts (Triton): routing, grouping of (token, expert) pairs by expert, and grouped GEMMs
over the experts' stacked weights, with no host synchronisation (graph-capturable).

A step of T tokens with top_k experts each has P = T * top_k pairs; pair p = t * top_k + j is token t's j-th
choice. Six launches (after the router GEMM), each with a grid fixed by the shapes:
1. `_route_kernel` (one program per token): softmax of the router logits over all E experts in float32,
   the top_k (ties to the lower expert id), renormalised when asked -> weights [T, k] f32, ids [T, k] i32.
   The softmax denominator and the renormalising sum are exact fixed-point sums (`_exact_sum`), so any
   tile shape computes the same bits (launches 1-3 fused below depend on it).
2. `_align_kernel` (one program per expert): a counting sort of the pairs by expert, stable (pairs of one
   expert keep their order): expert e's pairs land in sorted[offsets[e] : offsets[e] + counts[e]].
   No capacity is exceeded: P slots hold every pair whatever the routing.
3. `_block_table_kernel` (one program): the row blocks of BLOCK_M pairs that hold pairs, listed expert by
   expert (expert, start, end); at most P // BLOCK_M + min(E, P) of them (each expert with pairs rounds up
   once), and never more than E * cdiv(T, BLOCK_M). The GEMM grids have that many row programs; the unused
   ones (expert -1) return at once, so experts without pairs cost no program: at T = 1 the grids hold 8
   row blocks, not 128.
4. `_expert_gemm_kernel`, gate_up: one program per (row block, block of the intermediate width). Rows are
   gathered from x by token; SwiGLU is fused; h [P, I] is written by pair.
5. The same kernel over the down weights: h rows by pair -> y [P, hidden] f32, scaled by the pair's weight.
6. `_combine_kernel`: each token's k rows of y summed in a fixed order, rounded once (deterministic: no
   atomics anywhere).
A decode step of up to 32 token-expert pairs (`route_decode_pays`, e.g. 4 tokens x 8; the kernel takes up to 128,
`route_in_one_launch`) runs launches 1-3 as one program instead, `_route_decode_kernel`: the route of all its
tokens as one [T, E] tile, the counting sort as [experts, pairs] tiles, then (after a block barrier) the same block-table code, writing bit for bit
what the three launches write. It saves two launches per MoE layer, 96 a step of Qwen3-30B-A3B (whose eager
batch-1 step spent 110 + 116 + 188 us in launches 1-3 on an H100). On an H100 (c7232c8, kernels/device_check.py)
one launch takes 6.8 us at 1 token (three: 9.1) but 27.7 at 16 tokens (three: 16.7): its one program's sort
grows with the pairs while the three launches spread them, so it is used up to 32 pairs (the crossing).

A one-token step (batch-1 decode) takes `moe_one_token` instead, router GEMV included: three launches (router
logits with the routing done by the last program to finish; the chosen experts' gate_up + SwiGLU as GEMVs; their
down GEMVs weighted and summed, the k experts loaded together), no sort, no block table, no combine; the same
roundings.

Weights read: only the experts some token chose (programs of experts without pairs load nothing); each
chosen expert's tiles are read once per BLOCK_M of its pairs. Rounding follows the plain torch op
(`gpu_backend/models/moe.py`): gate and up rounded to the activation dtype, silu rounded, their product
rounded; the down projection rounded, then weighted and summed in float32 and rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2, pdl_launch, pdl_on
from .gemv import DEFAULT_CONFIG, check_norm, norm_chunk, norm_rstd
from .pdl import pdl_enter, pdl_release, pdl_wait

_DTYPES = (torch.bfloat16, torch.float16)
_BLOCK_K = 64
_ALIGN_BLOCK = 1024
_COMBINE_BLOCK = 1024
_DECODE_PAIRS = 128      # route_in_one_launch's bounds
_DECODE_PAYS_PAIRS = 32  # route_decode_pays: where one program stops beating three launches (H100, measured)
_DECODE_LOGITS = 4096
# the one-token gate_up GEMVs (BLOCK_N, BLOCK_K, num_warps): one gate and one up row a program. On an H100 at
# Qwen3-30B-A3B's shapes (bench/moe_probe.py --one-token) the whole one-token MoE took 37.3 us a layer with it
# against 40.1 with kernels/gemv.py's tile (two rows of each)
ONE_TOKEN_GATE_UP = (1, 1024, 4)
_DECODE_SORT_TILE = 2048  # [experts, pairs] flags per step of the sort: 128 registers at 16 x 8 (4,096: 255)


@triton.jit
def _exact_sum(x, axis: tl.constexpr):
    """Sum of values in [0, 1] along `axis` in 2^-52 fixed point: integer adds are exact, so every reduction
    order (any tile shape, any layout) gives the same bits; truncation costs at most 2^-52 a value."""
    return tl.sum((x * 4503599627370496.0).to(tl.int64), axis=axis).to(tl.float32) * 2.220446049250313e-16


@triton.jit
def _route_rows(logits_ptr, logits_stride, rows, row_ok, num_experts, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """Softmax, top_k (ties to the lower id), renormalised: logits rows [ROWS] -> (weights, ids) [ROWS, K_PAD]."""
    cols = tl.arange(0, BLOCK_E)[None, :]
    col_ok = cols < num_experts
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * logits_stride + cols, mask=row_ok[:, None] & col_ok,
                     other=0.0).to(tl.float32)
    logits = tl.where(col_ok, logits, -float("inf"))      # rows past the tokens: zeros, never stored
    probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = probs / _exact_sum(probs, 1)[:, None]         # padding columns: exactly 0
    slots = tl.arange(0, K_PAD)[None, :]
    top_w = tl.zeros((ROWS, K_PAD), dtype=tl.float32)
    top_id = tl.zeros((ROWS, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)[:, None]
        pick = tl.min(tl.where(probs == best, cols, BLOCK_E), axis=1)[:, None]
        top_w = tl.where(slots == j, best, top_w)
        top_id = tl.where(slots == j, pick, top_id)
        probs = tl.where(cols == pick, -1.0, probs)       # taken; every probability is >= 0
    if RENORMALIZE:
        top_w = top_w / _exact_sum(top_w, 1)[:, None]
    return top_w, top_id


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, logits_stride, num_experts,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    rows = tl.program_id(0) + tl.arange(0, 1)
    top_w, top_id = _route_rows(logits_ptr, logits_stride, rows, rows >= 0, num_experts, 1, TOP_K, K_PAD,
                                RENORMALIZE, BLOCK_E)
    out = rows[:, None].to(tl.int64) * TOP_K + tl.arange(0, K_PAD)[None, :]
    tl.store(weights_ptr + out, top_w, mask=tl.arange(0, K_PAD)[None, :] < TOP_K)
    tl.store(ids_ptr + out, top_id, mask=tl.arange(0, K_PAD)[None, :] < TOP_K)


@triton.jit
def _align_kernel(ids_ptr, num_pairs, sorted_ptr, counts_ptr, offsets_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    expert = tl.program_id(0)
    offset = tl.full((), 0, tl.int32)                     # pairs of lower experts come first
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=2147483647)
        offset += tl.sum((ids < expert).to(tl.int32), axis=0)
    count = tl.full((), 0, tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        hit = (tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) == expert).to(tl.int32)
        rank = count + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + offset + rank, pairs, mask=hit > 0)
        count += tl.sum(hit, axis=0)
    tl.store(counts_ptr + expert, count)
    tl.store(offsets_ptr + expert, offset)


@triton.jit
def _block_table_kernel(counts_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, num_experts,
                        max_blocks, BLOCK_M: tl.constexpr, E_P: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    _write_block_table(counts_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, num_experts,
                       max_blocks, BLOCK_M, E_P, CHUNK)


@triton.jit
def _write_block_table(counts_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, num_experts,
                       max_blocks, BLOCK_M: tl.constexpr, E_P: tl.constexpr, CHUNK: tl.constexpr):
    # one program: the row blocks of BLOCK_M pairs that hold pairs, expert by expert; the rest get expert -1
    experts = tl.arange(0, E_P)
    ok = experts < num_experts
    counts = tl.load(counts_ptr + experts, mask=ok, other=0)
    offsets = tl.load(offsets_ptr + experts, mask=ok, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    blocks_end = tl.cumsum(blocks, axis=0)                # inclusive: expert e's blocks end before this
    used = tl.sum(blocks, axis=0)
    for b0 in range(0, max_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # block b belongs to the first expert whose blocks end after it
        owner = tl.sum((blocks_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        pick = (experts[None, :] == owner[:, None]).to(tl.int32)              # [CHUNK, E_P] one-hot
        first_block = tl.sum(pick * (blocks_end - blocks)[None, :], axis=1)
        offset = tl.sum(pick * offsets[None, :], axis=1)
        count = tl.sum(pick * counts[None, :], axis=1)
        in_range = b < max_blocks
        tl.store(block_expert_ptr + b, tl.where(b < used, owner, -1), mask=in_range)
        tl.store(block_start_ptr + b, offset + (b - first_block) * BLOCK_M, mask=in_range)
        tl.store(block_end_ptr + b, offset + count, mask=in_range)


@triton.jit
def _route_decode_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, counts_ptr, offsets_ptr, block_expert_ptr,
                         block_start_ptr, block_end_ptr, num_tokens, logits_stride, num_experts, max_blocks,
                         T_P: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, E_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, E_P: tl.constexpr,
                         CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Launches 1-3 (route, align, block table) as one program for a decode step's T <= T_P tokens: saves two
    launches a MoE layer (96 a Qwen3-30B-A3B step); GPU timing not measured yet (kernels/device_check.py)."""
    pdl_enter(PDL)  # kernels/pdl.py
    rows = tl.arange(0, T_P)
    row_ok = rows < num_tokens
    top_w, top_id = _route_rows(logits_ptr, logits_stride, rows, row_ok, num_experts, T_P, TOP_K, K_PAD,
                                RENORMALIZE, BLOCK_E)
    slots = tl.arange(0, K_PAD)[None, :]
    pair = rows[:, None] * TOP_K + slots                  # [T_P, K_PAD]: p = t * top_k + j
    valid = row_ok[:, None] & (slots < TOP_K)
    tl.store(weights_ptr + pair, top_w, mask=valid)
    tl.store(ids_ptr + pair, top_id, mask=valid)
    # the counting sort: flattened (t, j) order is pair order, so ranks within an expert keep it stable
    pairs = tl.reshape(pair, (T_P * K_PAD,))
    ids = tl.reshape(tl.where(valid, top_id, 2147483647), (T_P * K_PAD,))   # padding: no expert's
    for e0 in range(0, num_experts, E_CHUNK):
        expert = e0 + tl.arange(0, E_CHUNK)
        hit = (ids[None, :] == expert[:, None]).to(tl.int32)                  # [E_CHUNK, T_P * K_PAD]
        offset = tl.sum((ids[None, :] < expert[:, None]).to(tl.int32), axis=1)
        rank = tl.cumsum(hit, axis=1) - 1
        tl.store(sorted_ptr + offset[:, None] + rank, pairs[None, :], mask=hit > 0)
        tl.store(counts_ptr + expert, tl.sum(hit, axis=1), mask=expert < num_experts)
        tl.store(offsets_ptr + expert, offset, mask=expert < num_experts)
    tl.debug_barrier()                                    # the counts and offsets above, read back by all threads
    _write_block_table(counts_ptr, offsets_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, num_experts,
                       max_blocks, BLOCK_M, E_P, CHUNK)


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
                        pair_weights_ptr, n_out, k_dim, a_stride, w_stride_e, w_stride_n, out_stride, up_offset,
                        TOP_K: tl.constexpr, SWIGLU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    # SWIGLU: a = x rows by token, w = gate_up [E, 2 I, hidden], out = h [P, I] in a's dtype
    # else:   a = h rows by pair,  w = down [E, hidden, I],      out = y [P, hidden] f32, scaled by the weight
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    rows = tl.load(block_start_ptr + tl.program_id(0)) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(block_end_ptr + tl.program_id(0))
    pairs = tl.load(sorted_ptr + rows, mask=row_ok, other=0)
    a_rows = (pairs // TOP_K if SWIGLU else pairs).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + ks
        k_ok = k < k_dim
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_base + cols[None, :].to(tl.int64) * w_stride_n + k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc)                           # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
        if SWIGLU:
            w_up = tl.load(w_base + (cols[None, :] + up_offset).to(tl.int64) * w_stride_n + k[:, None],
                           mask=w_mask, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up)
    act = a_ptr.dtype.element_ty
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * out_stride + cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SWIGLU:
        gate = acc.to(act).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
        tl.store(out_ptrs, (silu * acc_up.to(act).to(tl.float32)).to(act), mask=out_mask)
    else:
        weight = tl.load(pair_weights_ptr + pairs, mask=row_ok, other=0.0)
        tl.store(out_ptrs, acc.to(act).to(tl.float32) * weight[:, None], mask=out_mask)


@triton.jit
def _combine_kernel(y_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)  # kernels/pdl.py
    # out[t] = sum over j in order of y[t * TOP_K + j]: float32, rounded once
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_router_kernel(x_ptr, router_ptr, logits_ptr, weights_ptr, ids_ptr, done_ptr, res_ptr, nw_ptr, normed_ptr,
                       res_out_ptr, num_experts, hidden, router_stride, eps, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                       ROW_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One token: program e computes router logit e (a GEMV row, rounded to the activation dtype as F.linear
    would); the last program to finish (a counter it resets) routes all of them (`_route_rows`). With NORM 1 / 2
    the input is RMSNorm(x) / RMSNorm(x + residual) (kernels/gemv.py's `norm_rstd`, `norm_chunk`): every program
    normalises, program 0 also writes the normalised row (the experts' input) and the sum."""
    expert = tl.program_id(0)
    row = router_ptr + expert.to(tl.int64) * router_stride
    k = tl.arange(0, BLOCK_K)
    ok = k < hidden
    w = tl.load(row + k, mask=ok, other=0.0)  # weights first: they do not depend on the previous kernel
    pdl_wait(PDL)  # kernels/pdl.py
    rstd = 1.0
    if NORM != 0:
        rstd = norm_rstd(x_ptr, res_ptr, res_out_ptr, hidden, eps, expert == 0, NORM, ROW_BLOCK)
    xk = norm_chunk(x_ptr, res_ptr, nw_ptr, k, ok, rstd, NORM)
    if NORM != 0:
        tl.store(normed_ptr + k, xk.to(normed_ptr.dtype.element_ty), mask=ok & (expert == 0))
    acc = w.to(tl.float32) * xk
    for k0 in range(BLOCK_K, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = k < hidden
        xk = norm_chunk(x_ptr, res_ptr, nw_ptr, k, ok, rstd, NORM)
        if NORM != 0:
            tl.store(normed_ptr + k, xk.to(normed_ptr.dtype.element_ty), mask=ok & (expert == 0))
        acc += tl.load(row + k, mask=ok, other=0.0).to(tl.float32) * xk
    pdl_release(PDL)
    tl.store(logits_ptr + expert, tl.sum(acc, axis=0).to(logits_ptr.dtype.element_ty))
    # acq_rel: the stores above are seen by whichever program comes last, and it sees all of them
    if tl.atomic_add(done_ptr, 1, sem="acq_rel") == num_experts - 1:
        rows = tl.arange(0, 1)
        top_w, top_id = _route_rows(logits_ptr, 0, rows, rows < 1, num_experts, 1, TOP_K, K_PAD, RENORMALIZE,
                                    BLOCK_E)
        slots = tl.arange(0, K_PAD)[None, :]
        tl.store(weights_ptr + slots, top_w, mask=slots < TOP_K)
        tl.store(ids_ptr + slots, top_id, mask=slots < TOP_K)
        tl.store(done_ptr, 0)                             # ready for the next launch (which waits for this one)


@triton.jit
def _one_gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, hidden, inter, w_stride_e, w_stride_n,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr):
    """One token, program (j, n): h[j, n-block] = silu(gate_e x) * (up_e x), e = ids[j], rounded as
    `_expert_gemm_kernel` rounds (gate and up to the activation dtype, silu, the product). EVICT: the weight loads'
    L2 eviction policy ("" default; "evict_first" keeps lines prefetched for later kernels, kernels/prefetch.py)."""
    pdl_wait(PDL)  # kernels/pdl.py
    j = tl.program_id(0)
    expert = tl.load(ids_ptr + j).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = w_ptr + expert * w_stride_e + cols.to(tl.int64)[:, None] * w_stride_n
    up_rows = gate_rows + inter * w_stride_n
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = col_ok[:, None] & k_ok[None, :]
        acc += tl.load(gate_rows + k[None, :], mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32) * x
        acc_up += tl.load(up_rows + k[None, :], mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32) * x
    pdl_release(PDL)
    act = h_ptr.dtype.element_ty
    gate = tl.sum(acc, axis=1).to(act).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
    tl.store(h_ptr + j * inter + cols, (silu * tl.sum(acc_up, axis=1).to(act).to(tl.float32)).to(act), mask=col_ok)


@triton.jit
def _one_down_kernel(h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, inter, w_stride_e, w_stride_n,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVICT: tl.constexpr, PDL: tl.constexpr):
    """One token, program n: out[n-block] = sum over j of weights[j] * (down_e h[j]), e = ids[j]: each expert's
    rows rounded to the activation dtype, weighted and summed in float32, rounded once (what the down GEMM and
    `_combine_kernel` do, in one launch). The k experts' rows load together, [K_PAD, BLOCK_N, BLOCK_K] a step,
    so each step has k times the loads in flight of one expert's GEMV. The expert ids and the first step's weights
    load before the wait for the gate_up kernel, whose h is all this one needs from it (the ids come from the
    router's launch, which ended before gate_up's wait returned), as the GEMVs load their first weight tile: on an
    H200 at Qwen3-30B-A3B's shapes 12 us less a batch-1 step than waiting first (bench/NOTES.md, MoE)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    choice = tl.arange(0, K_PAD)
    choice_ok = choice < TOP_K
    experts = tl.load(ids_ptr + choice, mask=choice_ok, other=0).to(tl.int64)
    rows = w_ptr + experts[:, None, None] * w_stride_e + cols.to(tl.int64)[None, :, None] * w_stride_n
    row_ok = choice_ok[:, None, None] & col_ok[None, :, None]
    acc = tl.zeros((K_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k = tl.arange(0, BLOCK_K)
    w0 = tl.load(rows + k[None, None, :], mask=row_ok & (k < inter)[None, None, :], other=0.0, eviction_policy=EVICT)
    pdl_wait(PDL)  # kernels/pdl.py
    h = tl.load(h_ptr + choice[:, None] * inter + k[None, :], mask=choice_ok[:, None] & (k < inter)[None, :],
                other=0.0).to(tl.float32)
    acc += w0.to(tl.float32) * h[:, None, :]
    for k0 in range(BLOCK_K, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        h = tl.load(h_ptr + choice[:, None] * inter + k[None, :], mask=choice_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(rows + k[None, None, :], mask=row_ok & k_ok[None, None, :], other=0.0,
                    eviction_policy=EVICT).to(tl.float32)
        acc += w * h[:, None, :]
    pdl_release(PDL)
    act = out_ptr.dtype.element_ty
    weights = tl.load(weights_ptr + choice, mask=choice_ok, other=0.0)
    y = tl.sum(acc, axis=2).to(act).to(tl.float32) * weights[:, None]       # [K_PAD, BLOCK_N]
    tl.store(out_ptr + cols, tl.sum(y, axis=0).to(act), mask=col_ok)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int32), best first: softmax
    over all E in float32, top_k (ties to the lower id), weights renormalised to sum 1 when `renormalize`.
    Graph-capturable; no host sync."""
    num_tokens, num_experts = _check_route(router_logits, top_k)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](router_logits, weights, ids, router_logits.stride(0), num_experts, TOP_K=top_k,
                                     K_PAD=next_pow2(top_k), RENORMALIZE=bool(renormalize),
                                     BLOCK_E=next_pow2(num_experts), PDL=pdl_on(), num_warps=1,
                                     **pdl_launch())
    return weights, ids


def _check_route(router_logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    check("router_logits", router_logits, dtype=(*_DTYPES, torch.float32), ndim=2)
    num_tokens, num_experts = router_logits.shape
    _check_top_k(top_k, num_experts)
    return num_tokens, num_experts


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts} (the experts), got {top_k}")


def route_in_one_launch(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `moe_route_decode` takes a step of num_tokens: up to 128 (token, slot) pairs (16 tokens x 8 of
    Qwen3-30B-A3B, 64 x 2 of Mixtral) and 4,096 router logits in one program (4 warps: 32 float32 logits and 16
    sort flags a thread; 128 registers, no spill, at 16 x 8 of 128 experts). Past that one program is too
    wide for its registers, and T programs route in parallel anyway: the three launches are kept."""
    tokens_p, k_pad, experts_p = next_pow2(max(num_tokens, 1)), next_pow2(top_k), next_pow2(num_experts)
    return 0 < num_tokens and tokens_p * k_pad <= _DECODE_PAIRS and tokens_p * experts_p <= _DECODE_LOGITS


def route_decode_pays(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `fused_moe` routes a step of num_tokens in one launch: it can (`route_in_one_launch`) and the
    padded pairs are few enough for one program to beat three launches (32: 6.8 vs 9.1 us at 8 pairs, 27.7 vs
    16.7 at 128 on an H100)."""
    return (route_in_one_launch(num_tokens, top_k, num_experts)
            and next_pow2(max(num_tokens, 1)) * next_pow2(top_k) <= _DECODE_PAYS_PAIRS)


def moe_route_decode(router_logits: torch.Tensor, top_k: int, renormalize: bool, bm: int,
                     max_blocks: int) -> tuple[torch.Tensor, ...]:
    """`moe_route`, `moe_align` and `moe_block_table` in one launch of one program, for a decode step
    (`route_in_one_launch`): router_logits [T, E] -> (weights [T, k] f32, ids [T, k] i32, sorted pairs [T*k],
    counts [E], offsets [E], block expert / start / end [max_blocks], all int32), bit for bit what the three
    launches write. It saves two launches a MoE layer (96 a step of Qwen3-30B-A3B); `fused_moe` uses it up to 32
    pairs (`route_decode_pays`). Graph-capturable; no host sync."""
    num_tokens, num_experts = _check_route(router_logits, top_k)
    if not route_in_one_launch(num_tokens, top_k, num_experts):
        raise ValueError(f"moe_route_decode takes at most {_DECODE_PAIRS} token-expert pairs and "
                         f"{_DECODE_LOGITS} logits (padded to powers of two), got {num_tokens} tokens x top_k "
                         f"{top_k} of {num_experts} experts; use moe_route, moe_align and moe_block_table")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(num_tokens * top_k, dtype=torch.int32, device=device)
    counts_offsets = torch.empty((2, num_experts), dtype=torch.int32, device=device)
    table = torch.empty((3, max_blocks), dtype=torch.int32, device=device)
    tokens_p, k_pad, e_p = next_pow2(num_tokens), next_pow2(top_k), next_pow2(num_experts)
    _route_decode_kernel[(1,)](
        router_logits, weights, ids, sorted_pairs, counts_offsets[0], counts_offsets[1], table[0], table[1], table[2],
        num_tokens, router_logits.stride(0), num_experts, max_blocks, T_P=tokens_p, TOP_K=top_k, K_PAD=k_pad,
        RENORMALIZE=bool(renormalize), BLOCK_E=e_p, E_CHUNK=min(e_p, max(1, _DECODE_SORT_TILE // (tokens_p * k_pad))),
        BLOCK_M=bm, E_P=e_p, CHUNK=_table_chunk(e_p), PDL=pdl_on(), num_warps=4, **pdl_launch())
    return weights, ids, sorted_pairs, counts_offsets[0], counts_offsets[1], table[0], table[1], table[2]


def moe_align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] int32 in 0..num_experts-1 -> (sorted pairs [T*k] int32, counts [E] int32, offsets [E] int32):
    expert e's pairs (p = t * k + j, ascending) are sorted[offsets[e] : offsets[e] + counts[e]].
    Graph-capturable; no host sync."""
    check("ids", ids, dtype=torch.int32, ndim=2)
    if not ids.is_contiguous():
        raise ValueError("ids must be contiguous")
    num_pairs = ids.numel()
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _align_kernel[(num_experts,)](ids, num_pairs, sorted_pairs, counts, offsets, BLOCK=_ALIGN_BLOCK, PDL=pdl_on(),
                                  num_warps=4, **pdl_launch())
    return sorted_pairs, counts, offsets


def max_row_blocks(num_tokens: int, top_k: int, num_experts: int, bm: int) -> int:
    """Row blocks of `bm` pairs that any routing of num_tokens * top_k pairs can fill: each expert with pairs
    rounds up once, and an expert takes at most num_tokens pairs."""
    num_pairs = num_tokens * top_k
    return min(num_experts * triton.cdiv(num_tokens, bm), num_pairs // bm + min(num_experts, num_pairs))


def moe_block_table(counts: torch.Tensor, offsets: torch.Tensor, bm: int,
                    max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row blocks the expert GEMMs run, from `moe_align`'s counts and offsets: (expert [B] int32, -1 past
    the used ones; start [B], end [B] int32: the block's pairs are sorted[start : min(start + bm, end)]).
    B = max_blocks (`max_row_blocks`). Graph-capturable; no host sync."""
    num_experts = counts.shape[0]
    e_p = next_pow2(num_experts)
    table = torch.empty((3, max_blocks), dtype=torch.int32, device=counts.device)
    _block_table_kernel[(1,)](counts, offsets, table[0], table[1], table[2], num_experts, max_blocks, BLOCK_M=bm,
                              E_P=e_p, CHUNK=_table_chunk(e_p), PDL=pdl_on(), num_warps=4, **pdl_launch())
    return table[0], table[1], table[2]


def _table_chunk(experts_p: int) -> int:
    """Row blocks per step of the block-table loop: its [CHUNK, E_P] one-hot stays at 4,096 entries."""
    return max(16, min(128, 4096 // experts_p))


def block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per program: about the pairs an expert gets (16, tl.dot's least, for decode)."""
    per_expert = -(-num_pairs // num_experts)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


@dataclass(frozen=True)
class ExpertTiles:
    """The expert GEMMs' launch shape: output columns and K depth per program, warps, pipeline stages (None:
    Triton's default). `expert_tiles` picks it; bench/moe_probe.py times others."""

    block_n: int
    block_k: int = _BLOCK_K
    num_warps: int = 4
    num_stages: int | None = None

    def launch(self) -> dict:
        extra = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, num_warps=self.num_warps, **extra)


def expert_tiles(rows: int) -> ExpertTiles:
    """The tiles for row blocks of `rows` pairs. Decode's (16 rows): 64 columns, K in 128s, 4 stages, the fastest
    of 18 shapes at Qwen3-30B-A3B's experts on an H200 (bench/moe_probe.py, bench/NOTES.md: 32.7 against
    37.8 us a layer at 1 token, 133 against 139 at 8)."""
    if rows <= 16:
        return ExpertTiles(64, 128, 4, 4)
    return ExpertTiles(64)  # not probed yet: the first version's tiles


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_gate_up: torch.Tensor,
                experts_down: torch.Tensor, tiles: ExpertTiles | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j]: x [T, hidden] bf16/fp16;
    weights [T, k] float32; ids [T, k] int32, each in 0..E-1 (what `moe_route` gives; an id out of range
    leaves its pair's rows unwritten); experts_gate_up [E, 2 I, hidden] (gate rows first); experts_down
    [E, hidden, I]. -> [T, hidden] in x's dtype. Graph-capturable; no host sync. `tiles`: the GEMMs' launch
    shape (default `expert_tiles`)."""
    num_tokens, _, num_experts, _ = _check_experts(x, weights, ids, experts_gate_up, experts_down)
    if num_tokens == 0:
        return torch.empty_like(x)
    sorted_pairs, counts, offsets = moe_align(ids, num_experts)
    bm, row_blocks = _row_blocks(num_tokens, ids.shape[1], num_experts)
    table = moe_block_table(counts, offsets, bm, row_blocks)
    return _expert_mlps(x, weights, sorted_pairs, table, bm, experts_gate_up, experts_down, tiles)


def _row_blocks(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int]:
    """(BLOCK_M, the GEMM grids' row programs) for a step."""
    bm = block_m(num_tokens * top_k, num_experts)
    return bm, max_row_blocks(num_tokens, top_k, num_experts, bm)


def _expert_mlps(x, weights, sorted_pairs, table, bm: int, experts_gate_up, experts_down,
                 tiles: ExpertTiles | None) -> torch.Tensor:
    """Launches 4-6 over a routing: the gate_up and down GEMMs by row block, then the combine."""
    (num_tokens, hidden), (num_pairs, top_k) = x.shape, (sorted_pairs.shape[0], weights.shape[1])
    inter, row_blocks = experts_down.shape[2], table[0].shape[0]
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    tiles = tiles or expert_tiles(bm)
    bn = tiles.block_n
    common = dict(TOP_K=top_k, BLOCK_M=bm, PDL=pdl_on(), **tiles.launch(), **pdl_launch())
    _expert_gemm_kernel[(row_blocks, triton.cdiv(inter, bn))](
        x, experts_gate_up, h, sorted_pairs, *table, weights, inter, hidden, x.stride(0),
        experts_gate_up.stride(0), experts_gate_up.stride(1), h.stride(0), inter, SWIGLU=True, **common)
    _expert_gemm_kernel[(row_blocks, triton.cdiv(hidden, bn))](
        h, experts_down, y, sorted_pairs, *table, weights, hidden, inter, h.stride(0),
        experts_down.stride(0), experts_down.stride(1), y.stride(0), 0, SWIGLU=False, **common)
    out = torch.empty_like(x)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, _COMBINE_BLOCK))](y, out, hidden, TOP_K=top_k,
                                                                       BLOCK=_COMBINE_BLOCK, PDL=pdl_on(),
                                                                       num_warps=4, **pdl_launch())
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, experts_gate_up: torch.Tensor,
              experts_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The whole mixture of experts after the router GEMM: `moe_route` then `moe_experts`; a decode step
    (`route_decode_pays`) routes, sorts and lists its row blocks in one launch (`moe_route_decode`) instead
    of three, with the same bits. x [T, hidden]; router_logits [T, E]. -> [T, hidden]. Graph-capturable; no
    host sync."""
    num_tokens, num_experts = router_logits.shape
    if not route_decode_pays(num_tokens, top_k, num_experts):
        weights, ids = moe_route(router_logits, top_k, renormalize)
        return moe_experts(x, weights, ids, experts_gate_up, experts_down)
    bm, row_blocks = _row_blocks(num_tokens, top_k, num_experts)
    weights, ids, sorted_pairs, _, _, *table = moe_route_decode(router_logits, top_k, renormalize, bm, row_blocks)
    _check_experts(x, weights, ids, experts_gate_up, experts_down)
    return _expert_mlps(x, weights, sorted_pairs, table, bm, experts_gate_up, experts_down, None)


_done_counters: dict[torch.device, torch.Tensor] = {}


def moe_one_token(x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor,
                  experts_down: torch.Tensor, top_k: int, renormalize: bool,
                  norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
                  residual_out: torch.Tensor | None = None, gate_up_tile: tuple[int, int, int] | None = None,
                  down_tile: tuple[int, int, int] | None = None,
                  router_tile: tuple[int, int] | None = None, evict_first: bool = False) -> torch.Tensor:
    """A one-token step's whole mixture of experts, the router GEMV included, in three launches instead of
    five (router GEMV, routing, gate_up, down, combine): (1) one program per expert computes its router logit
    and the last to finish routes them (softmax, top_k, renormalised: `_route_rows`); (2) gate_up + SwiGLU of
    the k chosen experts, a GEMV each, program (choice, rows); (3) the down GEMVs of the k experts, weighted
    and summed in float32, rounded once. At one token there is nothing to sort: each choice is
    one row. The roundings are `fused_moe`'s (the sums' order within a row differs: GEMV, not tl.dot).
    x [1, hidden]; router [E, hidden]; the experts as `moe_experts` takes them. -> [1, hidden].
    `norm` = (residual or None, norm weight [hidden], eps): the experts' input is RMSNorm(x + residual) * weight
    (as kernels/gemv.py's `norm`), computed in the router's launch; x + residual goes to `residual_out`.
    `gate_up_tile` (BLOCK_N, BLOCK_K, num_warps), `down_tile` (BLOCK_N, BLOCK_K of each expert, num_warps) and
    `router_tile` (BLOCK_K, num_warps: the router's warps also run its last program's routing, a chain of 2 x top_k
    reductions over the experts) override the tiles (bench/moe_probe.py --one-token). `evict_first`: the experts'
    weights leave L2 first (their lines are read once a step), so lines prefetched for the next layer stay.
    Graph-capturable, no host sync; launch it once on a device before capturing it there (the first launch
    makes the device's completion counter)."""
    check("x", x, dtype=_DTYPES, shape=(1, None))
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    hidden = x.shape[1]
    check("router", router, dtype=x.dtype, ndim=2, device=x.device)
    num_experts = router.shape[0]
    check("router", router, shape=(num_experts, hidden))
    _check_top_k(top_k, num_experts)
    if _check_expert_weights(x, experts_gate_up, experts_down)[0] != num_experts:
        raise ValueError(f"router has {num_experts} experts, experts_gate_up {experts_gate_up.shape[0]}")
    inter = experts_down.shape[2]
    done = _done_counters.get(x.device)
    if done is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_one_token: launch it once on this device before capturing it in a CUDA graph")
        done = _done_counters[x.device] = torch.zeros(1, dtype=torch.int32, device=x.device)
    res, norm_w, eps, norm_code = check_norm("moe_one_token", x, norm, residual_out)
    expert_in = torch.empty_like(x) if norm is not None else x  # the normalised row, written by the router's launch
    logits = torch.empty(num_experts, dtype=x.dtype, device=x.device)
    weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(top_k, dtype=torch.int32, device=x.device)
    h = torch.empty((top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    pdl = dict(PDL=pdl_on(), **pdl_launch())
    # one row a program, K in steps of up to 2,048 and one warp a 2,048 of the row (the fused norm holds the whole
    # row): the routing tail's 2 x top_k reductions stay inside a warp at Qwen3-MoE's hidden 2,048 (H200,
    # bench/moe_probe.py --one-token: 28.2 us for the three launches against 30.6 at kernels/gemv.py's tile; the
    # batch-1 step 107 us less, bench/NOTES.md)
    router_k, router_warps = router_tile or (min(next_pow2(hidden), 2048), max(1, next_pow2(hidden) // 2048))
    _one_router_kernel[(num_experts,)](x, router, logits, weights, ids, done, res if res is not None else x,
                                       norm_w if norm_w is not None else x, expert_in,
                                       residual_out if residual_out is not None else x, num_experts, hidden,
                                       router.stride(0), float(eps), TOP_K=top_k, K_PAD=next_pow2(top_k),
                                       RENORMALIZE=bool(renormalize), BLOCK_E=next_pow2(num_experts), BLOCK_K=router_k,
                                       NORM=norm_code,
                                       ROW_BLOCK=next_pow2(hidden), num_warps=router_warps, **pdl)
    gu_n, gu_k, gu_warps = gate_up_tile or ONE_TOKEN_GATE_UP
    _one_gate_up_kernel[(top_k, triton.cdiv(inter, gu_n))](
        expert_in, experts_gate_up, ids, h, hidden, inter, experts_gate_up.stride(0), experts_gate_up.stride(1),
        BLOCK_N=gu_n, BLOCK_K=gu_k, EVICT="evict_first" if evict_first else "", num_warps=gu_warps, **pdl)
    # the down kernel loads the k experts' rows together: K per step divided among them keeps the GEMV tile's
    # weights a step (on an H100, 4x or 1/2x that lost 3-14%: bench/NOTES.md)
    k_pad = next_pow2(top_k)
    bn, bk, warps = DEFAULT_CONFIG
    dn_n, dn_k, dn_warps = down_tile or (bn, min(max(bk // k_pad, 16), next_pow2(inter)), warps)
    _one_down_kernel[(triton.cdiv(hidden, dn_n),)](
        h, experts_down, ids, weights, out, hidden, inter, experts_down.stride(0), experts_down.stride(1),
        TOP_K=top_k, K_PAD=k_pad, BLOCK_N=dn_n, BLOCK_K=dn_k, EVICT="evict_first" if evict_first else "",
        num_warps=dn_warps, **pdl)
    return out


def _check_expert_weights(x, gate_up, down) -> tuple[int, int]:
    """(experts, intermediate width) of gate_up [E, 2 I, hidden] (gate rows first) and down [E, hidden, I]."""
    hidden = x.shape[1]
    check("experts_gate_up", gate_up, dtype=x.dtype, ndim=3, device=x.device)
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    check("experts_gate_up", gate_up, shape=(num_experts, 2 * inter, hidden))
    check("experts_down", down, dtype=x.dtype, shape=(num_experts, hidden, inter), device=x.device)
    return num_experts, inter


def _check_experts(x, weights, ids, gate_up, down) -> tuple[int, int, int, int]:
    check("x", x, dtype=_DTYPES, ndim=2)
    num_tokens, hidden = x.shape
    num_experts, inter = _check_expert_weights(x, gate_up, down)
    check("ids", ids, dtype=torch.int32, ndim=2, device=x.device)
    top_k = ids.shape[1]
    check("ids", ids, shape=(num_tokens, top_k))
    check("weights", weights, dtype=torch.float32, shape=(num_tokens, top_k), device=x.device)
    if not (weights.is_contiguous() and ids.is_contiguous()):
        raise ValueError("weights and ids must be contiguous")
    return num_tokens, hidden, num_experts, inter
