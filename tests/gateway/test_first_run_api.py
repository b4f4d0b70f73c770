"""What a new user meets in the first hour (issue 21), through real clients: the official openai client,
grpcio and raw HTTP, against a gateway on the in-process echo engine (it repeats the prompt's tokens
until max_tokens, so lengths are known in advance)."""

from __future__ import annotations

import grpc
import openai
import pytest

from grpc_helpers import generate, reassemble
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc


@pytest.fixture(scope="module")
def client(harness):
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def stub(harness):
    with grpc.insecure_channel(harness.grpc_addr) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def auth(harness):
    return (("authorization", f"Bearer {harness.api_key}"),)


# ---------------------------------------------------------------- item 2: bounded defaults


@pytest.mark.parametrize("stream", [False, True])
def test_completions_without_max_tokens_stop_at_16(client, harness, stream):
    if stream:
        chunks = list(client.completions.create(model=harness.model, prompt="hello world", stream=True,
                                                stream_options={"include_usage": True}))
        usage, finish = chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.completions.create(model=harness.model, prompt="hello world")
        usage, finish = r.usage, r.choices[0].finish_reason
    assert usage.completion_tokens == 16 and finish == "length"


@pytest.mark.parametrize("which", ["prompt", "messages", "prompt_token_ids"])
def test_grpc_generate_without_max_tokens_stops_at_16(stub, auth, harness, which):
    inputs = {"prompt": {"prompt": "hello world"},
              "messages": {"messages": pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello")])},
              "prompt_token_ids": {"prompt_token_ids": pb.TokenIds(ids=[70, 71, 72])}}
    replies = generate(stub, auth, model=harness.model, ignore_eos=True, **inputs[which])
    (choice,) = reassemble(replies)
    assert len(choice.token_ids) == 16 and choice.finish_reason == "length"
    assert replies[-1].usage.completion_tokens == 16


def test_grpc_default_is_capped_by_the_context(stub, auth, harness):
    ids = [70] * (harness.context_len - 3)
    (choice,) = reassemble(generate(stub, auth, model=harness.model, prompt_token_ids=pb.TokenIds(ids=ids)))
    assert len(choice.token_ids) == 3 and choice.finish_reason == "length"


# ---------------------------------------------------------------- item 3: GET /v1/models/{id}


def test_models_retrieve(client, harness):
    card = client.models.retrieve(harness.model)
    assert card.id == harness.model and card.object == "model" and card.owned_by == "blink"
    assert card.model_extra["max_model_len"] == harness.context_len
    assert card.model_dump() == next(m for m in client.models.list().data if m.id == harness.model).model_dump()


@pytest.mark.parametrize("model_id", ["gpt-9", "org/no-such-model"])
def test_models_retrieve_unknown_is_model_not_found(client, harness, model_id):
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve(model_id)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"] == "invalid_request_error"
    assert model_id in error["message"] and harness.model in error["message"]


def test_models_retrieve_needs_the_key(harness):
    status, body = harness.get(f"/v1/models/{harness.model}", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
