"""Prefix caching in the `cpu` engine (EngineLoop + CpuRunner + the native scheduler over a real ring):

- caching on and off give the same greedy tokens, and both equal an independent eager generator's;
- a request admitted on cached blocks prefills only the rest: the runner computes exactly cached_tokens fewer
  tokens, and cached_tokens is a multiple of the block size;
- cancelling a request whose blocks another one shares leaves the other intact;
- a KV pool too small to keep every prefix evicts cached blocks (least recently used) and stays correct;
- every block is back (free or evictable) and unreferenced at the end.
"""
from __future__ import annotations

import itertools

import pytest

from test_engine_loop import CONTEXT_LEN, Engine, _prompts, model  # noqa: F401 (model: the module fixture)
from gpu_backend.models import greedy_generate
from protocols.prefix_hash import block_hashes
from protocols.ring import FinishReason, RequestSpec

BLOCK = 4
_done = itertools.count()


@pytest.fixture
def engine(model):
    made = []

    def make(**kw) -> Engine:
        made.append(Engine(model, block_size=BLOCK, **kw))
        counted = made[-1]
        run = counted.runner.run
        counted.computed = 0

        def counting_run(step):  # tokens the model computed
            counted.computed += step.num_tokens
            return run(step)
        counted.runner.run = counting_run
        return counted
    yield make
    for e in made:
        e.close()


def spec(i: int, prompt: list[int], max_tokens: int = 8) -> RequestSpec:
    return RequestSpec(i, prompt, max_tokens, temperature=0.0, ignore_eos=True,
                       block_hashes=tuple(block_hashes(prompt, BLOCK, "test-model")))


def shared_prompts(vocab: int, n: int, system_len: int = 30, seed: int = 7) -> list[list[int]]:
    system = _prompts(1, vocab, seed=seed)[0] * 3
    return [system[:system_len] + tail for tail in _prompts(n, vocab, seed=seed + 1)]


def assert_no_block_held(e: Engine) -> None:
    s = e.loop.scheduler
    assert s.num_available == e.runner.num_blocks and not s.a["block_ref"].any() and not e.loop.live


def run_waves(e: Engine, waves: list[list[list[int]]], max_tokens: int = 8) -> list[list[list[int]]]:
    """Each wave submitted after the one before finished (so that its prompt blocks are published)."""
    out, i = [], 0
    for wave in waves:
        slots = []
        for p in wave:
            slots.append(e.submit(spec(i, p, max_tokens)))
            i += 1
        e.run_until_done()
        out.append([e.tokens[s] for s in slots])
        for s in slots:  # the ring's slots are few: a later wave reuses them; results stay in submission order
            e.prod.release(s)
            key = ("done", next(_done))
            e.tokens[key], e.finishes[key], e.cached[key] = e.tokens.pop(s), e.finishes.pop(s), e.cached.pop(s, 0)
    return out


def test_caching_on_and_off_give_the_same_greedy_tokens_and_skip_what_they_report(model, engine):
    cfg, m = model
    prompts = shared_prompts(cfg.vocab_size, 5)
    waves = [prompts[:1], prompts[1:3], prompts[3:] + prompts[:1]]  # the last repeats a whole prompt
    on, off = engine(), engine(caching=False)
    got_on, got_off = run_waves(on, waves), run_waves(off, waves)
    want = greedy_generate(m, [p for w in waves for p in w], 8, block_size=BLOCK)
    assert got_on == got_off and [t for w in got_on for t in w] == want
    cached = list(on.cached.values())
    assert all(c % BLOCK == 0 for c in cached) and sum(cached) >= 4 * 28  # 7 blocks of the system prompt, 4 hits
    assert not any(off.cached.values()) and off.loop.scheduler.prefix_cache_stats() == (0, 0, 0)
    assert off.computed - on.computed == sum(cached)  # exactly the reported tokens were not computed
    num_cached, queries, hits = on.loop.scheduler.prefix_cache_stats()
    assert hits == sum(cached) and queries == sum(len(p) for w in waves for p in w) and num_cached > 0
    assert on.prod.engine_stats()["prefix_cache_hits"] == hits  # the ring header carries the counters
    assert_no_block_held(on)
    assert_no_block_held(off)


def test_a_fully_cached_prompt_still_computes_its_last_block(model, engine):
    cfg, m = model
    prompt = _prompts(1, cfg.vocab_size, seed=11)[0][:3] * 4  # 12 tokens: 3 full blocks
    e = engine()
    [[first], [again]] = run_waves(e, [[prompt], [prompt]])
    assert first == again == greedy_generate(m, [prompt], 8, block_size=BLOCK)[0]
    assert list(e.cached.values()) == [0, 8]  # the last block is recomputed: a token is always computed


def test_cancelling_a_request_whose_blocks_are_shared_leaves_the_other_intact(model, engine):
    cfg, m = model
    a_prompt, b_prompt = shared_prompts(cfg.vocab_size, 2, seed=21)
    want_b = greedy_generate(m, [b_prompt], 30, block_size=BLOCK)[0]
    e = engine()
    a = e.submit(spec(0, a_prompt, 1000))
    for _ in range(20):  # A's prompt is computed and published, A decodes
        e.loop.step()
        e.poll()
    b = e.submit(spec(1, b_prompt, 30))
    shared = e.loop.scheduler.a["block_ref"]
    e.run_until_done(on_step=lambda i: i == 3 and e.prod.cancel(a))
    assert e.cached[b] >= 28 and (shared == 0).all()
    assert e.finishes[a] is FinishReason.CANCELLED and e.tokens[b] == want_b
    assert_no_block_held(e)


def test_eviction_under_memory_pressure_keeps_the_tokens(model, engine):
    cfg, m = model
    prompts = shared_prompts(cfg.vocab_size, 3, seed=31) + _prompts(6, cfg.vocab_size, seed=32)
    waves = [[p] for p in prompts] + [[prompts[0]], [prompts[1]]]
    e = engine(num_blocks=24)  # 96 tokens: the earlier prompts' blocks must make room for the later ones
    seen_evictable = []
    orig = e.loop.scheduler.update

    def watch(tokens):
        out = orig(tokens)
        seen_evictable.append(len(e.loop.scheduler.evictable()))
        return out
    e.loop.scheduler.update = watch
    got = run_waves(e, waves)
    want = greedy_generate(m, [w[0] for w in waves], 8, block_size=BLOCK)
    assert [w[0] for w in got] == want
    s = e.loop.scheduler
    published = sum(len(p) // BLOCK for p in prompts)
    assert published > s.num_blocks and s.prefix_cache_stats()[0] < published  # hashes were evicted
    assert max(seen_evictable) > 0
    assert_no_block_held(e)


def test_the_next_turn_finds_its_own_answer(model, engine):
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: the blocks turn 1 filled while
    decoding were published under the gateway's chain, so turn 2 skips past the prompt into the answer."""
    cfg, m = model
    turn1 = (_prompts(2, cfg.vocab_size, seed=41)[0] * 10)[:10]  # 2 full blocks and a part
    on, off = engine(), engine(caching=False)
    [[answer]] = run_waves(on, [[turn1]], max_tokens=20)
    turn2 = turn1 + answer + _prompts(1, cfg.vocab_size, seed=42)[0][:5]
    [[reply]] = run_waves(on, [[turn2]])
    assert [reply] == run_waves(off, [[turn2]])[0] == greedy_generate(m, [turn2], 8, block_size=BLOCK)
    # turn 1 computed its prompt and all but its last token: 29 tokens, 7 full blocks
    assert list(on.cached.values()) == [0, 7 * BLOCK]
    assert_no_block_held(on)
