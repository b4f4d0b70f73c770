"""Penalties, logit bias and logprobs (the sampler math the cpu and host engines share), against a plain
torch reference that works one token at a time."""
import dataclasses
import math
import random

import pytest
import torch

from gpu_backend.engine.sampler import (LogitAdjustments, PromptCache, SamplingRow, apply_penalties, sample,
                                       sample_step, sampling_row, token_logprobs)
from reference_scheduler import Sequence
from protocols.ring import RequestSpec

VOCAB = 64


def row(temperature=0.0, seed=7, **kw):
    return SamplingRow(temperature, 1.0, 0, 0.0, seed=seed, position=5, **kw)


def reference(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """vLLM's formulas, one token at a time: bias, repetition over prompt + output, frequency, presence."""
    out, vocab = logits.clone(), logits.shape[0]
    for t, b in r.logit_bias:
        if 0 <= t < vocab:
            out[t] += b
    for t in set(r.prompt_ids) | set(r.output_ids):
        if 0 <= t < vocab:
            out[t] = out[t] / r.repetition_penalty if out[t] > 0 else out[t] * r.repetition_penalty
    for t in set(r.output_ids):
        if 0 <= t < vocab:
            out[t] -= r.frequency_penalty * list(r.output_ids).count(t) + r.presence_penalty
    return out


@pytest.fixture
def logits():
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 3


@pytest.mark.parametrize("kw", [
    {"repetition_penalty": 1.7, "prompt_ids": (1, 2, 3, 3), "output_ids": (3, 9)},
    {"repetition_penalty": 0.5, "prompt_ids": (4,), "output_ids": (5, 5)},
    {"frequency_penalty": 0.75, "output_ids": (1, 1, 1, 2, 8)},
    {"presence_penalty": -1.5, "output_ids": (1, 1, 1, 2, 8), "prompt_ids": (30,)},
    {"logit_bias": ((3, 100.0), (4, -100.0), (5, 0.25))},
    {"logit_bias": ((3, 5.0),), "repetition_penalty": 2.0, "frequency_penalty": 2.0, "presence_penalty": 2.0,
     "prompt_ids": (3, 7), "output_ids": (3, 3, 11)},
])
def test_penalties_match_the_reference(logits, kw):
    rows = [row(**kw), row(), row(**kw), row()]
    got = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        assert torch.allclose(got[i], reference(logits[i], r), atol=1e-5), kw
    assert torch.equal(got[1], logits[1]) and not torch.equal(got[0], logits[0])


def test_rows_without_penalties_are_not_copied(logits):
    assert apply_penalties(logits, [row()] * 4) is logits


def test_logit_bias_bans_and_forces_tokens_even_greedy(logits):
    best = int(torch.argmax(logits[0]))
    tokens, _ = sample_step(logits[:1], [row(logit_bias=((best, -100.0),))])
    assert tokens[0] != best
    tokens, _ = sample_step(logits[:1], [row(logit_bias=((17, 100.0),))])
    assert tokens == [17]
    forced = [sample_step(logits[:1], [row(temperature=1.0, logit_bias=((17, 100.0),), seed=s)]) for s in range(20)]
    assert {t[0][0] for t in forced} == {17}


def test_frequency_penalty_steers_greedy_away_from_repeats():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2], logits[0, 9] = 5.0, 4.0
    assert sample_step(logits, [row()])[0] == [2]
    assert sample_step(logits, [row(frequency_penalty=0.6, output_ids=(2, 2))])[0] == [9]
    assert sample_step(logits, [row(presence_penalty=1.5, output_ids=(2,))])[0] == [9]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_are_the_log_softmax_after_penalties_and_temperature(logits, temperature):
    kw = {"frequency_penalty": 1.0, "output_ids": (1, 1, 2), "logit_bias": ((6, 3.0),)}
    rows = [row(temperature, num_logprobs=5, **kw), row(temperature), row(temperature, num_logprobs=0),
            row(temperature, num_logprobs=20, seed=11)]
    tokens, lps = sample_step(logits, rows)
    assert lps[1] is None
    for i in (0, 2, 3):
        ref = torch.log_softmax(reference(logits[i], rows[i]) / (temperature or 1.0), dim=-1)
        assert lps[i].logprob == pytest.approx(float(ref[tokens[i]]), abs=1e-5)
        top_lps, top_ids = torch.topk(ref, rows[i].num_logprobs)
        assert [t for t, _ in lps[i].top] == top_ids.tolist()
        assert [lp for _, lp in lps[i].top] == pytest.approx(top_lps.tolist(), abs=1e-5)
        assert lps[i].logprob <= 0 and all(lp <= 0 for _, lp in lps[i].top)
        assert [lp for _, lp in lps[i].top] == sorted((lp for _, lp in lps[i].top), reverse=True)
    assert len(lps[2].top) == 0 and len(lps[3].top) == 20
    if temperature == 0.0:  # greedy: the chosen token is the most likely one
        assert lps[0].top[0] == (tokens[0], pytest.approx(lps[0].logprob))


def test_logprobs_sum_to_one_over_the_vocabulary(logits):
    lps = token_logprobs(logits, [row(1.0, num_logprobs=VOCAB)], [0])
    assert math.fsum(math.exp(lp) for _, lp in lps[0].top) == pytest.approx(1.0, abs=1e-5)


def test_without_extensions_sample_step_is_sample(logits):
    rows = [row(temperature=t, seed=s) for t, s in ((0.0, 1), (1.0, 2), (0.5, 3), (1.5, 4))]
    tokens, lps = sample_step(logits, rows)
    assert tokens == sample(logits, rows) and lps == [None] * 4


def test_ids_outside_the_vocabulary_are_ignored(logits):
    r = row(logit_bias=((VOCAB + 5, 100.0),), repetition_penalty=2.0, prompt_ids=(VOCAB + 1,))
    assert torch.equal(apply_penalties(logits[:1], [r]), logits[:1])


def random_row(gen: random.Random) -> SamplingRow:
    """Each extension on or off at random; histories empty, repeated, or reaching outside the vocabulary."""
    def ids(n):
        return tuple(gen.choice([gen.randrange(VOCAB), gen.randrange(4), VOCAB + gen.randrange(3)])
                     for _ in range(gen.choice([0, 1, n])))
    pick = gen.random
    return SamplingRow(gen.choice([0.0, 0.7]), 1.0, 0, 0.0, seed=gen.randrange(99), position=3,
                       presence_penalty=gen.uniform(-2, 2) if pick() < 0.5 else 0.0,
                       frequency_penalty=gen.uniform(-2, 2) if pick() < 0.5 else 0.0,
                       repetition_penalty=gen.choice([1.0, 0.4, 1.3, 2.0]),
                       logit_bias=tuple((gen.randrange(VOCAB + 4), gen.choice([-100.0, 100.0, gen.uniform(-5, 5)]))
                                        for _ in range(gen.choice([0, 1, 4]))),
                       prompt_ids=ids(20), output_ids=ids(12))


@pytest.mark.parametrize("seed", range(8))
def test_vectorized_adjustments_match_the_per_token_reference_on_random_rows(seed):
    gen = random.Random(seed)
    rows = [random_row(gen) for _ in range(9)]
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4  # negatives too
    got = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        assert torch.allclose(got[i], reference(logits[i], r), atol=1e-5, rtol=1e-6), r
        if not r.adjusts_logits:
            assert torch.equal(got[i], logits[i])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_once_per_token():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.0]])
    r = SamplingRow(0.0, 1.0, 0, 0.0, 0, 0, repetition_penalty=2.0, prompt_ids=(0, 0, 1), output_ids=(1, 4, 0))
    assert apply_penalties(logits, [r]).tolist() == [[1.0, -4.0, 3.0, -1.0, 0.0]]


def test_logit_bias_entries_for_one_token_add_up_and_out_of_vocabulary_ones_are_dropped():
    logits = torch.zeros(1, 4)
    r = SamplingRow(0.0, 1.0, 0, 0.0, 0, 0, logit_bias=((1, 1.5), (1, 2.0), (4, 100.0), (2, -100.0)))
    assert apply_penalties(logits, [r]).tolist() == [[0.0, 3.5, -100.0, 0.0]]


def test_adjustments_of_neutral_rows_are_none_and_empty_parts_are_skipped():
    assert LogitAdjustments.build([row(), row(num_logprobs=3)], VOCAB, torch.device("cpu")) is None
    adj = LogitAdjustments.build([row(), row(frequency_penalty=1.0)], VOCAB, torch.device("cpu"))
    assert adj.rows.tolist() == [1] and adj.bias_at is adj.seen_at is adj.output_at is None


def test_token_logprobs_take_the_chosen_tokens_as_a_tensor_too(logits):
    rows = [row(0.5, num_logprobs=3), row(), row(1.0, num_logprobs=0)]
    tokens = [4, 9, 11]
    assert token_logprobs(logits[:3], rows, torch.tensor(tokens)) == token_logprobs(logits[:3], rows, tokens)


def test_sampling_row_copies_only_the_history_its_penalties_read():
    def seq(**kw):
        spec = RequestSpec(0, [5, 6, 7], 4, **kw)
        return Sequence(slot=0, seq=1, spec=spec, arrival=0, rng_seed=9, token_ids=[5, 6, 7, 8, 8], prompt_len=3)
    r = sampling_row(seq(num_logprobs=2))
    assert (r.prompt_ids, r.output_ids, r.position, r.seed, r.num_logprobs) == ((), (), 5, 9, 2)
    r = sampling_row(seq(frequency_penalty=0.5))
    assert (tuple(r.prompt_ids), tuple(r.output_ids)) == ((), (8, 8))
    r = sampling_row(seq(repetition_penalty=1.2))
    assert (tuple(r.prompt_ids), tuple(r.output_ids)) == ((5, 6, 7), (8, 8))


def test_prompt_cache_keeps_the_penalized_prompts_of_the_last_step_only():
    def seq(slot, **kw):
        spec = RequestSpec(slot, [5, 6, 7], 4, **kw)
        return Sequence(slot=slot, seq=slot + 10, spec=spec, arrival=0, rng_seed=1, token_ids=[5, 6, 7, 8],
                        prompt_len=3)
    cache = PromptCache()
    a, b, c = seq(0, repetition_penalty=1.5), seq(1, num_logprobs=1), seq(2, repetition_penalty=0.5)
    first = cache.rows([a, b, c])
    assert [tuple(r.prompt_ids) for r in first] == [(5, 6, 7), (), (5, 6, 7)]
    assert [dataclasses.replace(r, prompt_ids=tuple(r.prompt_ids)) for r in first] == \
        [dataclasses.replace(sampling_row(s), prompt_ids=tuple(sampling_row(s).prompt_ids)) for s in (a, b, c)]
    a.token_ids.append(9)
    second = cache.rows([a])
    assert second[0].prompt_ids is first[0].prompt_ids and tuple(second[0].output_ids) == (8, 9)
    assert cache.rows([c])[0].prompt_ids is not first[2].prompt_ids  # c left in between: converted again
