"""/metrics: Prometheus text that prometheus_client parses, counters that move by a request's usage
(over HTTP and gRPC alike), rejections by reason, and backend gauges read from the ring header."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc

FAMILIES = {"blink:num_requests_running", "blink:num_requests_waiting", "blink:kv_cache_usage_perc",
            "blink:backend_healthy", "blink:ring_slots_in_use", "blink:prompt_tokens", "blink:generation_tokens",
            "blink:request_success", "blink:request_rejected", "blink:time_to_first_token_seconds",
            "blink:time_per_output_token_seconds", "blink:e2e_request_latency_seconds", "blink:native_streams"}


def scrape(harness) -> dict:
    """{(sample name, sorted labels): value}, fetched without an API key."""
    with urllib.request.urlopen(harness.url + "/metrics", timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def scrape_until(harness, check, timeout_s: float = 5.0) -> dict:
    """A request's metrics are recorded as its handler ends, which may be just after the client reads."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(harness)
        if check(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.02)


@pytest.fixture(scope="module")
def stub(harness):
    with grpc.insecure_channel(harness.grpc_addr) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def auth(harness):
    return (("authorization", f"Bearer {harness.api_key}"),)


def test_metrics_need_no_key_and_parse(harness):
    metrics = scrape(harness)
    with urllib.request.urlopen(harness.url + "/metrics", timeout=10) as resp:
        names = {f.name for f in text_string_to_metric_families(resp.read().decode())}
    assert FAMILIES <= names
    backend = {"model_name": harness.model, "backend": "in-process"}
    assert value(metrics, "blink:backend_healthy", **backend) == 1.0
    assert (("blink:native_streams", tuple(sorted(backend.items()))) in metrics
            and value(metrics, "blink:native_streams", **backend) == 0)  # none open


def _assert_counted(before: dict, after: dict, model: str, usage: dict, finish: str) -> None:
    m = {"model_name": model}
    assert delta(before, after, "blink:prompt_tokens_total", **m) == usage["prompt_tokens"]
    assert delta(before, after, "blink:generation_tokens_total", **m) == usage["completion_tokens"]
    assert delta(before, after, "blink:request_success_total", **m, finished_reason=finish) == 1
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert delta(before, after, f"blink:{hist}_count", **m) == 1, hist
    ttft_sum = delta(before, after, "blink:time_to_first_token_seconds_sum", **m)
    e2e_sum = delta(before, after, "blink:e2e_request_latency_seconds_sum", **m)
    assert 0 < ttft_sum <= e2e_sum < 10


def test_http_request_moves_the_counters_by_its_usage(harness):
    before = scrape(harness)
    status, body = harness.post("/v1/completions", {"model": harness.model, "prompt": "hello world",
                                                    "max_tokens": 5})
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    after = scrape_until(harness, lambda m: delta(before, m, "blink:e2e_request_latency_seconds_count",
                                                  model_name=harness.model) >= 1)
    _assert_counted(before, after, harness.model, body["usage"], "length")


def test_grpc_request_moves_the_same_counters(harness, stub):
    before = scrape(harness)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello there")])
    replies = list(stub.Generate(pb.GenerateRequest(model=harness.model, messages=messages), metadata=auth(harness),
                                 timeout=10))
    usage = replies[-1].usage
    assert replies[-1].finish_reason == "stop" and usage.completion_tokens > 1
    after = scrape_until(harness, lambda m: delta(before, m, "blink:e2e_request_latency_seconds_count",
                                                  model_name=harness.model) >= 1)
    _assert_counted(before, after, harness.model, {"prompt_tokens": usage.prompt_tokens,
                                                   "completion_tokens": usage.completion_tokens}, "stop")


def test_rejections_are_counted_by_reason(harness, stub):
    before = scrape(harness)
    assert harness.post("/v1/completions", {"model": harness.model, "prompt": "x", "temperature": 9})[0] == 400
    assert harness.post("/v1/completions", {"model": harness.model, "prompt": "x"}, key=None)[0] == 401
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(pb.GenerateRequest(model="nope", prompt="x"), metadata=auth(harness), timeout=10))
    with pytest.raises(grpc.RpcError):
        stub.Tokenize(pb.TokenizeRequest(model=harness.model, prompt="x"), timeout=10)
    after = scrape(harness)
    assert delta(before, after, "blink:request_rejected_total", reason="invalid_request") == 1
    assert delta(before, after, "blink:request_rejected_total", reason="invalid_api_key") == 2
    assert delta(before, after, "blink:request_rejected_total", reason="model_not_found") == 1
    assert delta(before, after, "blink:prompt_tokens_total", model_name=harness.model) == 0


def test_backend_gauges_follow_a_running_request(harness, stub):
    backend = {"model_name": harness.model, "backend": "in-process"}
    before = scrape(harness)
    harness.call(setattr, harness.engine, "step_s", 0.02)  # 200 tokens take seconds
    try:
        call = stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hello", max_tokens=200),
                             metadata=auth(harness), timeout=30)
        next(call)
        running = scrape(harness)
        call.cancel()
        harness.wait_idle()
    finally:
        harness.call(setattr, harness.engine, "step_s", 0.001)
    assert value(running, "blink:num_requests_running", **backend) == 1
    assert value(running, "blink:ring_slots_in_use", **backend) == 1
    assert value(running, "blink:kv_cache_usage_perc", **backend) == harness.engine.kv_blocks_per_request / harness.engine.kv_blocks
    idle = scrape_until(harness, lambda m: value(m, "blink:num_requests_running", **backend) == 0)
    assert value(idle, "blink:kv_cache_usage_perc", **backend) == 0
    assert value(idle, "blink:ring_slots_in_use", **backend) == 0
    assert delta(before, idle, "blink:request_success_total", model_name=harness.model, finished_reason="abort") == 1


def test_backend_health_gauge_drops_when_the_heartbeat_stalls(harness):
    backend = {"model_name": harness.model, "backend": "in-process"}
    harness.call(setattr, harness.backend, "stalled", True)
    try:
        assert value(scrape(harness), "blink:backend_healthy", **backend) == 0
    finally:
        harness.call(setattr, harness.backend, "stalled", False)
    assert value(scrape(harness), "blink:backend_healthy", **backend) == 1
