"""Grammars on the gateway (gateway/structured/grammar.py, mask_loop.py): the corpus compiles, masks follow
the ring's layout, a random model under every mask of the corpus produces valid output, bad constraints get
400s naming their field, and the mask loop runs off the event loop."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import numpy as np
import pytest

from gateway.errors import ApiError
from gateway.structured import grammar as G
from gateway.structured.constraint import Constraint
from gateway.structured.grammar import Grammars, allows, mask_words
from gateway.structured.mask_loop import MaskLoop
from tests.gateway.schemas.corpus import CHOICES, REGEXES, json_schemas
from tests.gateway.structured_helpers import RandomSampler, allowed_ids, generate

SCHEMAS = json_schemas()


@pytest.fixture(scope="module")
def eos_id(byte_tokenizer) -> int:
    return byte_tokenizer.token_to_id("<|im_end|>")


@pytest.fixture(scope="module")
def grammars(byte_tokenizer, eos_id) -> Grammars:
    return Grammars(byte_tokenizer, byte_tokenizer.get_vocab_size(), [eos_id])


def test_the_corpus_is_large_and_varied():
    text = json.dumps(SCHEMAS)
    assert len(SCHEMAS) >= 200 and len(REGEXES) >= 20 and len(CHOICES) >= 20
    for keyword in ('"$ref"', '"anyOf"', '"enum"', '"pattern"', '"format"', '"maxItems"', '"minimum"',
                    '"exclusiveMinimum"', '"additionalProperties"', '"const"'):
        assert keyword in text, keyword


def test_every_constraint_of_the_corpus_compiles(grammars):
    for i, schema in enumerate(SCHEMAS):
        grammars.compile_sync(Constraint.json_schema(schema, f"schema[{i}]"))
        G.check_sync(Constraint.json_schema(schema, f"schema[{i}]"))
    for regex in REGEXES:
        grammars.compile_sync(Constraint("regex", regex, "regex"))
    for choice in CHOICES:
        grammars.compile_sync(Constraint("choice", json.dumps(choice), "choice"))


def test_a_random_model_under_each_schema_writes_valid_json(grammars, byte_tokenizer, eos_id):
    sampler = RandomSampler(byte_tokenizer, eos_id, seed=1)
    for i, schema in enumerate(SCHEMAS):
        compiled = grammars.compile_sync(Constraint.json_schema(schema, "s"))
        text = byte_tokenizer.decode(generate(grammars, compiled, sampler))
        jsonschema.validate(json.loads(text), schema, format_checker=None)


def test_a_random_model_under_each_regex_and_choice_matches(grammars, byte_tokenizer, eos_id):
    sampler = RandomSampler(byte_tokenizer, eos_id, seed=2)
    for regex in REGEXES:
        compiled = grammars.compile_sync(Constraint("regex", regex, "r"))
        text = byte_tokenizer.decode(generate(grammars, compiled, sampler))
        assert re.fullmatch(regex, text), (regex, text)
    for choice in CHOICES:
        compiled = grammars.compile_sync(Constraint("choice", json.dumps(choice), "c"))
        assert byte_tokenizer.decode(generate(grammars, compiled, sampler)) in choice


def test_masks_use_the_rings_layout(grammars, byte_tokenizer, eos_id):
    compiled = grammars.compile_sync(Constraint("choice", json.dumps(["hello world"]), "c"))
    words = compiled.first_mask
    assert words.dtype == np.uint32 and len(words) == mask_words(byte_tokenizer.get_vocab_size())
    first = byte_tokenizer.encode("hello world").ids[0]
    assert allows(words, first) and not allows(words, eos_id)
    for token in allowed_ids(words, byte_tokenizer.get_vocab_size()):  # each allowed token is accepted
        matcher = compiled.new_matcher()
        assert matcher.consume_token(int(token))
        assert "hello world".startswith(byte_tokenizer.decode([int(token)]))


def test_a_finished_grammar_allows_only_eos(grammars, byte_tokenizer, eos_id):
    compiled = grammars.compile_sync(Constraint("choice", json.dumps(["yes"]), "c"))
    matcher = compiled.new_matcher()
    assert matcher.consume_tokens(byte_tokenizer.encode("yes").ids)
    words = grammars.mask_of(matcher)
    assert list(allowed_ids(words, byte_tokenizer.get_vocab_size())) == [eos_id]


def test_a_wider_ring_mask_pads_with_banned_tokens(byte_tokenizer, eos_id):
    wide = Grammars(byte_tokenizer, byte_tokenizer.get_vocab_size(), [eos_id], num_words=64)
    words = wide.compile_sync(Constraint("regex", "[a-z]+", "r")).first_mask
    assert len(words) == 64 and not words[mask_words(byte_tokenizer.get_vocab_size()):].any()


def test_the_slicer_settings_never_change_a_mask(grammars, byte_tokenizer, eos_id):
    """MASK_SLICES only skips trie walks: along random walks through bounded strings (every remaining length) and
    free text, each mask is the one llguidance computes with no slicer at all."""
    import llguidance
    assert grammars.ll_tokenizer is not None and G.MASK_SLICES[-1] == llguidance.LLTokenizer.general_slices()[-1]
    plain = Grammars(byte_tokenizer, byte_tokenizer.get_vocab_size(), [eos_id])
    plain._ll_tokenizer = llguidance.LLTokenizer(byte_tokenizer.to_str(), n_vocab=byte_tokenizer.get_vocab_size(),
                                                 eos_token=[eos_id], slices=[])
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 7},
                                               "b": {"type": "string", "minLength": 2, "maxLength": 33},
                                               "c": {"type": "array", "items": {"type": "string", "maxLength": 3}},
                                               "d": {"type": "string"}}, "required": ["a", "b", "c", "d"]}
    sampler, vocab = RandomSampler(byte_tokenizer, eos_id, seed=5), byte_tokenizer.get_vocab_size()
    checked = 0
    for walk in range(6):
        ours = grammars.compile_sync(Constraint.json_schema(schema, "s")).new_matcher()
        theirs = plain.compile_sync(Constraint.json_schema(schema, "s")).new_matcher()
        for step in range(200):
            words = grammars.mask_of(ours)
            assert np.array_equal(words, plain.mask_of(theirs)), (walk, step)
            checked += 1
            if ours.is_stopped():
                break
            token = sampler.sample(words, step)
            assert ours.consume_token(token) and theirs.consume_token(token)
    assert checked > 60


@pytest.mark.parametrize("constraint, says", [
    (Constraint.json_schema({"type": "bogus"}, "response_format.json_schema.schema"), "does not compile"),
    (Constraint.json_schema({"type": "object", "properties": {"a": {"type": 5}}}, "guided_json"), "does not compile"),
    (Constraint("regex", "a((", "structured_outputs.regex"), "does not compile"),
    (Constraint("grammar", "start: foo\nfoo: (", "guided_grammar"), ""),
])
def test_bad_constraints_are_400s_naming_the_field(grammars, constraint, says):
    with pytest.raises(ApiError) as info:
        grammars.compile_sync(constraint)
    assert info.value.status == 400 and info.value.detail.param == constraint.param and says in info.value.detail.message
    with pytest.raises(ApiError) as info:
        G.check_sync(constraint)
    assert info.value.detail.param == constraint.param


def test_compile_caches_and_limits_size(grammars):
    async def run():
        c = Constraint.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}}, "f")
        first = await grammars.compile(c)
        assert await grammars.compile(Constraint.json_schema(json.loads(c.text), "g")) is first
        huge = Constraint("regex", "a" * (G.MAX_GRAMMAR_BYTES + 1), "structured_outputs.regex")
        with pytest.raises(ApiError) as info:
            await grammars.compile(huge)
        assert info.value.detail.param == "structured_outputs.regex" and "limit" in info.value.detail.message
    asyncio.run(run())


def test_compile_time_limit_is_a_400(grammars, monkeypatch):
    monkeypatch.setattr(G, "COMPILE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(Grammars, "compile_sync", lambda self, c: __import__("time").sleep(0.5))
    async def run():
        with pytest.raises(ApiError) as info:
            await grammars.compile(Constraint("regex", "slow+", "guided_regex"))
        assert info.value.detail.param == "guided_regex" and "took over" in info.value.detail.message
    asyncio.run(run())


def test_the_mask_loop_delivers_each_next_mask_on_the_event_loop(grammars, byte_tokenizer):
    """Transports whose producer belongs to the event loop (tcp, rdma) get their masks there."""
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids

    async def run():
        loop, delivered, errors = asyncio.get_running_loop(), [], []
        def put(index, words):
            assert asyncio.get_running_loop() is loop  # the ring is written from the event loop only
            delivered.append((index, words))
        mask_loop = MaskLoop(grammars, compiled, put, errors.append)
        for n, token in enumerate(ids):
            mask_loop.advance([token])
            while len(delivered) < n + 1:
                await asyncio.sleep(0.001)
        assert [i for i, _ in delivered] == list(range(1, len(ids) + 1)) and not errors
        assert allows(delivered[0][1], ids[1])
        bad = MaskLoop(grammars, compiled, put, errors.append)
        bad.advance([byte_tokenizer.token_to_id("<|im_start|>")])
        while not errors:
            await asyncio.sleep(0.001)
        assert "outside the requested grammar" in errors[0]
        closed = MaskLoop(grammars, compiled, put, errors.append)
        closed.advance([ids[0]])
        closed.close()
        await asyncio.sleep(0.05)
        assert len(delivered) == len(ids)  # a closed loop delivers nothing
    asyncio.run(run())


def test_a_shm_mask_goes_into_the_ring_from_the_pool_thread_and_none_after_close(grammars, byte_tokenizer,
                                                                                  monkeypatch):
    """Where the transport allows it, the mask does not wait for the event loop; a request that ended gets none.
    With BLINK_MASK_STATS_S each step is counted in the worker's mask statistics."""
    import threading

    from gateway.structured import mask_loop as mask_loop_module
    stats = mask_loop_module.MaskStats(period_s=60.0)
    monkeypatch.setattr(mask_loop_module, "STATS", stats)
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids

    async def run():
        delivered, errors, threads = [], [], set()
        def put(index, words):
            threads.add(threading.current_thread().name)
            delivered.append((index, words))
        mask_loop = MaskLoop(grammars, compiled, put, errors.append, put_from_pool=True)
        for n, token in enumerate(ids):
            mask_loop.advance([token])
            while len(delivered) < n + 1:
                await asyncio.sleep(0.001)
        assert [i for i, _ in delivered] == list(range(1, len(ids) + 1)) and not errors
        assert all(name.startswith("grammar-mask") for name in threads)  # never the event loop's thread
        figures = stats.take()
        assert figures["steps"] == len(ids) and 0 < figures["computed_ms_mean"] <= figures["total_ms_max"]
        closed = MaskLoop(grammars, compiled, put, errors.append, put_from_pool=True)
        closed.close()
        closed.advance([ids[0]])
        await asyncio.sleep(0.05)
        assert len(delivered) == len(ids) and not errors
        failing = MaskLoop(grammars, compiled, lambda i, w: 1 / 0, errors.append, put_from_pool=True)
        failing.advance([ids[0]])
        while not errors:
            await asyncio.sleep(0.001)
        assert "could not be sent" in errors[0]
    asyncio.run(run())


def test_a_constrained_stream_never_goes_to_the_native_round():
    """The native round sends tokens without the poller seeing them: a constrained stream would get no masks."""
    from types import SimpleNamespace

    from gateway.streaming.native import NativeStreams
    from protocols.ring import RingGeometry

    native = NativeStreams(None, RingGeometry(num_slots=2), None)  # on: nothing says off
    handle = SimpleNamespace(native=None, abandoned=False, finished=False, mask_loop=object())
    asked = []
    assert native.go(handle, 0, True, b"", b"", None, 0, lambda: asked.append(1), lambda taken: None) is False
    assert not asked  # refused before the stream's state was even asked for


def test_the_grammar_threads_carry_their_names_to_the_os():
    """`blink bench` counts a gateway's CPU by OS thread name (/proc's comm): the mask pools' threads are named."""
    import queue
    import sys
    from pathlib import Path

    from gateway.structured.mask_loop import mask_pool

    if not sys.platform.startswith("linux"):
        pytest.skip("thread names through /proc are Linux's")
    for slow, name in ((False, "grammar-mask"), (True, "grammar-slow")):
        out = queue.SimpleQueue()
        mask_pool(slow).submit(lambda: out.put(Path("/proc/thread-self/comm").read_text().strip()))
        assert out.get(timeout=5) == name
