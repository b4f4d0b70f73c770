"""Overload against the in-process echo engine (4 ring slots): a burst of three times the slots while the
engine holds them gets service or a 503 with Retry-After (gRPC: UNAVAILABLE with `retry-after`), never a
hang, after `slot_wait_s`; each shed request shows in `blink:num_requests_shed_total`.
The same against a real cpu backend: tests/gateway/test_gateway_overload_live.py."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from gateway.config import GatewayConfig
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc
from test_gateway_metrics import delta, scrape, scrape_until, value

SLOT_WAIT_S = 1.0
NUM_SLOTS = 4  # the harness's ring (tests/gateway/conftest.py GEOMETRY)
SHED = "blink:num_requests_shed_total"


@pytest.fixture(scope="module")
def harness(start_harness, pick_free_port):
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({"k"}),
                           slot_wait_s=SLOT_WAIT_S)
    return start_harness(config, "k")


def post(harness, body: dict) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a POST to /v1/completions."""
    req = urllib.request.Request(harness.url + "/v1/completions", json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def paused(harness):
    class Paused:
        def __enter__(self):
            harness.call(setattr, harness.engine, "paused", True)

        def __exit__(self, *exc):
            harness.call(setattr, harness.engine, "paused", False)
    return Paused()


def test_a_burst_of_three_times_the_slots_is_served_or_shed_with_retry_after(harness):
    before = scrape(harness)
    bodies = [{"model": harness.model, "prompt": "hi", "max_tokens": 4, "stream": i % 2 == 1}
              for i in range(3 * NUM_SLOTS)]
    with paused(harness), concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        started = time.monotonic()
        futures = [pool.submit(post, harness, body) for body in bodies]
        time.sleep(SLOT_WAIT_S + 1.0)  # the engine holds every slot: all but NUM_SLOTS give up
        harness.call(setattr, harness.engine, "paused", False)
        results = [f.result(timeout=10) for f in futures]
    assert time.monotonic() - started < SLOT_WAIT_S + 10  # never a hang
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * NUM_SLOTS + [503] * (2 * NUM_SLOTS)
    for status, headers, body in results:
        if status == 503:
            assert headers["Retry-After"] == "1"  # whole seconds: slot_wait_s rounded up
            error = json.loads(body)["error"]
            assert error["code"] == "service_unavailable" and "retry after 1 s" in error["message"]
        else:
            assert "Retry-After" not in headers
    after = scrape_until(harness, lambda m: delta(before, m, SHED) >= 2 * NUM_SLOTS)
    assert delta(before, after, SHED) == 2 * NUM_SLOTS
    assert delta(before, after, "blink:request_rejected_total", reason="service_unavailable") == 2 * NUM_SLOTS
    harness.wait_idle()


def test_grpc_sheds_with_unavailable_and_retry_after_metadata(harness):
    before = scrape(harness)
    with grpc.insecure_channel(harness.grpc_addr) as channel, paused(harness):
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = [stub.Generate(pb.GenerateRequest(model=harness.model, prompt="hi", max_tokens=2),
                               metadata=(("authorization", "Bearer k"),), timeout=10) for _ in range(NUM_SLOTS + 1)]
        time.sleep(SLOT_WAIT_S + 1.0)
        harness.call(setattr, harness.engine, "paused", False)
        errors = []
        for call in calls:
            try:
                list(call)
            except grpc.RpcError as err:
                errors.append(err)
    assert len(errors) == 1
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert dict(errors[0].trailing_metadata())["retry-after"] == "1"
    after = scrape_until(harness, lambda m: delta(before, m, SHED) >= 1)
    assert delta(before, after, SHED) == 1
    harness.wait_idle()


def test_requests_that_fail_for_other_reasons_are_not_counted_as_shed(harness):
    before = scrape(harness)
    status, headers, _ = post(harness, {"model": "no-such-model", "prompt": "hi"})
    assert status == 404 and "Retry-After" not in headers
    assert value(scrape(harness), SHED) == value(before, SHED)


def test_the_slot_wait_comes_from_the_file_the_environment_and_the_flag(tmp_path):
    from gateway.main import config_from_args, parse_args

    path = tmp_path / "gateway.yaml"
    path.write_text("slot_wait_s: 4\n")
    assert config_from_args(parse_args([]), environ={}).slot_wait_s == 30.0  # the default
    assert config_from_args(parse_args(["--config", str(path)]), environ={}).slot_wait_s == 4
    environ = {"BLINK_SLOT_WAIT": "3"}
    assert config_from_args(parse_args(["--config", str(path)]), environ=environ).slot_wait_s == 3.0
    assert config_from_args(parse_args(["--slot-wait", "0.5"]), environ=environ).slot_wait_s == 0.5
    with pytest.raises(ValueError, match="slot_wait_s"):
        config_from_args(parse_args(["--slot-wait", "0"]), environ={})
