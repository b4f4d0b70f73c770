"""The gateway over HTTP against an in-process echo engine on a real shm ring (no model needed).

The echo engine repeats the prompt's tokens: a chat reply is the rendered prompt up to the first
<|im_end|> (the EOS), minus special tokens; a completion cycles the prompt until max_tokens.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import json
import time
import urllib.parse

import openai
import pytest

ERROR_TOKEN = "<|endoftext|>"  # prompt [ERROR_TOKEN, n, ...]: the echo engine fails after n tokens


@pytest.fixture(scope="module")
def client(harness):
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=30)


def chat_prompt_ids(harness, content: str) -> list[int]:
    text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return harness.tokenizer.encode(text, add_special_tokens=False).ids


def echo_ids(prompt_ids: list[int], n: int) -> list[int]:
    return list(itertools.islice(itertools.cycle(prompt_ids), n))


def wait_idle(harness, timeout_s: float = 5.0) -> None:
    harness.wait_idle(timeout_s)


# ---------------------------------------------------------------- happy paths


def test_models(client, harness):
    models = client.models.list()
    assert [m.id for m in models.data] == [harness.model]


def test_chat_completion(client, harness):
    resp = client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hello"}])
    prompt_ids = chat_prompt_ids(harness, "hello")
    eos = harness.tokenizer.token_to_id("<|im_end|>")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "user\nhello"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == prompt_ids.index(eos) + 1  # EOS counts as generated
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"


def test_completion_max_tokens_gives_length(client, harness):
    resp = client.completions.create(model=harness.model, prompt="hello world", max_tokens=7)
    prompt_ids = harness.tokenizer.encode("hello world").ids
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7 and resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.choices[0].text == harness.tokenizer.decode(echo_ids(prompt_ids, 7))


def test_completion_token_id_prompt(client, harness):
    ids = harness.tokenizer.encode("the fox").ids
    resp = client.completions.create(model=harness.model, prompt=ids, max_tokens=len(ids))
    assert resp.choices[0].text == "the fox" and resp.usage.prompt_tokens == len(ids)


def test_max_completion_tokens(client, harness):
    resp = client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hello"}],
                                          max_completion_tokens=2)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 2


def test_stream_chat_with_usage(client, harness):
    stream = client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hello"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content  # the role rides with the first text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "user\nhello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt_ids(harness, "hello"))
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_completion_without_usage(client, harness):
    chunks = list(client.completions.create(model=harness.model, prompt="hello world", max_tokens=9, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == harness.tokenizer.decode(echo_ids(harness.tokenizer.encode("hello world").ids, 9))
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


def test_stream_multibyte_characters_arrive_whole(client, harness):
    prompt = "é🙂世界"
    n = len(harness.tokenizer.encode(prompt).ids)
    chunks = list(client.completions.create(model=harness.model, prompt=prompt, max_tokens=n, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == prompt
    assert all("\ufffd" not in t for t in texts)


def test_stop_string_truncates(client, harness):
    resp = client.completions.create(model=harness.model, prompt="hello world", max_tokens=50, stop=[" wor", "zz"])
    assert resp.choices[0].text == "hello" and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 50
    chunks = list(client.completions.create(model=harness.model, prompt="hello world", max_tokens=50,
                                            stop="o w", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "hell"
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(harness)  # the engine was cancelled and the slot came back


def test_stop_token_ids_extension(client, harness):
    ids = harness.tokenizer.encode("hello world").ids
    resp = client.completions.create(model=harness.model, prompt=ids, max_tokens=50,
                                     extra_body={"stop_token_ids": [ids[1]]})
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == 2


def test_ignore_eos_extension(client, harness):
    resp = client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=30, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 30


def test_chat_max_tokens_defaults_to_what_the_context_leaves(client, harness):
    """Completions default to 16 (tests/gateway/test_first_run_api.py); chat, as vLLM, to the context."""
    resp = client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hello"}],
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == harness.context_len - resp.usage.prompt_tokens
    assert resp.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- bad input


def err(status_body):
    status, body = status_body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return status, body["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json(harness, path):
    status, e = err(harness.post(path, b'{"model": "x", ', raw=True))
    assert status == 400 and "JSON" in e["message"] and e["type"] == "invalid_request_error"


@pytest.mark.parametrize("patch,param", [({"temperature": "hot"}, "temperature"), ({"max_tokens": -1}, "max_tokens"),
                                         ({"max_tokens": 0}, "max_tokens"), ({"messages": 5}, "messages"),
                                         ({"stream": 1}, "stream"), ({"top_p": 7}, "top_p")])
def test_wrong_types_and_values(harness, patch, param):
    body = {"model": harness.model, "messages": [{"role": "user", "content": "hi"}], **patch}
    status, e = err(harness.post("/v1/chat/completions", body))
    assert status == 400 and e["param"] == param


def test_unknown_model(harness):
    status, e = err(harness.post("/v1/completions", {"model": "gpt-9", "prompt": "hi"}))
    assert status == 404 and e["code"] == "model_not_found" and e["param"] == "model"


def test_prompt_longer_than_context(harness):
    ids = [5] * (harness.context_len + 10)
    status, e = err(harness.post("/v1/completions", {"model": harness.model, "prompt": ids}))
    assert status == 400 and e["param"] == "prompt" and e["code"] == "context_length_exceeded"
    assert str(harness.context_len) in e["message"]
    long_text = "hello world " * 200
    status, e = err(harness.post("/v1/chat/completions", {"model": harness.model,
                                                          "messages": [{"role": "user", "content": long_text}]}))
    assert status == 400 and e["param"] == "messages"


def test_huge_max_tokens(harness):
    status, e = err(harness.post("/v1/completions", {"model": harness.model, "prompt": "hi", "max_tokens": 10**9}))
    assert status == 400 and e["param"] == "max_tokens" and str(harness.context_len) in e["message"]
    body = {"model": harness.model, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}
    status, e = err(harness.post("/v1/chat/completions", body))
    assert status == 400 and e["param"] == "max_completion_tokens"


def test_token_ids_outside_vocabulary(harness):
    status, e = err(harness.post("/v1/completions", {"model": harness.model, "prompt": [1, 10**6]}))
    assert status == 400 and e["param"] == "prompt"


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_required(harness, key):
    status, e = err(harness.post("/v1/completions", {"model": harness.model, "prompt": "hi"}, key=key))
    assert status == 401 and e["code"] == "invalid_api_key"
    status, e = err(harness.get("/v1/models", key=key))
    assert status == 401


def test_openai_client_with_wrong_key(harness):
    bad = openai.OpenAI(base_url=harness.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_needs_no_key(harness):
    status, body = harness.get("/health", key=None)
    assert status == 200 and body["status"] == "ok" and body["backends"][0]["stalled"] is False


def test_unknown_route_and_method(harness):
    status, e = err(harness.get("/v1/nothing"))
    assert status == 404 and "/v1/nothing" in e["message"]
    status, e = err(harness.get("/v1/completions"))
    assert status == 405


def test_body_too_large(harness):
    body = json.dumps({"model": harness.model, "prompt": "x" * (100 * 1024)}).encode()
    status, e = err(harness.post("/v1/completions", body, raw=True))
    assert status == 413


def test_engine_error_is_a_500_with_message(harness, client):
    ids = [harness.tokenizer.token_to_id(ERROR_TOKEN), 0, 5, 6]
    status, e = err(harness.post("/v1/completions", {"model": harness.model, "prompt": ids}))
    assert status == 500 and "engine" in e["message"] and e["type"] == "server_error"
    with pytest.raises(openai.InternalServerError, match="engine"):  # before the first token: a status
        list(client.completions.create(model=harness.model, prompt=ids, stream=True))
    wait_idle(harness)


def test_engine_error_mid_stream_is_an_error_event(harness):
    hello = harness.tokenizer.encode("hello world").ids
    ids = [harness.tokenizer.token_to_id(ERROR_TOKEN), 6, *hello]
    conn, resp = _open_stream(harness, {"model": harness.model, "prompt": ids, "stream": True})
    assert resp.status == 200
    events = [line[len(b"data: "):] for line in resp.read().split(b"\n\n") if line.startswith(b"data: ")]
    conn.close()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == harness.tokenizer.decode(ids[:6])
    assert chunks[-1]["error"]["type"] == "server_error" and "engine" in chunks[-1]["error"]["message"]
    wait_idle(harness)


def test_normal_request_after_bad_ones(client, harness):
    resp = client.completions.create(model=harness.model, prompt="hello", max_tokens=3)
    assert resp.usage.completion_tokens == 3
    wait_idle(harness)


# ---------------------------------------------------------------- slots: backpressure and disconnects


def test_requests_wait_for_free_slots(client, harness):
    """More concurrent requests than ring slots: the extra ones wait (FIFO) instead of failing."""
    harness.call(setattr, harness.engine, "paused", True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.completions.create, model=harness.model, prompt="hello world",
                               max_tokens=4) for _ in range(8)]
        time.sleep(0.5)
        assert harness.call(lambda: harness.backend.free_slots) == 0
        harness.call(setattr, harness.engine, "paused", False)
        results = [f.result(timeout=20) for f in futures]
    assert all(r.usage.completion_tokens == 4 for r in results)
    wait_idle(harness)


def test_slot_wait_times_out_with_503(client, harness):
    harness.call(setattr, harness.engine, "paused", True)
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(harness.post, "/v1/completions",
                                   {"model": harness.model, "prompt": "hi", "max_tokens": 2}) for _ in range(5)]
            time.sleep(3.0)  # slot_wait_s is 2 s in the harness
            harness.call(setattr, harness.engine, "paused", False)
            results = [f.result(timeout=20) for f in futures]
    finally:
        harness.call(setattr, harness.engine, "paused", False)
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 200, 200, 200, 503]
    busy = next(body for status, body in results if status == 503)
    assert busy["error"]["code"] == "service_unavailable" and "slots" in busy["error"]["message"]
    wait_idle(harness)


def _open_stream(harness, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urllib.parse.urlsplit(harness.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {harness.api_key}", "Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_client_disconnect_mid_stream_frees_the_slot(harness):
    cancelled_before = harness.call(lambda: harness.engine.num_cancelled)
    harness.call(setattr, harness.engine, "step_s", 0.02)  # 200 tokens take seconds
    try:
        conn, resp = _open_stream(harness, {"model": harness.model, "prompt": "hello world", "max_tokens": 200,
                                            "stream": True})
        assert resp.status == 200
        lines = [resp.readline() for _ in range(4)]
        assert lines[0].startswith(b"data: {")
        assert harness.call(lambda: harness.backend.num_in_flight) == 1
        resp.close()
        conn.close()
        wait_idle(harness)
        assert harness.call(lambda: harness.engine.num_cancelled) == cancelled_before + 1
    finally:
        harness.call(setattr, harness.engine, "step_s", 0.001)


def test_client_disconnect_before_a_non_streamed_reply_frees_the_slot(harness):
    cancelled_before = harness.call(lambda: harness.engine.num_cancelled)
    harness.call(setattr, harness.engine, "step_s", 0.02)
    try:
        slow = openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            slow.completions.create(model=harness.model, prompt="hello world", max_tokens=200)
        wait_idle(harness)
        assert harness.call(lambda: harness.engine.num_cancelled) == cancelled_before + 1
    finally:
        harness.call(setattr, harness.engine, "step_s", 0.001)
