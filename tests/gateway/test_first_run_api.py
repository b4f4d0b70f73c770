"""What a new user meets in the first hour (issue 21), through real clients: the official openai client,
grpcio and raw HTTP, against a gateway on the in-process echo engine (it repeats the prompt's tokens
until max_tokens, so lengths are known in advance)."""

from __future__ import annotations

import logging
import subprocess
import time

import grpc
import openai
import pytest

from grpc_helpers import generate, reassemble
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc
from tests.conftest import ROOT


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


# ---------------------------------------------------------------- item 5: refuse what is not honoured


def _chat(client, harness, **kw):
    messages = kw.pop("messages", [{"role": "user", "content": "hello"}])
    return client.chat.completions.create(model=harness.model, messages=messages, max_tokens=3, **kw)


def _refused(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]
    return error


@pytest.mark.parametrize("kind, param", [("json_object", "response_format"),
                                         ("json_schema", "response_format.json_schema.schema")])
def test_structured_outputs_on_a_backend_without_masks_are_refused_clearly(client, harness, kind, param):
    schema = {"json_schema": {"name": "x", "schema": {"type": "object"}}} if kind == "json_schema" else {}
    fmt = {"type": kind, **schema}
    error = _refused(lambda: _chat(client, harness, response_format=fmt), param)
    assert "does not support structured output" in error["message"]
    _refused(lambda: client.completions.create(model=harness.model, prompt="hi", max_tokens=3,
                                               extra_body={"response_format": fmt}), param)


def test_a_bogus_response_format_is_refused(client, harness):
    error = _refused(lambda: _chat(client, harness, response_format={"type": "bogus"}), "response_format.type")
    assert "bogus" in error["message"] and "json_schema" in error["message"]


def test_response_format_text_is_honoured(client, harness):
    r = _chat(client, harness, response_format={"type": "text"})
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("kw, param", [
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"min_tokens": 4}}, "min_tokens"),
    ({"extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice"),
    ({"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_fields_that_would_change_the_output_are_refused(client, harness, kw, param):
    _refused(lambda: _chat(client, harness, **kw), param)


def test_assistant_tool_calls_in_the_history_are_taken(client, harness):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert _chat(client, harness, messages=messages).choices[0].finish_reason in ("stop", "length")
    messages[2].pop("tool_call_id")
    _refused(lambda: _chat(client, harness, messages=messages), "messages[2].tool_call_id")


def test_completion_fields_that_would_change_the_output_are_refused(client, harness):
    _refused(lambda: client.completions.create(model=harness.model, prompt="hi", max_tokens=3,
                                               extra_body={"add_special_tokens": False}), "add_special_tokens")


def test_fields_that_change_nothing_pass(client, harness):
    r = _chat(client, harness, tool_choice="none", parallel_tool_calls=False, store=False, metadata={"a": "b"},
              service_tier="auto", extra_body={"skip_special_tokens": True, "some_future_field": 1})
    assert r.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- item 8: error messages


def test_a_tools_refusal_does_not_echo_the_tools(client, harness):
    tools = [{"type": "function", "function": {"name": "lookup_secret_weather", "description": "x" * 500,
                                                "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}}]
    error = _refused(lambda: _chat(client, harness, tools=tools), "tools[0].function.parameters")
    assert "x" * 50 not in error["message"] and len(error["message"]) < 400


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "images are not supported"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio is not supported"),
])
def test_media_content_parts_say_what_is_not_supported(client, harness, part, says):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    error = _refused(lambda: _chat(client, harness, messages=messages), "messages[0].content[1]")
    assert says in error["message"] and "valid string" not in error["message"]


def test_the_request_log_says_no_token_instead_of_ttft_none(harness, caplog):
    from tests.gateway.conftest import ERROR_TOKEN
    error_id = harness.tokenizer.token_to_id(ERROR_TOKEN)
    with caplog.at_level(logging.INFO, logger="blink.gateway.requests"):
        status, _ = harness.post("/v1/completions", {"model": harness.model, "prompt": [error_id, 0], "max_tokens": 4})
        assert status >= 500
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if "finish" in r.getMessage()] and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if "finish" in r.getMessage()]
    assert lines and all("None" not in line for line in lines) and "no token" in lines[-1]


@pytest.mark.parametrize("method, path", [("GET", "/v1/nope"), ("POST", "/v1/chat/complete"), ("GET", "/admin/nope")])
def test_an_unknown_route_is_404_with_or_without_a_key(harness, method, path):
    for key in (None, "default"):
        status, body = harness.get(path, key=key) if method == "GET" else harness.post(path, {}, key=key)
        assert status == 404 and body["error"]["code"] == "not_found" and path in body["error"]["message"]


def test_a_known_route_without_a_key_is_still_401(harness):
    status, body = harness.get("/v1/models", key=None)
    assert status == 401


def _reflect(channel, package: str, request) -> list:
    from grpc_reflection.v1alpha import reflection_pb2 as rpb  # v1 has the same messages, field for field
    call = channel.stream_stream(f"/{package}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=rpb.ServerReflectionResponse.FromString)
    return list(call(iter([request]), timeout=10))


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
def test_grpc_reflection_v1_and_v1alpha(harness, package):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as rpb
    with grpc.insecure_channel(harness.grpc_addr) as channel:
        (listing,) = _reflect(channel, package, rpb.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listing.list_services_response.service}
        assert {"blink.inference.v1.Inference", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        for symbol, method in (("blink.inference.v1.Inference", "Generate"),
                               ("grpc.reflection.v1.ServerReflection", "ServerReflectionInfo")):
            (reply,) = _reflect(channel, package, rpb.ServerReflectionRequest(file_containing_symbol=symbol))
            files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                     for b in reply.file_descriptor_response.file_descriptor_proto]
            assert method in {m.name for f in files for s in f.service for m in s.method}


def test_first_setup_says_what_pip_installs(tmp_path):
    """`make serve` on a fresh clone: a line before each install step (pip itself runs with -q)."""
    dry = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path}/venv"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    lines = dry.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if "-m pip install" in line or "-m blink.cli model demo" in line]
    assert len(installs) == 4
    for i in installs:
        assert lines[i - 1].startswith("echo ") and "blink set-up" in lines[i - 1], lines[i - 1]
    assert "torch" in lines[installs[1] - 1] and "dependencies" in lines[installs[2] - 1]


# ---------------------------------------------------------------- item 4: batch prompts on /v1/completions

PROMPTS = ["hello world", "the quick brown fox", "stop here please"]


def _alone(client, harness, prompt, **kw):
    r = client.completions.create(model=harness.model, prompt=prompt, max_tokens=5, **kw)
    return r.choices[0].text, r.usage


def test_a_batch_of_text_prompts_gives_n_choices_each_indexed_as_openai(client, harness):
    r = client.completions.create(model=harness.model, prompt=PROMPTS[:2], max_tokens=5, n=2, seed=7)
    assert [c.index for c in r.choices] == list(range(4))  # the harness's ring has 4 slots
    alone = [_alone(client, harness, p, seed=7) for p in PROMPTS[:2]]
    for c in r.choices:
        assert c.text == alone[c.index // 2][0]  # index = prompt_i * n + j
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for _, u in alone)
    assert r.usage.completion_tokens == 4 * 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_streamed_batch_of_token_id_prompts(client, harness):
    prompts = [harness.tokenizer.encode(p).ids for p in PROMPTS[:2]]
    chunks = list(client.completions.create(model=harness.model, prompt=prompts, max_tokens=4, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and finishes == {i: "length" for i in range(4)}
    for index, text in texts.items():
        ids = prompts[index // 2]
        assert text == harness.tokenizer.decode([ids[k % len(ids)] for k in range(4)])
    usage = chunks[-1].usage
    assert usage.prompt_tokens == sum(map(len, prompts)) and usage.completion_tokens == 16


def test_a_batch_echoes_each_choice_its_own_prompt(client, harness):
    r = client.completions.create(model=harness.model, prompt=PROMPTS[:2], max_tokens=2, echo=True)
    assert [c.text[:len(p)] for c, p in zip(r.choices, PROMPTS)] == PROMPTS[:2]


@pytest.mark.parametrize("prompt, n, param", [
    (["a", "", "b"], 1, "prompt[1]"),
    (["a", "zq" * 200], 1, "prompt[1]"),  # over the context
    (["a", "b", "c"], 2, "prompt"),  # 6 choices, 4 ring slots
    ([[5, 6], [10**6]], 1, "prompt[1]"),
])
def test_a_bad_batch_names_the_prompt(client, harness, prompt, n, param):
    _refused(lambda: client.completions.create(model=harness.model, prompt=prompt, max_tokens=2, n=n), param)


def test_a_batch_of_one_is_a_batch(client, harness):
    r = client.completions.create(model=harness.model, prompt=["hello world"], max_tokens=3)
    alone, _ = _alone(client, harness, "hello world")
    assert len(r.choices) == 1 and alone.startswith(r.choices[0].text)
