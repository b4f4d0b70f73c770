"""Sampling on the GPU: greedy, temperature, top-k, top-p, min-p, with the counter-based RNG of the CPU
engine (`gpu_backend/engine/sampler.py`), so one seed gives the same tokens in every engine mode (up to
logit rounding).

Three steps, all graph-capturable (fixed grids from shapes, parameters read from device tensors, no
host sync, no .item()):
1. `_softmax_kernel` (Triton), one program per row: argmax of the raw logits (written as the token of
   greedy rows only: temperature <= 0 or top_k == 1) and probs = softmax(logits / temperature), like the CPU engine.
2. `torch.sort(probs, descending=True, stable=True)`. A full-vocabulary sort is what makes the
   inverse-CDF draw identical to the CPU engine's for every top_k/top_p/min_p (the filters are defined
   on the descending order and the draw walks it). torch.sort runs on device with no host sync and is
   capturable; writing a segmented radix sort ourselves would buy speed, not behaviour.
3. `_select_kernel` (Triton), one program per sampled row: the CPU engine's filter (rank < top_k,
   float32 mass before < top_p, p >= min_p * p_max, the top token always kept), then the draw: the
   uniform u = SplitMix64(SplitMix64(seed) ^ position * golden) >> 11 * 2^-53, target = u * total in
   float64, pick = #(float64 cdf <= target) clamped like the CPU engine, token = order[pick].
   Cumulative sums run in float64 (as torch's CPU cumsum accumulates) over chunks with a carry, and
   stop early once no later token can pass the filters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check

_BLOCK = 2048


@triton.jit
def _splitmix64(x):
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _uniform(seed, position):
    """float64 in [0, 1) for int64 (seed, position); bit-identical to sampler.uniforms."""
    key = _splitmix64(seed.to(tl.uint64, bitcast=True)) ^ (position.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
    return (_splitmix64(key) >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _is_greedy(temp_ptr, top_k_ptr, row):
    return (tl.load(temp_ptr + row) <= 0.0) | (tl.load(top_k_ptr + row) == 1)


@triton.jit
def _softmax_kernel(logits_ptr, temp_ptr, top_k_ptr, probs_ptr, tokens_ptr, vocab, logits_stride,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    greedy = _is_greedy(temp_ptr, top_k_ptr, row)
    temp = tl.where(greedy, 1.0, tl.load(temp_ptr + row))
    cols = tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row * logits_stride
    best = tl.full([BLOCK], float("-inf"), tl.float32)   # per-lane running max and its first index
    best_idx = tl.zeros([BLOCK], tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)      # per-lane online softmax of logits / temp
    z = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf"))
        better = x > best
        best_idx = tl.where(better, start + cols, best_idx)
        best = tl.where(better, x, best)
        y = x / temp
        m_new = tl.maximum(m, y)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - m_safe) + tl.exp(y - m_safe)
        m = m_new
    top = tl.max(best, axis=0)
    # greedy rows only: every row's token is written once (by this kernel or `_select_kernel`), so the
    # persistent loop can take a row's token as final as soon as it differs from the -1 it left there
    tl.store(tokens_ptr + row, tl.min(tl.where(best == top, best_idx, vocab), axis=0).to(tokens_ptr.dtype.element_ty),
             mask=greedy)
    m_row = tl.max(m, axis=0)
    z_row = tl.sum(z * tl.exp(m - m_row), axis=0)
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_ptr + start + cols, mask=start + cols < vocab, other=float("-inf"))
        tl.store(probs_ptr + row * vocab + start + cols, tl.exp(x / temp - m_row) / z_row, mask=start + cols < vocab)


@triton.jit
def _filtered_cdf(row_ptr, start, end, carry, cdf_carry, top_k, top_p, min_prob, BLOCK: tl.constexpr):
    """One chunk [start, start + BLOCK) of the CPU engine's filter and float64 cdf over descending probs.

    carry: unfiltered float64 mass before the chunk; cdf_carry: filtered mass before it. Returns
    (p, filtered p, cdf, new carry, new cdf_carry); lanes >= end read as probability 0.
    """
    idx = start + tl.arange(0, BLOCK)
    p = tl.load(row_ptr + idx, mask=idx < end, other=0.0)
    csum = carry + tl.cumsum(p.to(tl.float64), axis=0)      # as torch's CPU cumsum: float64, rounded to f32
    mass_before = csum.to(tl.float32) - p
    keep = ((idx < top_k) & (mass_before < top_p) & (p >= min_prob)) | (idx == 0)
    f = tl.where(keep, p, 0.0)
    cdf = cdf_carry + tl.cumsum(f.to(tl.float64), axis=0)
    return p, f, cdf, tl.max(csum, axis=0), tl.max(cdf, axis=0)   # sums are monotone: max = last lane


@triton.jit
def _select_kernel(sorted_ptr, order_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, pos_ptr,
                   tokens_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    greedy = _is_greedy(temp_ptr, top_k_ptr, row)
    top_k = tl.load(top_k_ptr + row)
    top_k = tl.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    top_p = tl.load(top_p_ptr + row)
    top_p = tl.where(top_p < 1.0, top_p, 2.0)   # >= 1 keeps every token, as the CPU sampler does
    row_ptr = sorted_ptr + row * vocab
    min_prob = tl.load(min_p_ptr + row) * tl.load(row_ptr)
    end = tl.where(greedy, 0, top_k)      # greedy rows: nothing to do (argmax came from the softmax kernel)
    idx0 = tl.arange(0, BLOCK)

    # pass 1: filtered total and the count of kept tokens; stop at the first chunk after which no token
    # can pass (later tokens have mass_before >= carry and p <= this chunk's last p)
    carry = tl.zeros([], tl.float64)
    total = tl.zeros([], tl.float64)
    num_pos = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)   # loop-carried: must be a tensor, not a Python int
    go = start < end
    while go:
        p, f, cdf, carry, total = _filtered_cdf(row_ptr, start, end, carry, total, top_k, top_p, min_prob, BLOCK)
        num_pos += tl.sum((f > 0).to(tl.int32), axis=0)
        last_p = tl.min(tl.where(start + idx0 < end, p, 1.0), axis=0)
        start += BLOCK
        go = (start < end) & (carry.to(tl.float32) < top_p + 1e-6) & (last_p >= min_prob)
    scan_end = tl.minimum(start, end)     # filtered probs past this are 0: cdf = total there

    # pass 2: pick = #(cdf <= target) over the whole vocabulary, as searchsorted(right=True)
    target = _uniform(tl.load(seed_ptr + row), tl.load(pos_ptr + row)) * total
    carry = tl.zeros([], tl.float64)
    cdf_carry = tl.zeros([], tl.float64)
    pick = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)   # loop-carried: must be a tensor, not a Python int
    go = start < scan_end
    while go:
        p, f, cdf, carry, cdf_carry = _filtered_cdf(row_ptr, start, scan_end, carry, cdf_carry, top_k, top_p,
                                                    min_prob, BLOCK)
        pick += tl.sum(((cdf <= target) & (start + idx0 < scan_end)).to(tl.int32), axis=0)
        start += BLOCK
        go = (start < scan_end) & (cdf_carry <= target)
    pick += tl.where(cdf_carry <= target, vocab - scan_end, 0)
    pick = tl.maximum(tl.minimum(tl.minimum(pick, vocab - 1), num_pos - 1), 0)
    token = tl.load(order_ptr + row * vocab + pick)
    tl.store(tokens_ptr + row, token.to(tokens_ptr.dtype.element_ty), mask=~greedy)


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    u = _uniform(tl.load(seed_ptr + i, mask=ok, other=0), tl.load(pos_ptr + i, mask=ok, other=0))
    tl.store(out_ptr + i, u, mask=ok)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N] float64 uniforms for int64 (seed, position) pairs: the draw `sample` uses, exposed so tests
    can compare it bit for bit with `gpu_backend.engine.sampler.uniforms`. Graph-capturable."""
    check("seeds", seeds, dtype=torch.int64, ndim=1)
    check("positions", positions, dtype=torch.int64, shape=tuple(seeds.shape), device=seeds.device)
    out = torch.empty(seeds.shape, dtype=torch.float64, device=seeds.device)
    if seeds.numel():
        _uniform_kernel[(triton.cdiv(seeds.numel(), 1024),)](seeds, positions, out, seeds.numel(), BLOCK=1024)
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits, as `gpu_backend.engine.sampler.sample` picks it.

    logits: [N, V] float32 (rows may be strided); temperature, top_p, min_p: [N] float32;
    top_k: [N] int32 (<= 0: no limit); seeds, positions: [N] int64 (position = index of the token being
    sampled within prompt + output). Greedy when temperature <= 0 or top_k == 1.
    out: [N] int64 or int32. Graph-capturable: no host sync; the sort allocates from torch's caching
    allocator (the graph's pool under capture).
    """
    num_rows, vocab = _check_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    check("out", out, dtype=(torch.int64, torch.int32), shape=(num_rows,), device=logits.device)
    if num_rows == 0:
        return out
    probs = torch.empty((num_rows, vocab), dtype=torch.float32, device=logits.device)
    _softmax_kernel[(num_rows,)](logits, temperature, top_k, probs, out, vocab, logits.stride(0),
                                 BLOCK=_BLOCK, num_warps=8)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    _select_kernel[(num_rows,)](sorted_probs, order, temperature, top_k, top_p, min_p, seeds, positions, out,
                                vocab, BLOCK=_BLOCK, num_warps=8)
    return out


def _check_args(logits, temperature, top_k, top_p, min_p, seeds, positions) -> tuple[int, int]:
    check("logits", logits, dtype=torch.float32, ndim=2)
    num_rows, vocab = logits.shape
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                           ("seeds", seeds, torch.int64), ("positions", positions, torch.int64)):
        check(name, t, dtype=dtype, shape=(num_rows,), device=logits.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return num_rows, vocab
