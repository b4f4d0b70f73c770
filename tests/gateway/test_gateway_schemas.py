"""OpenAI request schemas: what is accepted, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from protocols.openai import ChatCompletionRequest, CompletionRequest, InvalidRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def parse(cls, body: dict | bytes):
    return parse_request(cls, body if isinstance(body, bytes) else json.dumps(body).encode())


def test_minimal_requests_and_defaults():
    chat = parse(ChatCompletionRequest, CHAT)
    assert chat.requested_max_tokens is None and chat.temperature is None and not chat.stream
    assert chat.messages[0].text() == "hi" and chat.stop_strings == []
    comp = parse(CompletionRequest, COMP)
    assert comp.prompt_text_or_ids == "hi"


def test_unknown_fields_are_ignored():
    req = parse(ChatCompletionRequest, {**CHAT, "some_future_field": {"x": 1}, "store": True})
    assert req.model == "m"


def test_prompt_forms():
    assert parse(CompletionRequest, {**COMP, "prompt": [1, 2, 3]}).prompt_text_or_ids == [1, 2, 3]
    assert parse(CompletionRequest, {**COMP, "prompt": ["one"]}).prompt_text_or_ids == "one"
    assert parse(CompletionRequest, {**COMP, "prompt": [[4, 5]]}).prompt_text_or_ids == [4, 5]
    batch = parse(CompletionRequest, {**COMP, "prompt": ["one", "two"]})
    assert batch.prompts == ["one", "two"] and batch.is_batch
    assert parse(CompletionRequest, {**COMP, "prompt": [[4, 5], [6]]}).prompts == [[4, 5], [6]]
    assert not parse(CompletionRequest, {**COMP, "prompt": [4, 5]}).is_batch


def test_content_parts_and_max_completion_tokens():
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}],
            "max_tokens": 5, "max_completion_tokens": 7, "stop": "x",
            "stream": True, "stream_options": {"include_usage": True}}
    req = parse(ChatCompletionRequest, body)
    assert req.messages[0].text() == "ab"
    assert req.requested_max_tokens == 7
    assert req.stop_strings == ["x"] and req.include_usage


@pytest.mark.parametrize("cls,patch,param", [
    (ChatCompletionRequest, {"temperature": "hot"}, "temperature"),
    (ChatCompletionRequest, {"temperature": 3.5}, "temperature"),
    (ChatCompletionRequest, {"max_tokens": 0}, "max_tokens"),
    (ChatCompletionRequest, {"max_tokens": -5}, "max_tokens"),
    (ChatCompletionRequest, {"max_tokens": "10"}, "max_tokens"),
    (ChatCompletionRequest, {"max_tokens": 1.5}, "max_tokens"),
    (ChatCompletionRequest, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (ChatCompletionRequest, {"top_p": 0}, "top_p"),
    (ChatCompletionRequest, {"top_k": -2}, "top_k"),
    (ChatCompletionRequest, {"seed": "abc"}, "seed"),
    (ChatCompletionRequest, {"stream": "yes"}, "stream"),
    (ChatCompletionRequest, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (ChatCompletionRequest, {"stop": 7}, "stop"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
    (ChatCompletionRequest, {"messages": "hi"}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (ChatCompletionRequest, {"model": 3}, "model"),
    (ChatCompletionRequest, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (ChatCompletionRequest, {"n": 0}, "n"),
    (ChatCompletionRequest, {"n": 129}, "n"),
    (ChatCompletionRequest, {"n": 1.5}, "n"),
    (ChatCompletionRequest, {"logprobs": 1}, "logprobs"),
    (ChatCompletionRequest, {"top_logprobs": 3}, "top_logprobs"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (ChatCompletionRequest, {"frequency_penalty": 2.5}, "frequency_penalty"),
    (ChatCompletionRequest, {"presence_penalty": -2.01}, "presence_penalty"),
    (ChatCompletionRequest, {"presence_penalty": "1"}, "presence_penalty"),
    (ChatCompletionRequest, {"repetition_penalty": 0}, "repetition_penalty"),
    (ChatCompletionRequest, {"repetition_penalty": -1.0}, "repetition_penalty"),
    (ChatCompletionRequest, {"logit_bias": {"5": 101}}, "logit_bias.5"),
    (ChatCompletionRequest, {"logit_bias": {"5": "1"}}, "logit_bias.5"),
    (ChatCompletionRequest, {"logit_bias": {"hello": 1}}, "logit_bias"),
    (ChatCompletionRequest, {"logit_bias": {"-3": 1}}, "logit_bias"),
    (ChatCompletionRequest, {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    (ChatCompletionRequest, {"logit_bias": [1, 2]}, "logit_bias"),
    (CompletionRequest, {"prompt": ""}, "prompt"),
    (CompletionRequest, {"prompt": ["a", ""]}, "prompt[1]"),
    (CompletionRequest, {"prompt": [1, -2]}, "prompt"),
    (CompletionRequest, {"prompt": []}, "prompt"),
    (CompletionRequest, {"prompt": 12}, "prompt"),
    (CompletionRequest, {"echo": "yes"}, "echo"),
    (CompletionRequest, {"echo": True, "logprobs": 1}, "echo"),
    (CompletionRequest, {"logprobs": 6}, "logprobs"),
    (CompletionRequest, {"logprobs": True}, "logprobs"),
    (CompletionRequest, {"best_of": 2}, "best_of"),
])
def test_bad_values_name_the_field(cls, patch, param):
    base = CHAT if cls is ChatCompletionRequest else COMP
    with pytest.raises(InvalidRequest) as exc:
        parse(cls, {**base, **patch})
    assert exc.value.param == param
    assert param.split(".")[0].split("[")[0] in exc.value.message


def test_engine_sampling_params_are_listed_only_when_not_default():
    assert parse(ChatCompletionRequest, {**CHAT, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                         "logit_bias": {}, "logprobs": False}).engine_sampling_params() == []
    req = parse(ChatCompletionRequest, {**CHAT, "frequency_penalty": 0.5, "logit_bias": {"7": -1, "07": 2},
                                        "logprobs": True, "top_logprobs": 0})
    assert req.engine_sampling_params() == ["frequency_penalty", "logit_bias", "logprobs"]
    assert req.num_logprobs == 0 and req.logit_bias_ids == [(7, -1.0), (7, 2.0)]
    comp = parse(CompletionRequest, {**COMP, "logprobs": 0, "n": 3, "echo": True, "logprobs": None})
    assert comp.num_logprobs is None and comp.n == 3 and comp.engine_sampling_params() == []


def test_missing_required_fields():
    with pytest.raises(InvalidRequest) as exc:
        parse(ChatCompletionRequest, {"messages": CHAT["messages"]})
    assert exc.value.param == "model" and "required" in exc.value.message
    with pytest.raises(InvalidRequest) as exc:
        parse(CompletionRequest, {"model": "m"})
    assert exc.value.param == "prompt"


@pytest.mark.parametrize("body", [b"{not json", b"", b'{"model": "m",}'])
def test_malformed_json(body):
    with pytest.raises(InvalidRequest) as exc:
        parse(ChatCompletionRequest, body)
    assert exc.value.param is None and "JSON" in exc.value.message


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null"])
def test_body_must_be_an_object(body):
    with pytest.raises(InvalidRequest) as exc:
        parse(ChatCompletionRequest, body)
    assert "object" in exc.value.message
