"""gRPC's n choices, and the engine-side sampling fields on their way to the ring or to a refusal, against
the echo engine (real shm ring, real grpc client). Their effect on a real model: test_grpc_conformance."""

from __future__ import annotations

import itertools

import grpc
import pytest

from gateway.config import GatewayConfig
from grpc_helpers import generate, reassemble, rpc_error, trailing
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc

OLD_RESPONSE_FIELDS = {"text", "token_ids", "finish_reason", "usage", "request_id"}  # before n and logprobs
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])


def open_stub(harness):
    channel = grpc.insecure_channel(harness.grpc_addr)
    return channel, inference_pb2_grpc.InferenceStub(channel), (("authorization", f"Bearer {harness.api_key}"),)


@pytest.fixture(scope="module")
def echo(harness):
    channel, stub, auth = open_stub(harness)
    with channel:
        yield stub, auth


def start_mode(start_harness, pick_free_port, engine_mode: str, sampling_extensions: bool = True):
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({"k"}),
                           slot_wait_s=2.0)
    return start_harness(config, "k", engine_mode=engine_mode, sampling_extensions=sampling_extensions)


@pytest.fixture(scope="module")
def persistent_mode(start_harness, pick_free_port):
    """A backend that announces the 'persistent' (GPU loop) engine mode started without the sampling extensions:
    no penalties, logit_bias or logprobs."""
    return start_mode(start_harness, pick_free_port, "persistent", sampling_extensions=False)


@pytest.fixture(scope="module", params=["cpu", "host"])
def cpu_mode(request, start_harness, pick_free_port):
    """The echo engine announcing an engine mode with the sampling extensions (cpu, host), so that
    engine-side fields reach its ring."""
    return start_mode(start_harness, pick_free_port, request.param)


# ---------------------------------------------------------------- n


def test_n_choices_reassemble_with_usage_once_at_the_end(echo, harness):
    stub, auth = echo
    before = len(harness.engine.specs)
    replies = generate(stub, auth, model=harness.model, prompt="hello world", max_tokens=5, n=3, seed=41)
    specs = harness.engine.specs[before:]
    choices = reassemble(replies)
    prompt_ids = harness.tokenizer.encode("hello world").ids
    status, http = harness.post("/v1/completions", {"model": harness.model, "prompt": "hello world",
                                                    "max_tokens": 5})
    assert status == 200
    assert len(choices) == 3
    for choice in choices:
        assert choice.text == http["choices"][0]["text"] and choice.finish_reason == "length"
        assert choice.token_ids == list(itertools.islice(itertools.cycle(prompt_ids), 5))
    assert sum(bool(r.finish_reason) for r in replies) == 3  # one finish message per choice
    assert [r.HasField("usage") for r in replies] == [False] * (len(replies) - 1) + [True]
    usage = replies[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (len(prompt_ids), 15, len(prompt_ids) + 15)
    assert len({r.request_id for r in replies}) == 1
    assert sorted(s.seed for s in specs) == [41, 42, 43] and len({s.request_id for s in specs}) == 1
    harness.wait_idle()


def test_n_choices_interleave_when_they_run_together(echo, harness):
    """The choices run at once (the echo engine steps them together), so their messages interleave."""
    stub, auth = echo
    ids = harness.tokenizer.encode("the quick brown fox jumps over the lazy dog").ids
    harness.call(setattr, harness.engine, "step_s", 0.02)  # a token per choice per 20 ms: read one by one
    try:
        replies = generate(stub, auth, model=harness.model, prompt_token_ids=pb.TokenIds(ids=ids), max_tokens=12,
                           n=2)
    finally:
        harness.call(setattr, harness.engine, "step_s", 0.001)
    order = [r.choice_index for r in replies]
    assert order != sorted(order), order
    assert [c.token_ids for c in reassemble(replies)] == [ids[:12]] * 2
    harness.wait_idle()


def test_one_choice_sends_only_the_fields_old_clients_know(echo, harness):
    stub, auth = echo
    replies = generate(stub, auth, model=harness.model, prompt="hello world", max_tokens=6)
    assert len(replies) > 1
    for reply in replies:
        assert {f.name for f, _ in reply.ListFields()} <= OLD_RESPONSE_FIELDS
    assert [bool(r.finish_reason) for r in replies] == [False] * (len(replies) - 1) + [True]
    assert replies[-1].HasField("usage") and not any(r.HasField("usage") for r in replies[:-1])
    harness.wait_idle()


def test_a_failing_choice_fails_the_call_and_frees_every_slot(echo, harness):
    stub, auth = echo
    ids = [harness.tokenizer.token_to_id("<|endoftext|>"), 4, *harness.tokenizer.encode("hello world").ids]
    err = rpc_error(lambda: generate(stub, auth, model=harness.model, prompt_token_ids=pb.TokenIds(ids=ids), n=3))
    assert err.code() == grpc.StatusCode.INTERNAL and "engine" in err.details()
    harness.wait_idle()


def test_cancelling_cancels_every_choice(echo, harness):
    stub, auth = echo
    cancelled = harness.call(lambda: harness.engine.num_cancelled)
    harness.call(setattr, harness.engine, "step_s", 0.05)
    try:
        call = stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hello world", max_tokens=200, n=3,
                                                ignore_eos=True), metadata=auth, timeout=30)
        next(call)
        call.cancel()
        harness.wait_idle()
    finally:
        harness.call(setattr, harness.engine, "step_s", 0.001)
    assert harness.call(lambda: harness.engine.num_cancelled) - cancelled == 3


# ---------------------------------------------------------------- engine-side fields


def test_engine_fields_reach_the_ring(cpu_mode):
    channel, stub, auth = open_stub(cpu_mode)
    before = len(cpu_mode.engine.specs)
    with channel:
        replies = generate(stub, auth, model=cpu_mode.model, messages=CHAT, max_tokens=4, n=2, seed=7,
                           presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.25,
                           logit_bias={5: 3.0, 7: -100.0}, logprobs=3)
    specs = cpu_mode.engine.specs[before:]
    assert len(specs) == 2 and sorted(s.seed for s in specs) == [7, 8]
    for spec in specs:
        assert (spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (0.5, -1.5, 1.25)
        assert sorted(spec.logit_bias) == [(5, 3.0), (7, -100.0)] and spec.num_logprobs == 3
    for choice in reassemble(replies):
        # one entry per token, the chosen one first, `logprobs` alternatives (the echo engine's are zeros)
        assert [e.chosen.token_id for e in choice.logprobs] == choice.token_ids and len(choice.token_ids) == 4
        assert all(len(e.top) == 3 for e in choice.logprobs)
        assert b"".join(e.chosen.token_bytes for e in choice.logprobs).decode() == \
            cpu_mode.tokenizer.decode(choice.token_ids, skip_special_tokens=False)
        assert [e.chosen.token for e in choice.logprobs] == [e.chosen.token_bytes.decode() for e in choice.logprobs]
    cpu_mode.wait_idle()


def test_logprobs_zero_and_unset(cpu_mode):
    channel, stub, auth = open_stub(cpu_mode)
    with channel:
        zero = generate(stub, auth, model=cpu_mode.model, prompt="hello", max_tokens=3, logprobs=0)
        unset = generate(stub, auth, model=cpu_mode.model, prompt="hello", max_tokens=3)
    assert cpu_mode.engine.specs[-2].num_logprobs == 0 and cpu_mode.engine.specs[-1].num_logprobs is None
    assert sum(len(r.logprobs) for r in zero) == 3 and all(not e.top for r in zero for e in r.logprobs)
    assert all(not r.logprobs for r in unset)
    cpu_mode.wait_idle()


def test_default_values_are_not_engine_fields(persistent_mode):
    """Zero penalties, a repetition penalty of 1 and an empty bias are the defaults: every mode serves them."""
    channel, stub, auth = open_stub(persistent_mode)
    with channel:
        replies = generate(stub, auth, model=persistent_mode.model, prompt="hello", max_tokens=2, n=2,
                           presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={})
    assert [c.finish_reason for c in reassemble(replies)] == ["length", "length"]
    last = persistent_mode.engine.specs[-1]
    assert last.num_logprobs is None and last.repetition_penalty == 1.0
    persistent_mode.wait_idle()


ENGINE_FIELDS = [
    ("presence_penalty", {"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": -0.5}, {"frequency_penalty": -0.5}),
    ("repetition_penalty", {"repetition_penalty": 1.25}, {"repetition_penalty": 1.25}),
    ("logit_bias", {"logit_bias": {5: 3.0}}, {"logit_bias": {"5": 3.0}}),
    ("logprobs", {"logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),
]


@pytest.mark.parametrize("param, fields, http_fields", ENGINE_FIELDS, ids=[p for p, _, _ in ENGINE_FIELDS])
def test_the_persistent_mode_refuses_engine_fields_as_http_does(persistent_mode, param, fields, http_fields):
    channel, stub, auth = open_stub(persistent_mode)
    with channel:
        for prompt in ({"messages": CHAT}, {"prompt": "hi"}):
            err = rpc_error(lambda: generate(stub, auth, model=persistent_mode.model, **prompt, **fields))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert trailing(err)["error-param"] == param
            assert "'persistent' backends run without the sampling extensions" in err.details()
    status, body = persistent_mode.post("/v1/chat/completions", {"model": persistent_mode.model, **http_fields,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and err.details() == body["error"]["message"]
    assert persistent_mode.call(lambda: persistent_mode.backend.num_in_flight) == 0
