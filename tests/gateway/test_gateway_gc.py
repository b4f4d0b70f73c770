"""The gateway's garbage-collector policy (gateway/gc_policy.py), and requests that make no reference cycles."""

from __future__ import annotations

import asyncio
import collections
import gc
import http.client
import json
import urllib.request

import grpc
import openai
import pytest

from blink.ctl import main as blinkctl
from gateway.gc_policy import THRESHOLDS, GcPolicy
from protocols import inference_pb2, inference_pb2_grpc


class Cycle:
    """Two of these that point at each other are freed only by the cyclic collector."""

    def __init__(self):
        self.other = None


def make_cycle() -> None:
    a, b = Cycle(), Cycle()
    a.other, b.other = b, a


@pytest.fixture()
def restore_gc():
    """Whatever a test does to the collector of this (pytest's) process is undone after it."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    gc.set_debug(0)


def blocks(n: int) -> list:
    """n more small-object blocks (an empty list is one)."""
    return [[] for _ in range(n)]


def young_objects() -> list:
    return [o for generation in range(3) for o in gc.get_objects(generation)]


def test_a_tick_takes_the_survivors_out_of_the_collectors_sight(restore_gc):
    policy = GcPolicy(freeze_s=0.1)
    survivor = [Cycle() for _ in range(100)]
    assert any(o is survivor[0] for o in young_objects())
    policy.tick()
    young = young_objects()
    assert not any(o is survivor[0] or o is survivor for o in young)
    assert gc.get_count()[0] < 100  # the allocation count starts again: no collection is due
    del survivor  # frozen objects are still freed by refcounting (weakrefs would fail otherwise)


def test_frozen_objects_are_freed_by_refcounting(restore_gc):
    import weakref

    policy = GcPolicy(freeze_s=0.1)
    obj = Cycle()
    ref = weakref.ref(obj)
    policy.tick()
    del obj
    assert ref() is None


def test_growth_past_the_limit_runs_a_full_collection_that_frees_frozen_cycles(restore_gc):
    policy = GcPolicy(freeze_s=0.1, full_growth_blocks=20_000)
    asyncio.run(_start_and_stop(policy))
    for _ in range(50):
        make_cycle()
    policy.tick()  # the cycles are frozen now: no automatic collection would ever free them
    assert policy.full_collections == 0
    held = blocks(30_000)  # the process grows by over 20,000 blocks
    policy.tick()
    assert policy.full_collections == 1 and policy.last_full["reason"] == "growth"
    assert policy.last_full["unreachable"] >= 100  # the 50 cycles' 100 objects (and their dicts)
    policy.tick()  # measured from the count after the collection: no second one
    assert policy.full_collections == 1
    del held


def test_growth_counts_from_the_policys_making_not_from_an_empty_process(restore_gc):
    held = blocks(30_000)
    policy = GcPolicy(freeze_s=0.1, full_growth_blocks=20_000)
    policy.tick()
    assert policy.full_collections == 0
    del held


def test_the_limit_counts_from_the_lowest_size_since_the_last_full_collection(restore_gc):
    policy = GcPolicy(freeze_s=0.1, full_growth_blocks=20_000)
    asyncio.run(_start_and_stop(policy))
    held = blocks(15_000)
    policy.tick()
    del held  # the live set shrinks: the floor follows it down
    policy.tick()
    held = blocks(15_000)  # 15,000 over the floor, not 30,000 over the start
    policy.tick()
    assert policy.full_collections == 0
    held += blocks(10_000)
    policy.tick()
    assert policy.full_collections == 1


def test_an_asked_for_collection_names_what_it_found(restore_gc):
    policy = GcPolicy(freeze_s=0)
    for _ in range(30):
        make_cycle()
    report = policy.full_collection(by_type=True)
    assert report["reason"] == "asked" and report["unreachable"] >= 60
    assert report["by_type"]["Cycle"] == 60
    assert not gc.garbage  # counted, then freed


@pytest.mark.parametrize("freeze_s, name", [(0.1, "freeze"), (0, "python")])
def test_young_collections_wait_for_20000_allocations(restore_gc, freeze_s, name):
    policy = GcPolicy(freeze_s=freeze_s)
    asyncio.run(_start_and_stop(policy))
    assert gc.get_threshold() == THRESHOLDS and policy.report()["policy"] == name


def test_settings_are_checked():
    with pytest.raises(ValueError):
        GcPolicy(freeze_s=-1)
    with pytest.raises(ValueError):
        GcPolicy(full_growth_blocks=0)


async def _start_and_stop(policy: GcPolicy) -> None:
    policy.start()
    policy.stop()


def admin_gc(live_server) -> dict:
    req = urllib.request.Request(live_server.root_url + "/admin/gc", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {live_server.admin_key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_requests_leave_no_cyclic_garbage(live_server, live_client, capsys):
    """Every object a request makes is freed by refcounting when it ends: the gateway's collector stays out of
    the streaming path only while that holds (gateway/gc_policy.py). Streamed and not, both endpoints,
    several choices, stop strings, logprobs, echo, a client that leaves mid-stream and a 400; gRPC apart."""
    # what earlier tests left; through blinkctl once
    assert blinkctl(["gc", "--url", live_server.root_url, "--admin-key", live_server.admin_key]) == 0
    assert "unreachable objects freed in" in capsys.readouterr().out
    client, model = live_client, live_server.model
    for stream in (False, True):
        for _ in range(3):
            out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                            stream=stream, n=2, stop=["\n"], logprobs=2 if stream else None,
                                            echo=not stream)
            if stream:
                list(out)
            out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=8, stream=stream, logprobs=True, top_logprobs=2,
                                                 stream_options={"include_usage": True} if stream else None)
            if stream:
                list(out)
    with client.completions.create(model=model, prompt="Once upon a time", max_tokens=200, stream=True) as out:
        next(iter(out))  # and the client goes away
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    status = admin_status(live_server)
    assert status["gc"]["policy"] == "freeze"
    report = admin_gc(live_server)
    assert report["unreachable"] == 0, f"requests left reference cycles: {report['by_type']}"
    # gRPC: grpcio's server makes one small cycle per call itself (a handler lookup's scope and the call's
    # metadata, ~6 objects), ours none; the full collections bound it.
    calls = 3
    with grpc.insecure_channel(live_server.grpc_addr) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(calls):
            replies = list(stub.Generate(
                inference_pb2.GenerateRequest(model=model, prompt="The capital of France is", max_tokens=8),
                metadata=(("authorization", f"Bearer {live_server.api_key}"),), timeout=120))
            assert replies[-1].finish_reason
    report = admin_gc(live_server)
    assert report["unreachable"] <= 8 * calls, f"gRPC calls left reference cycles: {report['by_type']}"
    assert not any(name.split()[0] in OUR_TYPES for name in report["by_type"]), report["by_type"]


OUR_TYPES = {"Generation", "RequestHandle", "Choices", "TextStream", "ChatFormat", "CompletionFormat",
             "TextTemplates", "RequestSpec", "UpdateQueue", "Piece", "SseBody", "InferenceServicer"}


def admin_status(live_server) -> dict:
    req = urllib.request.Request(live_server.root_url + "/admin/status",
                                 headers={"Authorization": f"Bearer {live_server.admin_key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


ERROR_TOKEN = "<|endoftext|>"  # prompt [ERROR_TOKEN, n, ...]: the echo engine fails after n tokens (conftest.py)


def gateway_garbage() -> dict[str, int]:
    """One collection of this process (the in-process gateway's too): the unreachable objects that are the
    gateway's own (its classes, its functions and coroutines), by type."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        ours = [o for o in gc.garbage if _ours(o)]
        found = dict(collections.Counter(type(o).__qualname__ for o in ours))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()
    return found


def _ours(obj) -> bool:
    code = getattr(obj, "__code__", None) or getattr(obj, "cr_code", None)
    if code is not None:
        return "/gateway/" in code.co_filename or "/protocols/" in code.co_filename
    return type(obj).__module__.startswith(("gateway.", "protocols."))


def stream_events(harness, body: dict, read_all: bool = True) -> bytes:
    conn = http.client.HTTPConnection(harness.url.removeprefix("http://"), timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {harness.api_key}",
                                                               "Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read() if read_all else resp.read1(64)  # or the client goes away after its first bytes
    conn.close()
    return data


def test_error_paths_leave_no_cyclic_garbage_of_the_gateway(harness):
    """The live test's requests plus what it cannot reach: an engine failing before the first token and
    mid-stream, n over the ring, wrong keys, a client gone mid-stream, unknown models."""
    gateway_garbage()  # what start-up left
    model, err = harness.model, harness.tokenizer.token_to_id(ERROR_TOKEN)
    hello = harness.tokenizer.encode("hello world").ids
    for _ in range(2):
        assert harness.post("/v1/completions", {"model": model, "prompt": [err, 0, 5, 6]})[0] == 500
        events = stream_events(harness, {"model": model, "prompt": [err, 3, *hello], "stream": True, "n": 2})
        assert b'"error"' in events and events.endswith(b"data: [DONE]\n\n")
        assert harness.post("/v1/completions", {"model": model, "prompt": "hi", "n": 5})[0] == 400
        assert harness.post("/v1/completions", {"model": model, "prompt": "hi"}, key="wrong")[0] == 401
        assert harness.post("/v1/completions", {"model": "nope", "prompt": "hi"})[0] == 404
        assert harness.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4, "stop": ["l"]})[0] == 200
        stream_events(harness, {"model": model, "prompt": hello, "stream": True, "max_tokens": 16}, read_all=False)
        harness.wait_idle()
    assert gateway_garbage() == {}
