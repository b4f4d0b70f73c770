"""Sampling with a counter-based RNG: the token at `position` of a request depends only on its logits,
its parameters, and (seed, position) -- never on the batch it ran in, nor on how often it was recomputed.

The uniform for (seed, position) is SplitMix64 of a mix of the two; the GPU kernel computes the same
function, so the same seed gives the same tokens in every engine mode (up to logit rounding).
The draw is an inverse-CDF over the filtered distribution in descending-probability order.

The sampling extensions, one definition for the `cpu` and `host` engines (the persistent loop applies the
same float32 operations in its own kernel, kernels/csrc/include/blink_loop_ext.cuh): logit bias, then repetition, frequency and presence penalties (vLLM's order and formulas;
`LogitAdjustments`, vectorized over rows, on the logits' device), and logprobs (`token_logprobs`, on the
logits' device too). Logprobs are the log-softmax of the logits after bias, penalties and temperature
(temperature 1 for greedy rows), before top-k/top-p/min-p filtering: vLLM's "processed_logprobs" mode.
Token masks (structured output, `apply_masks`): a constrained row's disallowed tokens go to -inf after bias
and penalties, before temperature, top-k/top-p/min-p or greedy; a row whose mask has not come samples no
token (TOKEN_WAIT: the scheduler runs its position again), one whose mask allows nothing ends (TOKEN_MASK_EMPTY).
`sample` is the CPU engine's draw; the GPU runner draws with `kernels/sampling.py`, which matches it.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kernels.sched_layout import TOKEN_MASK_EMPTY, TOKEN_WAIT
from protocols.ring import RequestSpec, TokenLogprob

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


class SampledSeq(Protocol):
    """A sequence whose next token a step samples: what the sampler reads of it."""

    slot: int
    seq: int  # the ring submission number
    spec: RequestSpec
    rng_seed: int  # sampling is keyed by (rng_seed, position)
    prompt_len: int

    @property
    def token_ids(self) -> Sequence[int]:
        """Prompt + generated so far (a list or an int array)."""

    def token_mask(self) -> np.ndarray | None:
        """A constrained request's (spec.token_mask set) mask for the token sampled now: [mask_words] uint32,
        or None while it has not come. Not called for other requests."""


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
    constrained: bool = False  # sampled under `token_mask`; with none (it has not come) the row waits
    token_mask: np.ndarray | None = None  # [mask_words] uint32: bit t % 32 of word t // 32 = token t allowed

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def sampling_row(seq: SampledSeq, prompt_ids: np.ndarray | None = None) -> SamplingRow:
    """The sampling parameters of `seq`'s next token (position = its index in prompt + output), with only
    the history its penalties read: the prompt for repetition (`prompt_ids` when given, a copy of it), the
    output for any penalty."""
    spec, ids, prompt_len = seq.spec, seq.token_ids, seq.prompt_len
    repetition = spec.repetition_penalty != 1.0
    penalized = repetition or spec.presence_penalty or spec.frequency_penalty
    if repetition and prompt_ids is None:
        prompt_ids = ids[:prompt_len]
    constrained = spec.token_mask is not None
    return SamplingRow(spec.temperature, spec.top_p, spec.top_k, spec.min_p, seq.rng_seed, len(ids),
                       spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty, spec.logit_bias,
                       prompt_ids=prompt_ids if repetition else (),
                       output_ids=ids[prompt_len:] if penalized else (), num_logprobs=spec.num_logprobs,
                       constrained=constrained, token_mask=seq.token_mask() if constrained else None)


class PromptCache:
    """Sampling rows for a step's sampled sequences, with the prompts of the repetition-penalized ones kept
    as int64 arrays from one step to the next: the prompt is most of that penalty's history and never
    changes, so a step converts only the output so far. Holds the last step's sequences only."""

    def __init__(self) -> None:
        self._arrays: dict[tuple[int, int], np.ndarray] = {}  # (slot, ring submission number) -> prompt ids

    def rows(self, seqs: Sequence[SampledSeq]) -> list[SamplingRow]:
        kept: dict[tuple[int, int], np.ndarray] = {}
        for seq in seqs:
            if seq.spec.repetition_penalty != 1.0:
                key = (seq.slot, seq.seq)
                cached = self._arrays.get(key)
                kept[key] = cached if cached is not None else _int64(seq.token_ids[:seq.prompt_len])
        self._arrays = kept
        return [sampling_row(seq, kept.get((seq.slot, seq.seq))) for seq in seqs]


MASK_POLL_S = 20e-6  # how often `await_masks` reads the ring again while the step's logits are computed


def await_masks(rows: list[SamplingRow], seqs: Sequence[SampledSeq], logits_ready: Callable[[], bool],
                poll_s: float = MASK_POLL_S) -> list[SamplingRow]:
    """`rows` (of `seqs`, in order) with the token masks that come while the GPU computes the step's logits.

    The host engine builds a step's rows as soon as its forward is launched, and the gateway writes the mask
    of token t + 1 only after it has seen token t, published just before: read then, a constrained row's mask
    is nearly never there and the row waits a whole step (TOKEN_WAIT), every other step (constrained TPOT was
    2.1x plain on an H100). So a row without its mask is read again every `poll_s` until `logits_ready()`,
    and once more after it (the latest chance); one still without a mask waits, as before."""
    missing = [i for i, r in enumerate(rows) if r.constrained and r.token_mask is None]
    rows = list(rows)
    while missing:
        done = logits_ready()  # asked before the reads: the reads after a True are the last chance
        still = []
        for i in missing:
            mask = seqs[i].token_mask()
            if mask is None:
                still.append(i)
            else:
                rows[i] = dataclasses.replace(rows[i], token_mask=mask)
        missing = still
        if done:
            break
        time.sleep(poll_s)
    return rows


def sample_step(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, V] float32 -> N token ids (TOKEN_WAIT / TOKEN_MASK_EMPTY for a constrained row whose mask
    has not come / allows nothing) and, for rows that ask, their logprobs."""
    logits = apply_penalties(logits, rows)
    logits, no_token = apply_masks(logits, rows)
    tokens = sample(logits, rows)
    for i, outcome in no_token.items():
        tokens[i] = outcome
    return tokens, token_logprobs(logits, rows, tokens)


def apply_masks(logits: torch.Tensor, rows: list[SamplingRow],
                inplace: bool = False) -> tuple[torch.Tensor, dict[int, int]]:
    """The constrained rows' token masks applied (disallowed tokens, and any past the mask's words, to -inf),
    after bias and penalties and before temperature and the filters, on a copy of `logits` [N, V] (`logits`
    itself with `inplace`, or when no row is constrained). Also {row: TOKEN_WAIT or TOKEN_MASK_EMPTY} for
    the rows that sample no token: whatever is drawn for them is replaced. One host-to-device copy, of the
    packed words (a GPU's logits: 16 KB a row at 128k tokens, not the 128 KB of its bools), unpacked there; which
    masks allow nothing is read from the packed words on the host (no wait for the device)."""
    no_token = {i: TOKEN_WAIT for i, r in enumerate(rows) if r.constrained and r.token_mask is None}
    masked = [i for i, r in enumerate(rows) if r.token_mask is not None and r.constrained]
    if not masked:
        return logits, no_token
    words = np.stack([rows[i].token_mask for i in masked])
    some = mask_allows_some(words, logits.shape[1])  # a mask whose tokens are all past the vocabulary: nothing
    no_token.update((i, TOKEN_MASK_EMPTY) for i, ok in zip(masked, some) if not ok)
    if not some.any():
        return logits, no_token
    picked = [i for i, ok in zip(masked, some) if ok]
    allowed = mask_bits(words[some], logits.shape[1], logits.device)
    idx = torch.tensor(picked, device=logits.device)
    if not inplace:
        logits = logits.clone()
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits, no_token


def mask_bits(words: np.ndarray, vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[n, mask_words] uint32 -> [n, vocab] bool on `device` (default the CPU), token t allowed when bit t % 32 of
    word t // 32 is set (a token past the words is not allowed). For a GPU the words travel packed and are
    unpacked there (VM, 64 rows of 128,256 tokens: numpy's unpacking took 3.4 ms of the host a step and made 8.2 MB
    to copy; now 0.1 ms and 1 MB); on the CPU numpy unpacks (torch's shifts took 43 ms there)."""
    words = np.ascontiguousarray(words, dtype="<u4")
    if device is None or torch.device(device).type == "cpu":
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        if bits.shape[1] < vocab:
            bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
        return torch.from_numpy(bits[:, :vocab].astype(bool))
    return unpack_mask_words(torch.from_numpy(words.view(np.int32)).to(device), vocab)


def unpack_mask_words(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, mask_words] int32 (the uint32 words' bits) -> [n, vocab] bool, where `packed` is (`mask_bits` on a GPU)."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(packed.shape[0], -1)  # an int32's bit 31 too
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return bits[:, :vocab]


def mask_allows_some(words: np.ndarray, vocab: int) -> np.ndarray:
    """[n, mask_words] uint32 -> [n] bool: whether each mask allows a token of the vocabulary's `vocab`."""
    words = np.ascontiguousarray(words, dtype="<u4")
    full, rest = divmod(vocab, 32)
    some = (words[:, :full] != 0).any(axis=1)
    if rest and words.shape[1] > full:
        some |= (words[:, full] & np.uint32((1 << rest) - 1)) != 0
    return some


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`LogitAdjustments` of `rows` applied to a copy of `logits` [N, V]; `logits` itself when no row asks."""
    adjustments = LogitAdjustments.build(rows, logits.shape[1], logits.device)
    return logits if adjustments is None else adjustments.apply_(logits.clone())


IndexPairs = tuple[torch.Tensor, torch.Tensor]  # ([m] row among the adjusted ones, [m] token id), int64


@dataclass(frozen=True)
class LogitAdjustments:
    """Logit bias, then the repetition penalty over prompt + output (positive logits divided by it, negative
    ones multiplied), then frequency (times the token's count in the output) and presence (once if it occurs)
    subtracted: for the rows that have any, vectorized. Built once per step from the rows' histories into
    flat (row, token id) index tensors on the logits' device (two host-to-device copies); no loop over the
    vocabulary. Ids outside the vocabulary are dropped (the gateway checked them against the tokenizer's)."""

    rows: torch.Tensor             # [n] int64: the adjusted rows of the logits
    bias_at: IndexPairs | None     # one pair per logit_bias entry
    bias: torch.Tensor             # [b] float32
    seen_at: IndexPairs | None     # prompt + output ids of the rows with a repetition penalty (repeats harmless)
    repetition: torch.Tensor       # [n, 1] float32
    output_at: IndexPairs | None   # output ids of the rows with frequency/presence penalties, repeats kept
    frequency: torch.Tensor        # [n, 1] float32
    presence: torch.Tensor         # [n, 1] float32

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab: int, device: torch.device) -> LogitAdjustments | None:
        """None when no row adjusts its logits."""
        picked = [(i, r) for i, r in enumerate(rows) if r.adjusts_logits]
        if not picked:
            return None
        bias = [(j, t, b) for j, (_, r) in enumerate(picked) for t, b in r.logit_bias if 0 <= t < vocab]
        bias_rows, bias_ids, bias_vals = (np.array(c) for c in zip(*bias)) if bias else ([], [], [])
        seen = _index_pairs([(r.prompt_ids, r.output_ids) if r.repetition_penalty != 1.0 else ()
                             for _, r in picked], vocab)
        output = _index_pairs([(r.output_ids,) if r.frequency_penalty or r.presence_penalty else ()
                               for _, r in picked], vocab)
        ints = _upload([[i for i, _ in picked], bias_rows, bias_ids, *seen, *output], np.int64, device)
        floats = _upload([bias_vals, *([getattr(r, name) for _, r in picked] for name in
                                       ("repetition_penalty", "frequency_penalty", "presence_penalty"))],
                         np.float32, device)
        pairs = [tuple(ints[k:k + 2]) if ints[k].numel() else None for k in (1, 3, 5)]
        return cls(ints[0], pairs[0], floats[0], pairs[1], floats[1].unsqueeze(1), pairs[2],
                   floats[2].unsqueeze(1), floats[3].unsqueeze(1))

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on `logits` [N, V] float32 (a copy of the adjusted rows is worked on); returns it."""
        sub = logits[self.rows]                                                # [n, V]
        if self.bias_at is not None:
            sub.index_put_(self.bias_at, self.bias, accumulate=True)
        if self.seen_at is not None:
            seen = torch.zeros_like(sub, dtype=torch.bool)
            seen[self.seen_at] = True
            penalized = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
            sub = torch.where(seen, penalized, sub)
        if self.output_at is not None:
            counts = torch.zeros_like(sub)
            counts.index_put_(self.output_at, torch.ones_like(self.output_at[0], dtype=sub.dtype), accumulate=True)
            sub -= self.frequency * counts + self.presence * (counts > 0).to(sub.dtype)
        logits[self.rows] = sub
        return logits


def _index_pairs(histories: list[tuple[Sequence[int], ...]], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, token id) for every in-vocabulary id of each row's histories: two [m] int64 arrays."""
    parts = [_int64(ids) for h in histories for ids in h]
    rows = np.repeat(np.arange(len(histories)), [sum(len(ids) for ids in h) for h in histories])
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    keep = (ids >= 0) & (ids < vocab)
    return rows[keep], ids[keep]


def _int64(ids: Sequence[int]) -> np.ndarray:
    """An int64 array of `ids` (an int64 array passes through; other arrays are converted, a copy)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False)
    return np.fromiter(ids, dtype=np.int64, count=len(ids))


def _upload(parts: list, dtype: type, device: torch.device) -> list[torch.Tensor]:
    """1-D sequences as views of one tensor on `device`, filled by one host-to-device copy."""
    arrays = [np.asarray(p, dtype=dtype) for p in parts]
    flat = torch.from_numpy(np.concatenate(arrays)).to(device)
    return list(flat.split([len(a) for a in arrays]))


def token_logprobs(logits: torch.Tensor, rows: list[SamplingRow],
                   tokens: list[int] | torch.Tensor) -> list[TokenLogprob | None]:
    """For rows with `num_logprobs`: log-softmax(logits / temperature) at the chosen token, and the
    `num_logprobs` most likely tokens (descending). `logits` [N, V] float32 are the adjusted ones, on any
    device; `tokens` [N] the chosen ids (a list, or an int64 tensor on that device). One copy to the host."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    idx = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    if not idx:
        return out
    dev = logits.device
    sel = torch.tensor(idx, device=dev)
    temps = torch.tensor([rows[i].temperature if rows[i].temperature > 0 else 1.0 for i in idx], device=dev)
    lps = torch.log_softmax(logits[sel].float() / temps.unsqueeze(1), dim=-1)  # [n, V]
    chosen = lps.gather(1, torch.as_tensor(tokens, device=dev)[sel].unsqueeze(1))  # [n, 1]
    k = max(rows[i].num_logprobs for i in idx)
    top_lps, top_ids = top_logprobs(lps, k) if k else (lps[:, :0], lps[:, :0].long())  # [n, k]
    # float64 carries the ids exactly, so one copy brings everything back
    host = torch.cat([chosen.double(), top_lps.double(), top_ids.double()], dim=1).cpu().tolist()
    for j, i in enumerate(idx):
        num = rows[i].num_logprobs
        row = host[j]
        out[i] = TokenLogprob(row[0], tuple(zip(map(int, row[1 + k: 1 + k + num]), row[1: 1 + num])))
    return out


def top_logprobs(lps: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `lps` [n, V] and their ids ([n, k] each, descending), equal values in
    ascending id order: so the first j of a top-k are the top-j whatever k is (the persistent loop computes
    20 for every row and publishes each row's own count; topk alone orders ties as its sort happens to)."""
    vals, ids = torch.topk(lps, k, dim=-1)
    ids, by_id = torch.sort(ids, dim=-1)
    vals, by_val = torch.sort(vals.gather(1, by_id), dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, by_val)


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
