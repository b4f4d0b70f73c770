"""The sampling extensions in the `host` engine (GpuRunner's LOGITS graphs; run on the device machine,
skipped elsewhere):

- penalties, logit bias and logprobs give the tokens and logprobs of the sampler's math (the cpu engine's
  functions, on the CPU) applied to the same logits, the tokens drawn by the same GPU sampler kernel (the
  CPU's sampler may order tied bf16 logits differently), with graphs and eagerly;
- in a step mixing rows with and without extensions, the plain rows (and a seeded row that only asks for
  logprobs) get the tokens of a step without extensions;
- logit_bias +100 forces a token, -100 bans one;
- through the engine loop and a real ring, a request with logprobs gets one entry per token;
- sizing the KV cache from free memory sets memory aside for the extensions' eager part.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

from test_gpu_runner import _drive, _peaky_model, _runner  # noqa: E402
from gpu_backend.engine.graph_variant import GraphVariant  # noqa: E402
from gpu_backend.engine.sampler import apply_penalties, sampling_row, token_logprobs  # noqa: E402
from reference_scheduler import Batch, ScheduledSeq, Sequence, step_of  # noqa: E402
from protocols.ring import FinishReason, RequestSpec  # noqa: E402

VOCAB = 512
PLAIN = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=(), num_logprobs=None)


def _host_runner(**kw):
    cfg, model = _peaky_model()  # a fresh model each time: a runner takes over its model's weights
    return cfg, _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg, max_num_batched_tokens=64, **kw)


@pytest.fixture(scope="module", params=["graphs", "eager"])
def runner(request):
    return _host_runner(use_graphs=request.param == "graphs")[1]


_submissions = itertools.count(1)


def _batch(specs: list[RequestSpec], seed: int = 0) -> Batch:
    """Each spec as a whole-prompt prefill whose last row samples, with a made-up output history. Each
    sequence is a new submission (the runner keeps prompts by (slot, submission), as the ring numbers them)."""
    gen = random.Random(seed)
    entries = []
    for i, spec in enumerate(specs):
        output = [gen.choice([7, 7, 8, gen.randrange(3, VOCAB)]) for _ in range(3)]
        ids = list(spec.prompt_ids) + output
        seq = Sequence(slot=i, seq=next(_submissions), spec=spec, arrival=i, rng_seed=spec.seed or 0, token_ids=ids,
                       prompt_len=len(spec.prompt_ids), block_table=[i])
        entries.append(ScheduledSeq(seq, len(ids), True))
    return Batch(entries)


def _run(runner, batch: Batch) -> list[int]:
    """The runner's step over a hand-built batch, its step buffer filled by the reference fill."""
    return runner.run(step_of(runner, batch))


def _specs(seed: int = 0) -> list[RequestSpec]:
    gen = random.Random(seed)

    def prompt():
        return [gen.randrange(3, VOCAB) for _ in range(5)] + [7, 9]
    return [RequestSpec(0, prompt(), 8, temperature=0.0),
            RequestSpec(1, prompt(), 8, temperature=0.9, seed=11, num_logprobs=5),
            RequestSpec(2, prompt(), 8, temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7,
                        presence_penalty=0.4, num_logprobs=20),
            RequestSpec(3, prompt(), 8, temperature=1.2, top_k=40, seed=5, repetition_penalty=0.6,
                        logit_bias=((9, 4.0), (VOCAB + 3, 50.0))),
            RequestSpec(4, prompt(), 8, temperature=0.7, top_p=0.9, seed=23, presence_penalty=-1.5,
                        logit_bias=((7, -3.0),), num_logprobs=0),
            RequestSpec(5, prompt(), 8, temperature=1.0, seed=3)]


def _assert_logprobs_close(got, want, atol=2e-4):
    assert (got is None) == (want is None)
    if want is None:
        return
    assert got.logprob == pytest.approx(want.logprob, abs=atol)
    assert len(got.top) == len(want.top)
    for (gid, glp), (wid, wlp) in zip(got.top, want.top):
        assert glp == pytest.approx(wlp, abs=atol)   # ids may differ only between tied logprobs
        assert gid == wid or abs(glp - wlp) <= atol


@pytest.mark.parametrize("seed", [0, 1])
def test_extensions_match_the_sampler_math_on_the_same_logits(runner, seed):
    batch = _batch(_specs(seed), seed)
    from kernels import sampling

    logits = runner.sampled_logits(step_of(runner, batch)).cpu()
    rows = [sampling_row(e.seq) for e in batch.entries]
    adjusted = apply_penalties(logits, rows)  # the sampler's math, on the CPU

    def column(name, dtype):
        return torch.tensor([getattr(r, name) for r in rows], dtype=dtype, device="cuda")
    want_tokens = sampling.sample(adjusted.cuda(), column("temperature", torch.float32), column("top_k", torch.int32),
                                  column("top_p", torch.float32), column("min_p", torch.float32),
                                  column("seed", torch.int64), column("position", torch.int64)).tolist()
    want_lps = token_logprobs(adjusted, rows, want_tokens)
    tokens = _run(runner, batch)
    assert tokens == want_tokens
    assert len(runner.last_logprobs) == len(tokens)
    for got, want in zip(runner.last_logprobs, want_lps):
        _assert_logprobs_close(got, want)


def test_each_bucket_has_a_logits_graph_beside_its_two_sampling_graphs(runner):
    if runner.config.use_graphs:
        assert set(runner.graphs) == {(b, g) for b in runner.buckets
                                      for g in (GraphVariant.SAMPLE, GraphVariant.GREEDY, GraphVariant.LOGITS)}
        print(f"\n{len(runner.graphs)} graphs captured in {runner.capture_s:.2f} s")


def test_plain_rows_get_the_tokens_of_a_step_without_extensions(runner):
    specs = _specs(2)
    mixed = _run(runner, _batch(specs, 2))
    assert runner.last_logprobs[0] is None and runner.last_logprobs[1] is not None
    plain = _run(runner, _batch([dataclasses.replace(s, **PLAIN) for s in specs], 2))
    assert runner.last_logprobs == []
    # rows 0 and 5 have no extensions; row 1 (seeded, sampled) only asks for logprobs
    assert [mixed[i] for i in (0, 1, 5)] == [plain[i] for i in (0, 1, 5)]


def test_logit_bias_forces_and_bans_tokens(runner):
    specs = [RequestSpec(i, [3 + i, 40, 41, 42], 4, temperature=t, seed=i, logit_bias=((17, 100.0),))
             for i, t in enumerate((0.0, 1.0, 1.5))]
    assert _run(runner, _batch(specs)) == [17, 17, 17]
    free = _run(runner, _batch([dataclasses.replace(s, **PLAIN) for s in specs[:1]]))[0]
    banned = _run(runner, _batch([dataclasses.replace(specs[0], logit_bias=((free, -100.0),))]))[0]
    assert banned != free


def test_logprobs_reach_the_ring_through_the_engine_loop(runner):
    prompt = [5, 6, 7, 8, 9, 10]
    specs = [RequestSpec(0, prompt, 10, temperature=0.0, ignore_eos=True, num_logprobs=3),
             RequestSpec(1, prompt, 10, temperature=0.8, seed=4, ignore_eos=True, num_logprobs=0,
                         frequency_penalty=1.0),
             RequestSpec(2, prompt, 10, temperature=0.0, ignore_eos=True)]
    tokens, finishes, loop = _drive(runner, runner.cfg, specs)
    assert finishes == [FinishReason.LENGTH] * 3 and all(len(t) == 10 for t in tokens)
    greedy, sampled, plain = loop.final_logprobs
    assert len(greedy) == len(sampled) == 10 and plain == []
    for token, entry in zip(tokens[0], greedy):
        assert len(entry.top) == 3 and entry.top[0] == (token, pytest.approx(entry.logprob))
        assert entry.logprob <= 0
    assert all(entry.top == () and entry.logprob <= 0 for entry in sampled)
    assert tokens[0] == tokens[2]  # logprobs leave greedy decoding as it is


def test_kv_sizing_sets_memory_aside_for_the_extensions():
    blocks = {}
    for extensions in (False, True):
        _, runner = _host_runner(num_kv_blocks=0, gpu_memory_fraction=0.2, use_graphs=False,
                                   sampling_extensions=extensions)
        blocks[extensions] = runner.num_blocks
        if extensions:
            spec = RequestSpec(0, [5, 6, 7], 4, temperature=0.0, repetition_penalty=1.3, num_logprobs=20)
            assert len(_run(runner, _batch([spec]))) == 1 and len(runner.last_logprobs[0].top) == 20
        del runner
        torch.cuda.empty_cache()
    print(f"\nKV blocks at 20% of the GPU: {blocks[False]} without the extensions, {blocks[True]} with them")
    assert 0 < blocks[True] <= blocks[False]
