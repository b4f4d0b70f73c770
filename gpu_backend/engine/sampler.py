"""Sampling with a counter-based RNG: the token at `position` of a request depends only on its logits,
its parameters, and (seed, position) -- never on the batch it ran in, nor on how often it was recomputed.

The uniform for (seed, position) is SplitMix64 of a mix of the two; the GPU kernel computes the same
function, so the same seed gives the same tokens in every engine mode (up to logit rounding).
The draw is an inverse-CDF over the filtered distribution in descending-probability order.

`sample_step` adds what only the `cpu` engine does so far (the GPU modes sample with a Triton kernel
inside CUDA graphs, and the gateway refuses these parameters for them): logit bias, then repetition,
frequency and presence penalties (vLLM's order and formulas), and logprobs. Logprobs are the
log-softmax of the logits after bias, penalties and temperature (temperature 1 for greedy rows),
before top-k/top-p/min-p filtering: vLLM's "processed_logprobs" mode.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocols.ring import TokenLogprob

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(_GOLDEN)) & np.uint64(_MASK64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[N] float64 in [0, 1), one per (seed, position) pair."""
    with np.errstate(over="ignore"):
        key = splitmix64(seeds.astype(np.uint64)) ^ (positions.astype(np.uint64) * np.uint64(_GOLDEN))
    return (splitmix64(key) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SamplingRow:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    position: int  # index of the token being sampled within prompt + output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, bias)
    prompt_ids: Sequence[int] = ()  # the penalties' history: repetition over both, the others over output
    output_ids: Sequence[int] = ()
    num_logprobs: int | None = None  # None: none; k: the chosen token's logprob and k alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def sample_step(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, V] float32 -> N token ids and, for rows that ask, their logprobs."""
    logits = apply_penalties(logits, rows)
    tokens = sample(logits, rows)
    return tokens, token_logprobs(logits, rows, tokens)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logit bias, then the repetition penalty over prompt + output (positive logits divided by it,
    negative ones multiplied), then frequency (times the token's count in the output) and presence
    (once if it occurs) subtracted. Returns `logits` itself when no row asks, else a copy. [N, V]"""
    idx = [i for i, r in enumerate(rows) if r.adjusts_logits]
    if not idx:
        return logits
    out = logits.clone()
    for i in idx:
        _penalize(out[i], rows[i])
    return out


def _penalize(row: torch.Tensor, r: SamplingRow) -> None:
    """In place on one row [V]. Ids outside the row are ignored (the gateway checked them against the vocabulary)."""
    vocab = row.shape[0]
    bias = [(t, b) for t, b in r.logit_bias if 0 <= t < vocab]
    if bias:
        row.index_add_(0, torch.tensor([t for t, _ in bias]), torch.tensor([b for _, b in bias], dtype=row.dtype))
    if r.repetition_penalty != 1.0:
        seen = torch.tensor([t for t in (*r.prompt_ids, *r.output_ids) if 0 <= t < vocab], dtype=torch.int64).unique()
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
    if (r.frequency_penalty or r.presence_penalty) and r.output_ids:
        counts = torch.bincount(torch.tensor(list(r.output_ids), dtype=torch.int64), minlength=vocab)[:vocab]
        row -= r.frequency_penalty * counts.to(row.dtype) + r.presence_penalty * (counts > 0).to(row.dtype)


def token_logprobs(logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int]) -> list[TokenLogprob | None]:
    """For rows with `num_logprobs`: log-softmax(logits / temperature) at the chosen token, and the
    `num_logprobs` most likely tokens (descending). `logits` are the penalized ones. [N, V]"""
    out: list[TokenLogprob | None] = [None] * len(rows)
    idx = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    if not idx:
        return out
    temps = torch.tensor([rows[i].temperature if rows[i].temperature > 0 else 1.0 for i in idx]).unsqueeze(1)
    lps = torch.log_softmax(logits[idx].float() / temps, dim=-1)  # [n, V]
    k = max(rows[i].num_logprobs for i in idx)
    top_lps, top_ids = torch.topk(lps, k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
    chosen = lps.gather(1, torch.tensor([tokens[i] for i in idx]).unsqueeze(1)).squeeze(1).tolist()
    for j, i in enumerate(idx):
        num = rows[i].num_logprobs
        top = tuple(zip(top_ids[j, :num].tolist(), top_lps[j, :num].tolist()))
        out[i] = TokenLogprob(chosen[j], top)
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [N, V] float32 -> N token ids."""
    out = torch.argmax(logits, dim=-1).tolist()  # greedy for every row; sampled rows overwrite below
    idx = [i for i, r in enumerate(rows) if not r.greedy]
    if not idx:
        return out
    sub = logits[idx].float()
    temps = torch.tensor([rows[i].temperature for i in idx], dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(sub / temps, dim=-1)
    probs, order = torch.sort(probs, dim=-1, descending=True)  # [n, V]
    probs = _filter(probs, [rows[i] for i in idx])
    u = uniforms(np.array([rows[i].seed for i in idx], dtype=np.uint64),
                 np.array([rows[i].position for i in idx], dtype=np.uint64))
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = torch.from_numpy(u).unsqueeze(1) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)
    pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)  # never a filtered-out token
    chosen = torch.gather(order, 1, pick).squeeze(1).tolist()
    for i, token in zip(idx, chosen):
        out[i] = token
    return out


def _filter(sorted_probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Zero what top-k, top-p and min-p exclude; `sorted_probs` is descending per row. [n, V]."""
    n, vocab = sorted_probs.shape
    ranks = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows]).unsqueeze(1)
    keep = ranks < top_k
    # top_p >= 1 keeps every token: the float32 running mass can round up to 1.0 in the far tail, and a
    # filter at 1.0 would then cut tokens that the user asked to keep
    top_p = torch.tensor([r.top_p if r.top_p < 1.0 else 2.0 for r in rows], dtype=torch.float32).unsqueeze(1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep &= mass_before < top_p  # the smallest prefix whose mass reaches top_p
    min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float32).unsqueeze(1)
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    return sorted_probs * keep
