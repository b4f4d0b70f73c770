"""What the gateway does on its own, in every engine mode: n choices (fan-out), echo, and the 400 for
engine-side parameters an engine mode does not implement. Echo engine, real shm ring."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import openai
import pytest

from gateway.config import GatewayConfig

ERROR_TOKEN = "<|endoftext|>"  # prompt [ERROR_TOKEN, n, ...]: the echo engine fails after n tokens


@pytest.fixture(scope="module")
def client(harness):
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=30)


def test_n_choices_share_one_prompt_and_sum_their_usage(client, harness):
    before = len(harness.engine.specs)
    resp = client.completions.create(model=harness.model, prompt="hello world", max_tokens=5, n=3, seed=41)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) == 1 and resp.choices[0].text
    assert all(c.finish_reason == "length" for c in resp.choices)
    prompt_len = len(harness.tokenizer.encode("hello world").ids)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == \
        (prompt_len, 15, prompt_len + 15)
    specs = harness.engine.specs[before:]
    assert sorted(s.seed for s in specs) == [41, 42, 43] and len({s.request_id for s in specs}) == 1
    harness.wait_idle()


def test_n_choices_without_a_seed_stay_seedless(client, harness):
    before = len(harness.engine.specs)
    client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hi"}], n=2)
    assert [s.seed for s in harness.engine.specs[before:]] == [None, None]
    harness.wait_idle()


def test_n_choices_stream_with_their_index_and_one_usage(client, harness):
    stream = client.chat.completions.create(model=harness.model, messages=[{"role": "user", "content": "hi"}],
                                            n=3, max_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts, finishes, roles = {}, {}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles.setdefault(choice.index, choice.delta.role)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    harness.wait_idle()


def test_echo_prepends_the_prompt(client, harness):
    resp = client.completions.create(model=harness.model, prompt="hello world", max_tokens=3, echo=True, n=2)
    plain = client.completions.create(model=harness.model, prompt="hello world", max_tokens=3)
    assert [c.text for c in resp.choices] == ["hello world" + plain.choices[0].text] * 2
    ids = harness.tokenizer.encode("hello there").ids
    streamed = client.completions.create(model=harness.model, prompt=ids, max_tokens=2, echo=True, stream=True)
    chunks = [c for c in streamed if c.choices]
    assert chunks[0].choices[0].text.startswith("hello there")
    assert "".join(c.choices[0].text for c in chunks).startswith("hello there")
    assert resp.usage.prompt_tokens == plain.usage.prompt_tokens  # echo is not generated output
    harness.wait_idle()


def test_n_over_the_ring_slots_is_a_400(harness):
    status, body = harness.post("/v1/completions", {"model": harness.model, "prompt": "hi", "n": 5})
    assert status == 400 and body["error"]["param"] == "n" and "slots" in body["error"]["message"]


def test_one_failed_choice_fails_the_request_and_frees_every_slot(harness):
    ids = [harness.tokenizer.token_to_id(ERROR_TOKEN), 0, 5, 6]  # fails before its first token
    status, body = harness.post("/v1/completions", {"model": harness.model, "prompt": ids, "n": 3})
    assert status == 500 and "engine" in body["error"]["message"]
    harness.wait_idle()
    status, body = harness.post("/v1/completions", {"model": harness.model, "prompt": ids, "n": 2, "stream": True})
    assert status == 500
    harness.wait_idle()


def test_a_choice_failing_mid_stream_ends_the_stream_with_an_error_event(harness):
    hello = harness.tokenizer.encode("hello world").ids
    ids = [harness.tokenizer.token_to_id(ERROR_TOKEN), 6, *hello]  # fails after 6 tokens
    body = json.dumps({"model": harness.model, "prompt": ids, "n": 2, "stream": True}).encode()
    req = urllib.request.Request(harness.url + "/v1/completions", body, method="POST", headers={
        "Authorization": f"Bearer {harness.api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        events = [e[len(b"data: "):] for e in resp.read().split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "server_error" and "engine" in last["error"]["message"]
    assert {json.loads(e)["choices"][0]["index"] for e in events[:-2]} <= {0, 1}
    harness.wait_idle()


def test_choices_submitted_before_a_refusal_are_cancelled(harness):
    """Three choices get slots, the fourth waits past slot_wait_s (one slot is held): the 503 cancels them."""
    harness.call(setattr, harness.engine, "paused", True)
    cancelled = harness.call(lambda: harness.engine.num_cancelled)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            holder = pool.submit(harness.post, "/v1/completions", {"model": harness.model, "prompt": "a",
                                                                    "max_tokens": 2})
            time.sleep(0.3)
            status, body = harness.post("/v1/completions", {"model": harness.model, "prompt": "b", "n": 4})
            harness.call(setattr, harness.engine, "paused", False)
            assert holder.result(timeout=10)[0] == 200
    finally:
        harness.call(setattr, harness.engine, "paused", False)
    assert status == 503 and body["error"]["code"] == "service_unavailable"
    harness.wait_idle()
    assert harness.call(lambda: harness.engine.num_cancelled) - cancelled == 3


ENGINE_PARAMS = [
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": -0.5}),
    ("repetition_penalty", {"repetition_penalty": 1.2}),
    ("logit_bias", {"logit_bias": {"5": 3}}),
    ("logprobs", {"logprobs": True, "top_logprobs": 2}),
]


@pytest.fixture(scope="module")
def persistent_mode(start_harness, pick_free_port):
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({"k"}),
                           slot_wait_s=2.0)
    return start_harness(config, "k", engine_mode="persistent", sampling_extensions=False)  # --no-sampling-extensions


@pytest.fixture(scope="module")
def persistent_extended(start_harness, pick_free_port):
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({"k"}),
                           slot_wait_s=2.0)
    return start_harness(config, "k", engine_mode="persistent")


def test_a_persistent_backend_with_the_extensions_gets_engine_side_parameters(persistent_extended):
    mode = persistent_extended
    body = {"model": mode.model, "prompt": "hi", "max_tokens": 2, "presence_penalty": 0.5,
            "repetition_penalty": 1.2, "logit_bias": {"5": 3}}
    status, reply = mode.post("/v1/completions", body)
    assert status == 200, reply
    spec = mode.engine.specs[-1]
    assert (spec.presence_penalty, spec.repetition_penalty, spec.logit_bias) == (0.5, pytest.approx(1.2), ((5, 3.0),))
    mode.wait_idle()


@pytest.mark.parametrize("param, fields", ENGINE_PARAMS, ids=[p for p, _ in ENGINE_PARAMS])
def test_the_persistent_mode_refuses_engine_side_parameters(persistent_mode, param, fields):
    mode = persistent_mode
    for stream in (False, True):
        body = {"model": mode.model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **fields}
        status, reply = mode.post("/v1/chat/completions", body)
        assert status == 400, reply
        assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"
        message = reply["error"]["message"]
        assert "'persistent' backends run without the sampling extensions" in message
    status, reply = mode.post("/v1/completions", {"model": mode.model, "prompt": "hi", "logprobs": 0})
    assert status == 400 and reply["error"]["param"] == "logprobs"
    assert mode.call(lambda: mode.backend.num_in_flight) == 0


def test_the_persistent_mode_still_serves_n_echo_and_defaults(persistent_mode):
    body = {"model": persistent_mode.model, "prompt": "hello", "n": 2, "echo": True, "max_tokens": 2,
            "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
            "stop": ["zzz"], "user": "u-1", "priority": 1}
    status, reply = persistent_mode.post("/v1/completions", body)
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["text"].startswith("hello") and c["logprobs"] is None for c in reply["choices"])
    spec = persistent_mode.engine.specs[-1]
    assert spec.priority == 1 and spec.num_logprobs is None and spec.repetition_penalty == 1.0
    persistent_mode.wait_idle()
