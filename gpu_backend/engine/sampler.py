"""Sampling with a counter-based RNG: the token at `position` of a request depends only on its logits,
its parameters, and (seed, position) -- never on the batch it ran in, nor on how often it was recomputed.

The uniform for (seed, position) is SplitMix64 of a mix of the two; the GPU kernel computes the same
function, so the same seed gives the same tokens in every engine mode (up to logit rounding).
The draw is an inverse-CDF over the filtered distribution in descending-probability order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


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
