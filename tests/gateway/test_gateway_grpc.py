"""The gRPC inference API against the in-process echo engine, with a real grpc client over a socket.

The echo engine repeats the prompt's tokens, so every reply is known in advance (see test_gateway_http).
"""

from __future__ import annotations

import itertools
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from grpc_helpers import generate, rpc_error, trailing
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc

SERVICE = "blink.inference.v1.Inference"


@pytest.fixture(scope="module")
def channel(harness):
    with grpc.insecure_channel(harness.grpc_addr) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return inference_pb2_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def auth(harness):
    return (("authorization", f"Bearer {harness.api_key}"),)


def echo_ids(prompt_ids: list[int], n: int) -> list[int]:
    return list(itertools.islice(itertools.cycle(prompt_ids), n))


# ---------------------------------------------------------------- results equal the HTTP API's


def test_generate_text_prompt_matches_http(stub, auth, harness):
    replies = generate(stub, auth, model=harness.model, prompt="hello world", max_tokens=7)
    status, http = harness.post("/v1/completions", {"model": harness.model, "prompt": "hello world",
                                                    "max_tokens": 7})
    assert status == 200
    assert "".join(r.text for r in replies) == http["choices"][0]["text"]
    prompt_ids = harness.tokenizer.encode("hello world").ids
    assert [t for r in replies for t in r.token_ids] == echo_ids(prompt_ids, 7)
    assert len(replies) > 1 and all(not r.finish_reason for r in replies[:-1])
    last = replies[-1]
    assert last.finish_reason == "length" == http["choices"][0]["finish_reason"]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (http["usage"]["prompt_tokens"], http["usage"]["completion_tokens"], http["usage"]["total_tokens"])


def test_generate_chat_matches_http(stub, auth, harness):
    messages = [{"role": "user", "content": "hello"}]
    replies = generate(stub, auth, model=harness.model, messages=pb.ChatMessages(
        messages=[pb.ChatMessage(**m) for m in messages]))
    status, http = harness.post("/v1/chat/completions", {"model": harness.model, "messages": messages})
    assert status == 200
    assert "".join(r.text for r in replies) == http["choices"][0]["message"]["content"] == "user\nhello"
    assert replies[-1].finish_reason == "stop"
    assert replies[-1].usage.completion_tokens == http["usage"]["completion_tokens"]


def test_generate_token_ids_and_stop_string(stub, auth, harness):
    ids = harness.tokenizer.encode("stop here please END of the text").ids
    replies = generate(stub, auth, model=harness.model, prompt_token_ids=pb.TokenIds(ids=ids), stop=["END"],
                       max_tokens=20)
    assert "".join(r.text for r in replies) == "stop here please "
    assert replies[-1].finish_reason == "stop"
    # the token that completed the stop string is counted, as in the HTTP usage
    assert replies[-1].usage.completion_tokens == len([t for r in replies for t in r.token_ids])


def test_request_id_reaches_the_ring(stub, auth, harness):
    call = stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hello", max_tokens=2), metadata=auth,
                         timeout=10)
    replies = list(call)
    request_id = replies[0].request_id
    assert request_id > 0 and all(r.request_id == request_id for r in replies)
    assert dict(call.initial_metadata())["x-request-id"] == str(request_id)
    assert harness.call(lambda: harness.engine.request_ids[-1]) == request_id


def test_tokenize_matches_http(stub, auth, harness):
    reply = stub.Tokenize(pb.TokenizeRequest(model=harness.model, prompt="hello world"), metadata=auth, timeout=10)
    status, http = harness.post("/v1/tokenize", {"model": harness.model, "prompt": "hello world"})
    assert status == 200
    assert list(reply.tokens) == http["tokens"] == harness.tokenizer.encode("hello world").ids
    assert (reply.count, reply.max_model_len) == (http["count"], http["max_model_len"]) == (
        len(http["tokens"]), harness.context_len)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    reply = stub.Tokenize(pb.TokenizeRequest(model=harness.model, messages=chat, add_generation_prompt=False),
                          metadata=auth, timeout=10)
    _, http = harness.post("/v1/tokenize", {"model": harness.model, "add_generation_prompt": False,
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert list(reply.tokens) == http["tokens"]
    assert harness.tokenizer.decode(http["tokens"], skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


# ---------------------------------------------------------------- errors as status codes


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", "Basic x"),)])
def test_missing_or_wrong_key_is_unauthenticated(stub, harness, metadata):
    err = rpc_error(lambda: stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hi"),
                                          metadata=metadata, timeout=10))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    err = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(model=harness.model, prompt="hi"),
                                          metadata=metadata, timeout=10))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "hi", "temperature": 3.0}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "hi", "top_k": -5}, "top_k"),
    ({"prompt": "hi", "priority": 256}, "priority"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt_token_ids": pb.TokenIds(ids=[5, -1])}, "prompt_token_ids"),
    ({"prompt_token_ids": pb.TokenIds(ids=[10**6])}, "prompt_token_ids"),
    ({"messages": pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])}, "messages[0].role"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 200}, "n"),
    ({"prompt": "hi", "n": 5}, "n"),  # over the harness ring's 4 slots
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3.0}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": -1.0}, "repetition_penalty"),
    ({"prompt": "hi", "logit_bias": {5: 150.0}}, "logit_bias.5"),
    ({"prompt": "hi", "logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {2**31: 1.0}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {10**5: 1.0}}, "logit_bias"),  # outside the vocabulary
    ({"prompt": "hi", "logit_bias": {t: 1.0 for t in range(301)}}, "logit_bias"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt_token_ids": pb.TokenIds(ids=[5, 6]), "logprobs": 21}, "logprobs"),
    ({"messages": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")]), "logprobs": 21},
     "logprobs"),
])
def test_bad_params_are_invalid_argument_naming_the_field(stub, auth, harness, fields, param):
    err = rpc_error(lambda: generate(stub, auth, model=harness.model, **fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert trailing(err)["error-param"] == param
    assert f"'{param}'" in err.details() or param.split("[")[0] in err.details()


def test_bad_chat_logprobs_name_the_grpc_field(stub, auth, harness):
    """Chat carries the count as top_logprobs: the error still names `logprobs`, as sent."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])
    err = rpc_error(lambda: generate(stub, auth, model=harness.model, messages=chat, logprobs=-1))
    assert "top_logprobs" not in err.details() and "'logprobs'" in err.details()


def test_unknown_model_is_not_found(stub, auth, harness):
    err = rpc_error(lambda: generate(stub, auth, model="no-such-model", prompt="hi"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.details()
    assert trailing(err)["error-code"] == "model_not_found"
    err = rpc_error(lambda: stub.Tokenize(pb.TokenizeRequest(model="nope", prompt="x"), metadata=auth, timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_oversized_request_is_resource_exhausted(stub, auth, harness):
    err = rpc_error(lambda: generate(stub, auth, model=harness.model, prompt="x" * (100 * 1024)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_engine_error_mid_stream_is_internal(stub, auth, harness):
    error_id = harness.tokenizer.token_to_id("<|endoftext|>")
    call = stub.Generate(pb.GenerateRequest(model=harness.model, prompt_token_ids=pb.TokenIds(
        ids=[error_id, 3, 40, 41])), metadata=auth, timeout=10)
    replies = []
    with pytest.raises(grpc.RpcError) as info:
        replies.extend(call)
    # the engine fails after 3 tokens, which were streamed first
    assert [t for r in replies for t in r.token_ids] == [error_id, 3, 40]
    assert info.value.code() == grpc.StatusCode.INTERNAL and "engine" in info.value.details()
    harness.wait_idle()


def test_busy_slots_are_unavailable(stub, auth, harness):
    harness.call(setattr, harness.engine, "paused", True)
    try:
        calls = [stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hi", max_tokens=2),
                               metadata=auth, timeout=10) for _ in range(5)]
        time.sleep(3.0)  # slot_wait_s is 2 s in the harness: the fifth request gives up
        harness.call(setattr, harness.engine, "paused", False)
        codes = []
        for call in calls:
            try:
                list(call)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
    finally:
        harness.call(setattr, harness.engine, "paused", False)
    assert sorted(codes, key=str) == sorted([grpc.StatusCode.OK] * 4 + [grpc.StatusCode.UNAVAILABLE], key=str)
    harness.wait_idle()


# ---------------------------------------------------------------- cancellation, health, reflection


def test_cancel_mid_stream_frees_the_slot(stub, auth, harness):
    cancelled_before = harness.call(lambda: harness.engine.num_cancelled)
    harness.call(setattr, harness.engine, "step_s", 0.02)  # 200 tokens take seconds
    try:
        call = stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hello world", max_tokens=200),
                             metadata=auth, timeout=30)
        first = next(call)
        assert first.text and not first.finish_reason
        assert harness.call(lambda: harness.backend.num_in_flight) == 1
        call.cancel()
        harness.wait_idle()
        assert harness.call(lambda: harness.engine.num_cancelled) == cancelled_before + 1
    finally:
        harness.call(setattr, harness.engine, "step_s", 0.001)
    replies = generate(stub, auth, model=harness.model, prompt="hello", max_tokens=3)
    assert replies[-1].finish_reason == "length" and replies[-1].usage.completion_tokens == 3


def test_health_is_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def _health_until(channel, status, timeout_s: float = 5.0) -> int:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        got = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
        if got == status or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_health_follows_the_backends(channel, harness):
    """A stalled backend (heartbeat stuck) turns the service NOT_SERVING until it moves again."""
    harness.call(setattr, harness.backend, "stalled", True)
    try:
        assert _health_until(channel, health_pb2.HealthCheckResponse.NOT_SERVING) == \
            health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        harness.call(setattr, harness.backend, "stalled", False)
    assert _health_until(channel, health_pb2.HealthCheckResponse.SERVING) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    services = db.get_services()
    assert SERVICE in services and "grpc.health.v1.Health" in services
    generate_method = db.FindFileContainingSymbol(SERVICE)
    names = {m.name for s in generate_method.service for m in s.method}
    assert {"Generate", "Tokenize"} <= names


def test_a_taken_grpc_port_fails_the_start(harness):
    """Without SO_REUSEPORT a second gateway cannot share the port silently."""
    import asyncio

    from gateway.api.grpc_api import GrpcServer
    from gateway.backends.route import Router
    from gateway.state import GatewayState

    port = int(harness.grpc_addr.rsplit(":", 1)[1])  # the harness gateway holds it

    async def start_second():
        server = GrpcServer(GatewayState(config=harness.server.config, router=Router([]), tokenizers={}))
        try:
            await server.start("127.0.0.1", port)
        finally:
            await server.close(0)
    with pytest.raises(OSError, match="gRPC"):
        asyncio.run(start_second())
