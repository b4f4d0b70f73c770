"""/v1/tokenize and /v1/detokenize (vLLM's shapes) over real HTTP, with OpenAI error objects."""

from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "hello there"}]


def test_tokenize_prompt(harness):
    status, body = harness.post("/v1/tokenize", {"model": harness.model, "prompt": "the quick brown fox"})
    ids = harness.tokenizer.encode("the quick brown fox").ids
    assert status == 200 and body == {"tokens": ids, "count": len(ids), "max_model_len": harness.context_len}


def test_tokenize_messages_uses_the_chat_template(harness):
    _, body = harness.post("/v1/tokenize", {"model": harness.model, "messages": CHAT})
    rendered = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert body["tokens"] == harness.tokenizer.encode(rendered, add_special_tokens=False).ids
    _, without = harness.post("/v1/tokenize", {"model": harness.model, "messages": CHAT,
                                               "add_generation_prompt": False})
    assert body["tokens"][:without["count"]] == without["tokens"] and without["count"] < body["count"]


def test_tokenize_matches_what_a_completion_counts(harness):
    _, tok = harness.post("/v1/tokenize", {"model": harness.model, "messages": CHAT})
    _, chat = harness.post("/v1/chat/completions", {"model": harness.model, "messages": CHAT, "max_tokens": 1})
    assert tok["count"] == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("text", ["hello world", "stop here please END of the text", "<|im_start|>user\nhi"])
def test_round_trip(harness, text):
    _, tok = harness.post("/v1/tokenize", {"model": harness.model, "prompt": text})
    status, detok = harness.post("/v1/detokenize", {"model": harness.model, "tokens": tok["tokens"]})
    assert status == 200 and detok == {"prompt": text}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/tokenize", {"prompt": "hi"}, 400, "model"),
    ("/v1/tokenize", {"model": "tiny-echo"}, 400, "prompt"),
    ("/v1/tokenize", {"model": "tiny-echo", "prompt": "hi", "messages": CHAT}, 400, "messages"),
    ("/v1/tokenize", {"model": "tiny-echo", "prompt": 5}, 400, "prompt"),
    ("/v1/tokenize", {"model": "tiny-echo", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
    ("/v1/detokenize", {"model": "tiny-echo"}, 400, "tokens"),
    ("/v1/detokenize", {"model": "tiny-echo", "tokens": [1, -2]}, 400, "tokens[1]"),
    ("/v1/detokenize", {"model": "tiny-echo", "tokens": [1, 10**6]}, 400, "tokens"),
    ("/v1/detokenize", {"model": "tiny-echo", "tokens": "abc"}, 400, "tokens"),
    ("/v1/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
])
def test_bad_input_gets_an_openai_error(harness, path, body, status, param):
    got, reply = harness.post(path, body)
    assert got == status, reply
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/tokenize", "/v1/detokenize"])
def test_api_key_required(harness, path):
    status, reply = harness.post(path, {"model": harness.model, "prompt": "x", "tokens": [1]}, key=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
