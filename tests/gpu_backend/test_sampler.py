"""Sampling: greedy, filters, and a counter-based RNG that makes a seed reproducible whatever the batch."""
import numpy as np
import torch

from gpu_backend.engine.sampler import SamplingRow, await_masks, sample, uniforms


def row(seed=1, position=10, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0):
    return SamplingRow(temperature, top_p, top_k, min_p, seed, position)


def test_uniforms_are_deterministic_in_range_and_spread():
    seeds = np.arange(1000, dtype=np.uint64)
    u1 = uniforms(seeds, np.full(1000, 5, dtype=np.uint64))
    u2 = uniforms(seeds, np.full(1000, 5, dtype=np.uint64))
    assert np.array_equal(u1, u2)
    assert u1.min() >= 0 and u1.max() < 1
    assert abs(u1.mean() - 0.5) < 0.05
    assert not np.array_equal(u1, uniforms(seeds, np.full(1000, 6, dtype=np.uint64)))


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert sample(logits, [row(temperature=0.0)] * 3) == torch.argmax(logits, -1).tolist()


def test_same_seed_same_token_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    rows = [row(seed=s, position=p) for s, p in zip(range(8), range(20, 28))]
    together = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [rows[i]])[0] for i in range(8)]
    reversed_batch = sample(logits.flip(0), rows[::-1])[::-1]
    assert together == alone == reversed_batch


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform distribution
    tokens = {sample(logits, [row(seed=s)])[0] for s in range(50)}
    assert len(tokens) > 40


def test_top_k_top_p_min_p_exclude_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = lambda **kw: {sample(logits, [row(seed=s, **kw)])[0] for s in range(300)}
    assert seen() == {0, 1, 2, 3}
    assert seen(top_k=2) == {0, 1}
    assert seen(top_p=0.7) == {0, 1}
    assert seen(min_p=0.25) == {0, 1, 2}
    assert seen(top_p=0.01) == {0}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    counts = np.bincount([sample(logits, [row(seed=s)])[0] for s in range(3000)], minlength=3) / 3000
    assert np.allclose(counts, probs.numpy(), atol=0.03)


class _Seq:
    """A constrained request whose mask appears in the ring on the `arrives`-th read (None: never)."""

    def __init__(self, arrives: int | None):
        self.arrives, self.reads = arrives, 0

    def token_mask(self):
        self.reads += 1
        if self.arrives is not None and self.reads >= self.arrives:
            return np.full(4, 0xFFFFFFFF, dtype=np.uint32)
        return None


def _ready_after(polls: int):
    state = {"asked": 0}

    def ready() -> bool:
        state["asked"] += 1
        return state["asked"] > polls
    return ready, state


def test_await_masks_reads_late_masks_until_the_logits_are_done():
    plain = SamplingRow(1.0, 1.0, 0, 0.0, 1, 5)
    early = SamplingRow(1.0, 1.0, 0, 0.0, 2, 5, constrained=True, token_mask=np.ones(4, dtype=np.uint32))
    late, never = _Seq(arrives=3), _Seq(arrives=None)
    rows = [plain, early, SamplingRow(1.0, 1.0, 0, 0.0, 3, 5, constrained=True),
            SamplingRow(1.0, 1.0, 0, 0.0, 4, 5, constrained=True)]
    ready, state = _ready_after(polls=5)
    out = await_masks(rows, [None, None, late, never], ready, poll_s=0.0)
    assert out[0] is plain and out[1] is early              # rows with nothing to wait for are kept as they are
    assert out[2].token_mask is not None and late.reads == 3  # came on the third read, then not read again
    assert out[3].token_mask is None                        # never came: the row waits (TOKEN_WAIT)
    assert state["asked"] == 6 and never.reads == 6         # read on every poll and once after the logits were done
    assert rows[2].token_mask is None                       # the caller's list is not changed


def test_await_masks_reads_once_more_after_the_logits_are_done():
    rows = [SamplingRow(1.0, 1.0, 0, 0.0, 1, 5, constrained=True)]
    seq = _Seq(arrives=1)
    ready, state = _ready_after(polls=0)                   # the logits are already done at the first ask
    out = await_masks(rows, [seq], ready, poll_s=0.0)
    assert out[0].token_mask is not None and seq.reads == 1 and state["asked"] == 1
    ready, state = _ready_after(polls=0)
    assert await_masks([SamplingRow(1.0, 1.0, 0, 0.0, 1, 5)], [None], ready) and state["asked"] == 0
