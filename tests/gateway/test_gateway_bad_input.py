"""Issue 6: a corpus of bad requests against a live gateway (echo engine, real sockets).

Every case must get the status OpenAI would send (400 invalid_request_error for bad params, 401 for
auth, 404 for an unknown model or path, 405 for a wrong method, 413 over max_body_bytes) and an OpenAI
error object naming the field where there is one. Afterwards the gateway still serves a normal request.

The gateway defines no 415: it reads JSON whatever the Content-Type (curl -d sends form-urlencoded), so a
wrong Content-Type is judged by its body. Stalled partial requests block no one and can be abandoned;
they are closed after header_timeout_s / body_timeout_s (tests/gateway/test_gateway_timeouts.py).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass, field

import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MODEL = "tiny-echo"  # conftest.MODEL
MAX_BODY_BYTES = 64 * 1024  # the harness's max_body_bytes
USER = [{"role": "user", "content": "hello"}]
AUTH = object()  # placeholder for the harness's key in a case's headers


@dataclass(frozen=True)
class Case:
    """One bad request: its body (a dict is sent as JSON), what must come back."""

    path: str
    body: object
    status: int = 400
    param: str | None = None
    method: str = "POST"
    headers: dict = field(default_factory=lambda: {"Content-Type": "application/json", "Authorization": AUTH})
    type: str = "invalid_request_error"


def chat(param: str | None = None, status: int = 400, **fields) -> Case:
    return Case(CHAT, {"model": MODEL, "messages": USER, **fields}, status, param)


def comp(param: str | None = None, status: int = 400, **fields) -> Case:
    return Case(COMPLETIONS, {"model": MODEL, "prompt": "hello", **fields}, status, param)


def raw(body: bytes, path: str = CHAT, param: str | None = None) -> Case:
    return Case(path, body, 400, param)


def with_headers(headers: dict, status: int, type: str = "invalid_request_error", body: object = None) -> Case:
    body = {"model": MODEL, "messages": USER} if body is None else body
    return Case(CHAT, body, status, None, headers=headers, type=type)


MALFORMED_JSON = {
    "empty-body": raw(b""),
    "whitespace-body": raw(b"   \n"),
    "truncated-object": raw(b'{"model": "tiny-echo", "messages": [{"role": "user"'),
    "truncated-string": raw(b'{"model": "tiny-ec'),
    "trailing-garbage": raw(b'{"model": "tiny-echo", "messages": []} xyz'),
    "two-objects": raw(b'{"model": "a"}{"model": "b"}'),
    "single-quotes": raw(b"{'model': 'tiny-echo'}"),
    "trailing-comma": raw(b'{"model": "tiny-echo",}'),
    "nan-literal": raw(b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "x"}], '
                       b'"temperature": NaN}', param=None),
    "infinity-literal": raw(b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "x"}], '
                            b'"top_p": Infinity}', param=None),
    "neg-infinity-literal": raw(b'{"model": "tiny-echo", "prompt": "x", "temperature": -Infinity}',
                                COMPLETIONS),
    "top-level-array": raw(b'[{"model": "tiny-echo"}]'),
    "top-level-string": raw(b'"hello"'),
    "top-level-number": raw(b"42"),
    "top-level-null": raw(b"null"),
    "top-level-true": raw(b"true"),
    "completions-top-level-array": raw(b"[]", COMPLETIONS),
    "invalid-utf8": raw(b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    "invalid-utf8-key": raw(b'{"mo\xc3\x28del": "tiny-echo"}'),
    "lone-surrogate-escape": raw(b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    "nul-byte": raw(b'{"model": "tiny-echo"\x00}'),
    "deep-nesting": raw(b'{"model": "tiny-echo", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
}

CHAT_TYPES = {
    "model-int": chat("model", model=7),
    "model-null": chat("model", model=None),
    "model-list": chat("model", model=["tiny-echo"]),
    "model-missing": Case(CHAT, {"messages": USER}, 400, "model"),
    "messages-missing": Case(CHAT, {"model": MODEL}, 400, "messages"),
    "messages-string": chat("messages", messages="hello"),
    "messages-object": chat("messages", messages={"role": "user", "content": "hi"}),
    "messages-empty": chat("messages", messages=[]),
    "messages-null": chat("messages", messages=None),
    "message-string": chat("messages[0]", messages=["hello"]),
    "message-null": chat("messages[0]", messages=[None]),
    "role-missing": chat("messages[0].role", messages=[{"content": "hi"}]),
    "role-unknown": chat("messages[0].role", messages=[{"role": "wizard", "content": "hi"}]),
    "role-int": chat("messages[0].role", messages=[{"role": 1, "content": "hi"}]),
    "role-uppercase": chat("messages[0].role", messages=[{"role": "USER", "content": "hi"}]),
    "second-role-bad": chat("messages[1].role", messages=[*USER, {"role": "robot", "content": "x"}]),
    "content-int": chat("messages[0].content", messages=[{"role": "user", "content": 5}]),
    "content-object": chat("messages[0].content", messages=[{"role": "user", "content": {"text": "hi"}}]),
    "content-part-string": chat("messages[0].content", messages=[{"role": "user", "content": ["hi"]}]),
    "content-part-no-type": chat("messages[0].content", messages=[{"role": "user", "content": [{"text": "x"}]}]),
    "content-part-image": chat("messages[0].content[0]", messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
    "content-part-text-int": chat("messages[0].content", messages=[
        {"role": "user", "content": [{"type": "text", "text": 3}]}]),
    "name-int": chat("messages[0].name", messages=[{"role": "user", "content": "x", "name": 1}]),
    "max_tokens-string": chat("max_tokens", max_tokens="10"),
    "max_tokens-float": chat("max_tokens", max_tokens=1.5),
    "max_tokens-bool": chat("max_tokens", max_tokens=True),
    "max_completion_tokens-string": chat("max_completion_tokens", max_completion_tokens="5"),
    "max_completion_tokens-list": chat("max_completion_tokens", max_completion_tokens=[5]),
    "temperature-string": chat("temperature", temperature="hot"),
    "temperature-bool": chat("temperature", temperature=True),
    "top_p-string": chat("top_p", top_p="0.5"),
    "top_k-float": chat("top_k", top_k=2.5),
    "top_k-string": chat("top_k", top_k="5"),
    "min_p-string": chat("min_p", min_p="0.1"),
    "seed-string": chat("seed", seed="42"),
    "seed-float": chat("seed", seed=4.2),
    "stop-int": chat("stop", stop=5),
    "stop-list-of-int": chat("stop", stop=[1, 2]),
    "stop-object": chat("stop", stop={"a": 1}),
    "stream-string": chat("stream", stream="yes"),
    "stream-int": chat("stream", stream=1),
    "stream_options-bool": chat("stream_options", stream=True, stream_options=True),
    "stream_options-include_usage-string": chat("stream_options.include_usage", stream=True,
                                                stream_options={"include_usage": "yes"}),
    "user-int": chat("user", user=123),
    "user-object": chat("user", user={"id": 1}),
    "priority-string": chat("priority", priority="high"),
    "priority-float": chat("priority", priority=1.5),
    "ignore_eos-string": chat("ignore_eos", ignore_eos="true"),
    "ignore_eos-int": chat("ignore_eos", ignore_eos=1),
    "stop_token_ids-string": chat("stop_token_ids", stop_token_ids="1"),
    "tools-without-function": chat("tools[0].function", tools=[{"type": "function"}]),
    "n-string": chat("n", n="2"),
    "n-float": chat("n", n=2.5),
    "n-null-list": chat("n", n=[2]),
    "logprobs-int": chat("logprobs", logprobs=1),
    "logprobs-string": chat("logprobs", logprobs="true"),
    "top_logprobs-string": chat("top_logprobs", logprobs=True, top_logprobs="3"),
    "top_logprobs-float": chat("top_logprobs", logprobs=True, top_logprobs=2.5),
    "presence_penalty-string": chat("presence_penalty", presence_penalty="1"),
    "frequency_penalty-bool": chat("frequency_penalty", frequency_penalty=True),
    "repetition_penalty-list": chat("repetition_penalty", repetition_penalty=[1.1]),
    "logit_bias-list": chat("logit_bias", logit_bias=[[5, 10]]),
    "logit_bias-string": chat("logit_bias", logit_bias="5:10"),
    "logit_bias-value-string": chat("logit_bias.5", logit_bias={"5": "10"}),
    "logit_bias-value-null": chat("logit_bias.5", logit_bias={"5": None}),
    "logit_bias-key-word": chat("logit_bias", logit_bias={"hello": 1}),
    "logit_bias-key-float": chat("logit_bias", logit_bias={"1.5": 1}),
    "logit_bias-key-empty": chat("logit_bias", logit_bias={"": 1}),
    "logit_bias-key-unicode-digit": chat("logit_bias", logit_bias={"\u0665": 1}),
}

COMPLETION_TYPES = {
    "prompt-missing": Case(COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    "prompt-null": comp("prompt", prompt=None),
    "prompt-int": comp("prompt", prompt=5),
    "prompt-object": comp("prompt", prompt={"text": "x"}),
    "prompt-empty-string": comp("prompt", prompt=""),
    "prompt-empty-list": comp("prompt", prompt=[]),
    "prompt-batch-with-an-empty-string": comp("prompt[1]", prompt=["a", ""]),  # a batch is fine, "" is not
    "prompt-mixed-list": comp("prompt", prompt=["a", 1]),
    "prompt-float-ids": comp("prompt", prompt=[1.5, 2.0]),
    "prompt-negative-id": comp("prompt", prompt=[5, -1]),
    "prompt-id-out-of-vocab": comp("prompt", prompt=[5, 10**6]),
    "prompt-id-2-63": comp("prompt", prompt=[2**63]),
    "prompt-nested-out-of-vocab": comp("prompt[0]", prompt=[[5, 10**6]]),  # a batch (of one): its item
    "prompt-too-long": comp("prompt", prompt=[5] * 300),
    "completion-model-int": comp("model", model=1),
    "completion-max_tokens-string": comp("max_tokens", max_tokens="3"),
    "completion-temperature-list": comp("temperature", temperature=[1]),
    "completion-stream-string": comp("stream", stream="false"),
    "completion-seed-bool": comp("seed", seed=False),
    "completion-stop-list-of-lists": comp("stop", stop=[["a"]]),
    "completion-user-list": comp("user", user=["u"]),
    "completion-ignore_eos-null-string": comp("ignore_eos", ignore_eos="null"),
    "echo-string": comp("echo", echo="true"),
    "echo-with-logprobs": comp("echo", echo=True, logprobs=1),
    "completion-logprobs-bool": comp("logprobs", logprobs=True),
    "completion-logprobs-string": comp("logprobs", logprobs="2"),
    "completion-n-string": comp("n", n="3"),
    "best_of-2": comp("best_of", best_of=2),
    "suffix": comp("suffix", suffix="x"),
}

RANGES = {
    "max_tokens-negative": chat("max_tokens", max_tokens=-1),
    "max_tokens-zero": chat("max_tokens", max_tokens=0),
    "max_tokens-2-63": chat("max_tokens", max_tokens=2**63),
    "max_tokens-2-64": chat("max_tokens", max_tokens=2**64),
    "max_tokens-over-context": chat("max_tokens", max_tokens=10_000),
    "max_completion_tokens-zero": chat("max_completion_tokens", max_completion_tokens=0),
    "max_completion_tokens-2-63": chat("max_completion_tokens", max_completion_tokens=2**63),
    "completion-max_tokens-negative": comp("max_tokens", max_tokens=-5),
    "completion-max_tokens-2-63": comp("max_tokens", max_tokens=2**63),
    "temperature-negative": chat("temperature", temperature=-1),
    "temperature-1e9": chat("temperature", temperature=1e9),
    "temperature-1e400": raw(b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "x"}], '
                             b'"temperature": 1e400}', param="temperature"),
    "top_p-zero": chat("top_p", top_p=0),
    "top_p-two": chat("top_p", top_p=2),
    "top_p-negative": comp("top_p", top_p=-0.5),
    "top_k-minus-2": chat("top_k", top_k=-2),
    "top_k-2-63": chat("top_k", top_k=2**63),
    "min_p-negative": chat("min_p", min_p=-0.1),
    "min_p-over-one": chat("min_p", min_p=1.5),
    "seed-2-64": chat("seed", seed=2**64),
    "seed-negative-2-63-minus-1": chat("seed", seed=-(2**63) - 1),
    "seed-10-30": chat("seed", seed=10**30),
    "priority-negative": chat("priority", priority=-1),
    "priority-256": chat("priority", priority=256),
    "stop-5-strings": chat("stop", stop=["a", "b", "c", "d", "e"]),
    "stop-10000-strings": chat("stop", stop=["x"] * 10_000),  # 50 KB: under max_body_bytes
    "stop_token_ids-too-many": chat("stop_token_ids", stop_token_ids=[1, 2, 3, 4, 5]),
    "stop_token_ids-negative": chat("stop_token_ids[0]", stop_token_ids=[-1]),
    "stop_token_ids-2-40": chat("stop_token_ids[0]", stop_token_ids=[2**40]),
    "stop_token_ids-out-of-vocab": chat("stop_token_ids", stop_token_ids=[10**6]),
    "prompt-too-long-chat": chat("messages", messages=[{"role": "user", "content": "zq" * 200}]),
    "n-zero": chat("n", n=0),
    "n-negative": comp("n", n=-1),
    "n-129": chat("n", n=129),
    "n-2-63": chat("n", n=2**63),
    "top_logprobs-21": chat("top_logprobs", logprobs=True, top_logprobs=21),
    "top_logprobs-negative": chat("top_logprobs", logprobs=True, top_logprobs=-1),
    "top_logprobs-without-logprobs": chat("top_logprobs", top_logprobs=2),
    "top_logprobs-with-logprobs-false": chat("top_logprobs", logprobs=False, top_logprobs=2),
    "completion-logprobs-6": comp("logprobs", logprobs=6),
    "completion-logprobs-negative": comp("logprobs", logprobs=-1),
    "presence_penalty-2.5": chat("presence_penalty", presence_penalty=2.5),
    "presence_penalty-minus-3": comp("presence_penalty", presence_penalty=-3),
    "frequency_penalty-2.01": chat("frequency_penalty", frequency_penalty=2.01),
    "frequency_penalty-1e400": raw(b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "x"}], '
                                   b'"frequency_penalty": -1e400}', param="frequency_penalty"),
    "repetition_penalty-zero": chat("repetition_penalty", repetition_penalty=0),
    "repetition_penalty-negative": comp("repetition_penalty", repetition_penalty=-1.0),
    "repetition_penalty-1e300": chat("repetition_penalty", repetition_penalty=1e300),
    "logit_bias-value-101": chat("logit_bias.5", logit_bias={"5": 101}),
    "logit_bias-value-minus-100.5": comp("logit_bias.7", logit_bias={"7": -100.5}),
    "logit_bias-key-negative": chat("logit_bias", logit_bias={"-1": 1}),
    "logit_bias-key-out-of-vocab": chat("logit_bias", logit_bias={"1000000": 1}),
    "logit_bias-key-2-40": comp("logit_bias", logit_bias={str(2**40): 1}),
    "logit_bias-301-entries": chat("logit_bias", logit_bias={str(i): 1 for i in range(301)}),
}

NOT_FOUND = {
    "unknown-model-chat": chat("model", 404, model="gpt-4"),
    "unknown-model-completions": comp("model", 404, model="no-such-model"),
    "empty-model": chat("model", 404, model=""),
    "unknown-path": Case("/v1/chat/completion", {"model": MODEL}, 404),
    "unknown-path-v2": Case("/v2/chat/completions", {"model": MODEL}, 404),
    "unknown-path-root": Case("/", None, 404, method="GET"),
    "unknown-path-traversal": Case("/v1/../../etc/passwd", None, 404, method="GET"),
    "get-chat": Case(CHAT, None, 405, method="GET"),
    "put-chat": Case(CHAT, {"model": MODEL}, 405, method="PUT"),
    "delete-completions": Case(COMPLETIONS, None, 405, method="DELETE"),
    "post-models": Case("/v1/models", {}, 405),
    "patch-tokenize": Case("/v1/tokenize", {}, 405, method="PATCH"),
}

HEADERS = {
    "no-authorization": with_headers({"Content-Type": "application/json"}, 401, "authentication_error"),
    "wrong-key": with_headers({"Authorization": "Bearer nope"}, 401, "authentication_error"),
    "empty-bearer": with_headers({"Authorization": "Bearer "}, 401, "authentication_error"),
    "basic-scheme": with_headers({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "authentication_error"),
    "key-without-scheme": with_headers({"Authorization": "KEY"}, 401, "authentication_error"),
    "empty-authorization": with_headers({"Authorization": ""}, 401, "authentication_error"),
    "bearer-twice": with_headers({"Authorization": "Bearer Bearer KEY"}, 401, "authentication_error"),
    "auth-before-bad-json": with_headers({"Authorization": "Bearer nope"}, 401, "authentication_error",
                                         body=b"{not json"),
    "no-key-on-unknown-path": Case("/v1/nothing", {}, 404, headers={}),  # no route: 404 whether a key came or not
    # JSON is read whatever the Content-Type (curl -d sends form-urlencoded): a bad body is still a 400.
    "form-urlencoded": with_headers({"Authorization": AUTH, "Content-Type": "application/x-www-form-urlencoded"},
                                    400, body=b"model=tiny-echo&prompt=hi"),
    "text-plain-bad-json": with_headers({"Authorization": AUTH, "Content-Type": "text/plain"}, 400,
                                        body=b"hello"),
    "multipart": with_headers({"Authorization": AUTH, "Content-Type": "multipart/form-data; boundary=b"}, 400,
                              body=b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nx\r\n--b--\r\n'),
    "no-content-type-bad-json": with_headers({"Authorization": AUTH}, 400, body=b"{"),
    "oversized-body": with_headers({"Authorization": AUTH, "Content-Type": "application/json"}, 413,
                                   body={"model": MODEL, "messages": [{"role": "user",
                                                                       "content": "x" * MAX_BODY_BYTES}]}),
}


def _all_cases() -> dict[str, Case]:
    groups = {"json": MALFORMED_JSON, "chat": CHAT_TYPES, "completions": COMPLETION_TYPES, "range": RANGES,
              "route": NOT_FOUND, "headers": HEADERS}
    return {f"{group}:{name}": case for group, cases in groups.items() for name, case in cases.items()}


CASES = _all_cases()


def send(harness, case: Case) -> tuple[int, dict]:
    """The case over a fresh connection; (status, parsed body)."""
    url = urllib.parse.urlsplit(harness.url)
    data = case.body if isinstance(case.body, bytes) or case.body is None else json.dumps(case.body).encode()
    headers = {k: f"Bearer {harness.api_key}" if v is AUTH else v for k, v in case.headers.items()}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request(case.method, case.path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def assert_error_object(body: dict, case: Case) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"], err
    assert err["type"] == case.type, err
    if case.param is not None:
        assert err["param"] == case.param, err


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_request(harness, case):
    status, body = send(harness, case)
    assert status == case.status, body
    assert_error_object(body, case)


def test_corpus_is_large():
    assert len(CASES) >= 100


def test_json_without_json_content_type_is_served(harness):
    """The gateway does not answer 415: a JSON body is read whatever the Content-Type says."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 2}
    case = Case(CHAT, body, headers={"Authorization": AUTH, "Content-Type": "text/plain"})
    status, reply = send(harness, case)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply

# ---------------------------------------------------------------- slowloris


def _stalled_socket(harness, payload: bytes) -> socket.socket:
    url = urllib.parse.urlsplit(harness.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=5)
    sock.sendall(payload)
    return sock


def _partial_requests(harness) -> dict[str, bytes]:
    body = json.dumps({"model": MODEL, "messages": USER}).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {harness.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return {"request-line": b"POST /v1/chat/comp", "half-headers": head[:len(head) // 2],
            "headers-no-body": head, "half-body": head + body[:len(body) // 2]}


def test_slowloris_does_not_block_others(harness):
    stalled = [_stalled_socket(harness, p) for p in _partial_requests(harness).values() for _ in range(4)]
    try:
        start_s = time.monotonic()
        status, body = harness.post(CHAT, {"model": MODEL, "messages": USER, "max_tokens": 4})
        assert status == 200 and body["choices"][0]["message"]["content"], body
        assert time.monotonic() - start_s < 5
    finally:
        for sock in stalled:  # abandoning a stalled connection must not disturb the server
            sock.close()
    harness.wait_idle()


def test_abandoned_body_frees_the_request(harness):
    """A client that sends half a body and hangs up leaves no request behind."""
    payload = _partial_requests(harness)["half-body"]
    for _ in range(8):
        _stalled_socket(harness, payload).close()
    harness.wait_idle()
    status, _ = harness.post(CHAT, {"model": MODEL, "messages": USER, "max_tokens": 2})
    assert status == 200


# ---------------------------------------------------------------- afterwards


def test_still_serves_after_corpus(harness):
    status, body = harness.post(CHAT, {"model": MODEL, "messages": USER})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "user\nhello"
    assert body["choices"][0]["finish_reason"] == "stop"
    harness.wait_idle()
