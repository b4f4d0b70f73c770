"""End to end through `blink serve` (CPU engine, demo model) with the official openai client."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import openai
import pytest

from gateway.request.detokenize import IncrementalDetokenizer
from protocols import control_pb2, control_pb2_grpc

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url, api_key=live_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(live_server):
    """The reference tokenizer (transformers) on the same model folder."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(live_server.model_dir)


def backend_health(live_server) -> control_pb2.HealthReply:
    with grpc.insecure_channel(live_server.control) as channel:
        return control_pb2_grpc.ControlStub(channel).Health(control_pb2.HealthRequest(), timeout=10)


def generated_delta(live_server, fn):
    """(fn's result, tokens the engine published while it ran)."""
    before = backend_health(live_server).generated_tokens
    result = fn()
    return result, backend_health(live_server).generated_tokens - before


def gateway_health(live_server) -> dict:
    with urllib.request.urlopen(live_server.root_url + "/health", timeout=10) as resp:
        return json.loads(resp.read())


def wait_all_slots_free(live_server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        backend = gateway_health(live_server)["backends"][0]
        health = backend_health(live_server)
        if backend["in_flight"] == 0 and health.running == 0 and health.waiting == 0:
            return backend
        time.sleep(0.1)
    raise AssertionError(f"requests still in flight: {gateway_health(live_server)}, {backend_health(live_server)}")


# ---------------------------------------------------------------- the happy paths


def test_chat_counts_match_the_reference_tokenizer_and_the_engine(client, live_server, hf_tokenizer):
    resp, generated = generated_delta(live_server, lambda: client.chat.completions.create(
        model=live_server.model, messages=QUESTION, max_tokens=40, temperature=0))
    reference_text = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert resp.usage.prompt_tokens == len(hf_tokenizer(reference_text, add_special_tokens=False)["input_ids"])
    assert resp.usage.completion_tokens == generated > 0
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert "Paris" in resp.choices[0].message.content


def test_completion_max_tokens_is_length_with_exactly_that_many(client, live_server, hf_tokenizer):
    prompt = "Once upon a time, in a small village by the sea,"
    resp, generated = generated_delta(live_server, lambda: client.completions.create(
        model=live_server.model, prompt=prompt, max_tokens=9, temperature=0))
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 9 == generated
    assert resp.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    assert resp.choices[0].text.strip()


def test_streaming_matches_non_streaming(client, live_server):
    full = client.chat.completions.create(model=live_server.model, messages=QUESTION, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=live_server.model, messages=QUESTION, max_tokens=30,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    # the same counts; cached prompt tokens aside (the second request finds the first one's blocks cached, and how
    # many the first found depends on the requests before it)
    assert chunks[-1].choices == [] and _uncached(chunks[-1].usage) == _uncached(full.usage)


def _uncached(usage) -> dict:
    counts = usage.model_dump()
    if counts.get("prompt_tokens_details"):
        counts["prompt_tokens_details"] = dict(counts["prompt_tokens_details"], cached_tokens=None)
    return counts


def test_stop_string_truncates(client, live_server):
    base = client.completions.create(model=live_server.model, prompt="The days of the week are Monday,",
                                     max_tokens=24, temperature=0).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert len(stop) == 3
    expected = base[:base.find(stop)]
    resp = client.completions.create(model=live_server.model, prompt="The days of the week are Monday,",
                                     max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=live_server.model, prompt="The days of the week are Monday,",
                                            max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_all_slots_free(live_server)


def test_seed_makes_sampling_reproducible(client, live_server):
    def sample(seed):
        return client.chat.completions.create(model=live_server.model, messages=QUESTION, max_tokens=24,
                                              temperature=1.0, seed=seed).choices[0].message.content
    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))  # sampling does happen


def test_multibyte_output_never_splits_characters(live_server):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{live_server.model_dir}/tokenizer.json")
    text = "emoji 🙂🚀, CJK 世界你好, accents éü, family 👩‍👩‍👧"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    out = [detok.add(t) for t in ids]
    assert all("\ufffd" not in piece for piece in out)
    assert "".join(out) + detok.flush() == text
    assert len([p for p in out if p == ""]) > 0  # some bytes really were held back


# ---------------------------------------------------------------- bad input, then a good request


def raw_post(live_server, path: str, body: bytes, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(live_server.root_url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def bad_corpus(live_server):
    m = live_server.model
    chat = {"model": m, "messages": [{"role": "user", "content": "hi"}]}
    long_prompt = "hello " * (live_server.context_len + 100)
    return [
        ("malformed json", "/v1/chat/completions", b'{"model": ', 400, None),
        ("wrong type", "/v1/chat/completions", {**chat, "temperature": "warm"}, 400, "temperature"),
        ("wrong messages", "/v1/chat/completions", {**chat, "messages": [{"role": "user"}, 3]}, 400, "messages[1]"),
        ("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
        ("prompt too long", "/v1/completions", {"model": m, "prompt": long_prompt}, 400, "prompt"),
        ("negative max_tokens", "/v1/completions", {"model": m, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ("huge max_tokens", "/v1/completions", {"model": m, "prompt": "hi", "max_tokens": 10**7}, 400, "max_tokens"),
        ("too many stops", "/v1/chat/completions", {**chat, "stop": list("abcde")}, 400, "stop"),
    ]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(client, live_server):
    for name, path, body, status, param in bad_corpus(live_server):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, payload = raw_post(live_server, path, data, live_server.api_key)
        assert got == status, (name, payload)
        assert set(payload["error"]) == {"message", "type", "param", "code"}, name
        assert payload["error"]["param"] == param, (name, payload)
        assert "Traceback" not in payload["error"]["message"]
    for key in (None, "wrong"):
        got, payload = raw_post(live_server, "/v1/completions", b'{"model": "x", "prompt": "y"}', key)
        assert got == 401 and payload["error"]["code"] == "invalid_api_key"
    resp = client.completions.create(model=live_server.model, prompt="Hello", max_tokens=3, temperature=0)
    assert resp.usage.completion_tokens == 3
    wait_all_slots_free(live_server)


def test_openai_client_raises_typed_errors(client, live_server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=live_server.model, prompt="hi", max_tokens=10**6)


# ---------------------------------------------------------------- a client that leaves


def test_disconnect_mid_stream_frees_the_slot(live_server):
    free_before = wait_all_slots_free(live_server)["free_slots"]
    generated_before = backend_health(live_server).generated_tokens
    url = urllib.parse.urlsplit(live_server.root_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"model": live_server.model, "prompt": "Write a long story about a dragon.", "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {live_server.api_key}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        line = resp.readline()
        events += line.startswith(b"data: {")
    assert gateway_health(live_server)["backends"][0]["in_flight"] == 1
    resp.close()
    conn.close()
    after = wait_all_slots_free(live_server, timeout_s=10)
    assert after["free_slots"] == free_before
    health = backend_health(live_server)
    assert health.running == 0
    assert health.generated_tokens - generated_before < 1500  # cancelled, not run to max_tokens


# ---------------------------------------------------------------- gRPC, tokenize, metrics on the real model


def grpc_stub(live_server):
    from protocols import inference_pb2_grpc

    channel = grpc.insecure_channel(live_server.grpc_addr)
    return channel, inference_pb2_grpc.InferenceStub(channel)


def grpc_auth(live_server):
    return (("authorization", f"Bearer {live_server.api_key}"),)


def scrape_metrics(live_server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(live_server.root_url + "/metrics", timeout=10) as resp:  # no key
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_grpc_generate_streams_the_http_completion(client, live_server):
    from protocols import inference_pb2 as pb

    prompt = "The three primary colors are"
    http_resp = client.completions.create(model=live_server.model, prompt=prompt, max_tokens=24, temperature=0)
    channel, stub = grpc_stub(live_server)
    with channel:
        replies = list(stub.Generate(pb.GenerateRequest(model=live_server.model, prompt=prompt, max_tokens=24,
                                                        temperature=0), metadata=grpc_auth(live_server), timeout=120))
    assert len(replies) > 1
    assert "".join(r.text for r in replies) == http_resp.choices[0].text
    assert replies[-1].finish_reason == http_resp.choices[0].finish_reason
    usage = replies[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (http_resp.usage.prompt_tokens,
                                                              http_resp.usage.completion_tokens)
    assert len([t for r in replies for t in r.token_ids]) == usage.completion_tokens


def test_grpc_tokenize_matches_http_and_the_reference(live_server, hf_tokenizer):
    from protocols import inference_pb2 as pb

    text = "Hello, world! Ünïcödé 你好"
    _, body = raw_post(live_server, "/v1/tokenize", json.dumps({"model": live_server.model, "prompt": text}).encode(),
                       live_server.api_key)
    channel, stub = grpc_stub(live_server)
    with channel:
        reply = stub.Tokenize(pb.TokenizeRequest(model=live_server.model, prompt=text),
                              metadata=grpc_auth(live_server), timeout=30)
    assert list(reply.tokens) == body["tokens"] == hf_tokenizer(text)["input_ids"]
    assert reply.count == body["count"] and reply.max_model_len == body["max_model_len"] == live_server.context_len
    _, detok = raw_post(live_server, "/v1/detokenize", json.dumps({"model": live_server.model,
                                                                   "tokens": body["tokens"]}).encode(),
                        live_server.api_key)
    assert detok == {"prompt": text}


def test_grpc_cancel_mid_stream_frees_the_slot(live_server):
    from protocols import inference_pb2 as pb

    free_before = wait_all_slots_free(live_server)["free_slots"]
    generated_before = backend_health(live_server).generated_tokens
    channel, stub = grpc_stub(live_server)
    with channel:
        call = stub.Generate(pb.GenerateRequest(model=live_server.model, prompt="Write a long story about a dragon.",
                                                max_tokens=1500, ignore_eos=True), metadata=grpc_auth(live_server),
                             timeout=120)
        for _ in range(3):
            next(call)
        assert gateway_health(live_server)["backends"][0]["in_flight"] == 1
        call.cancel()
        after = wait_all_slots_free(live_server, timeout_s=10)
        assert after["free_slots"] == free_before
        assert backend_health(live_server).generated_tokens - generated_before < 1500
        replies = list(stub.Generate(pb.GenerateRequest(model=live_server.model, prompt="Hi", max_tokens=3),
                                     metadata=grpc_auth(live_server), timeout=60))
    assert replies[-1].usage.completion_tokens == 3


def test_grpc_health_reflection_and_auth(live_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from protocols import inference_pb2 as pb

    channel, stub = grpc_stub(live_server)
    with channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert "blink.inference.v1.Inference" in ProtoReflectionDescriptorDatabase(channel).get_services()
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(pb.TokenizeRequest(model=live_server.model, prompt="x"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_metrics_count_a_live_request(client, live_server):
    wait_all_slots_free(live_server)
    model = {"model_name": live_server.model}
    before = scrape_metrics(live_server)
    resp = client.completions.create(model=live_server.model, prompt="Count: one, two,", max_tokens=6, temperature=0)
    deadline = time.monotonic() + 5
    while True:
        after = scrape_metrics(live_server)
        key = ("blink:e2e_request_latency_seconds_count", tuple(model.items()))
        if after.get(key, 0) > before.get(key, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def delta(name, **labels):
        key = (name, tuple(sorted({**model, **labels}.items())))
        return after.get(key, 0) - before.get(key, 0)
    assert delta("blink:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("blink:generation_tokens_total") == resp.usage.completion_tokens == 6
    assert delta("blink:request_success_total", finished_reason="length") == 1
    backend = tuple(sorted({**model, "backend": live_server.control}.items()))
    assert after[("blink:backend_healthy", backend)] == 1
    assert after[("blink:kv_cache_usage_perc", backend)] == 0  # idle: the engine holds no blocks
