"""`--workers 2`: two gateway processes on one port (SO_REUSEPORT) share one backend's ring, slot by slot."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-echo"  # what the echo_backend fixture (conftest.py) describes


def _call(url: str, key: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # a new connection each time
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_two_workers_share_one_port(echo_backend, pick_free_port):
    control, engine, loop = echo_backend
    port, grpc_port = pick_free_port(), pick_free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway", "--backend", control, "--port", str(port), "--grpc-port", str(grpc_port),
           "--workers", "2", "--api-key", "client-k", "--admin-key", "admin-k", "--connect-timeout", "10"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        pids = set()
        deadline = time.monotonic() + 60
        while len(pids) < 2:  # each worker answers for itself: both must show up
            assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"only workers {pids} answered"
            try:
                status, body = _call(url + "/admin/status", "admin-k")
                assert status == 200 and body["workers"] == 2
                pids.add(body["pid"])
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        body = {"model": MODEL, "prompt": "hello world hello there", "max_tokens": 4}
        results = [_call(url + "/v1/completions", "client-k", body) for _ in range(24)]
        assert all(status == 200 and r["choices"][0]["text"] for status, r in results)
        async def ids():
            return list(engine.request_ids)
        request_ids = asyncio.run_coroutine_threadsafe(ids(), loop).result(timeout=5)
        # Each worker numbers its requests from 1: a number seen twice came from both workers.
        assert len(request_ids) == 24 and len(set(request_ids)) < 24
        _drain_reaches_every_worker(url, control, body)
        _grpc_serves(f"127.0.0.1:{grpc_port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _grpc_serves(addr: str) -> None:
    import grpc

    from protocols import inference_pb2, inference_pb2_grpc

    for _ in range(4):  # new channels: new connections, spread over the workers' gRPC servers
        with grpc.insecure_channel(addr) as ch:
            request = inference_pb2.GenerateRequest(model=MODEL, prompt="hello world", max_tokens=3)
            replies = list(inference_pb2_grpc.InferenceStub(ch).Generate(
                request, metadata=[("authorization", "Bearer client-k")], timeout=10))
            assert replies[-1].finish_reason == "length"


def _drain_reaches_every_worker(url: str, control: str, body: dict) -> None:
    from blink.ctl import main as blinkctl

    for verb, status in (("drain", 503), ("undrain", 200)):
        assert blinkctl([verb, control, "--url", url, "--admin-key", "admin-k"]) == 0  # reaches one worker
        time.sleep(1.5)  # the others read the drain file within a second
        assert {_call(url + "/v1/completions", "client-k", body)[0] for _ in range(12)} == {status}


def test_two_producers_share_a_ring_slot_by_slot(tmp_path):
    """What each worker does on an shm ring: disjoint slots, one lock around the submission queue."""
    from protocols.ring import RequestSpec, RingGeometry
    from protocols.shm import RingConsumer, RingFull, RingProducer, SqLock, attach_ring, create_ring

    ring = create_ring(f"blink-split-test-{os.getpid()}", RingGeometry(8, 16, 4, 2), "fp")
    try:
        lock_path = str(tmp_path / "sq.lock")
        producers = [RingProducer(attach_ring(ring.name), slots=range(i, 8, 2), sq_lock=SqLock(lock_path))
                     for i in range(2)]
        slots = [producers[n % 2].submit(RequestSpec(request_id=n, prompt_ids=[1, 2], max_tokens=2))
                 for n in range(8)]
        assert [s % 2 for s in slots] == [0, 1] * 4  # each producer used its own slots only
        try:
            producers[0].submit(RequestSpec(request_id=9, prompt_ids=[1], max_tokens=1))
            raise AssertionError("producer 0 has only 4 slots")
        except RingFull:
            pass
        taken = RingConsumer(ring).take_new()
        assert sorted(t.spec.request_id for t in taken) == list(range(8))
        assert len({t.seq for t in taken}) == 8  # sequence numbers stay unique across producers
    finally:
        ring.close()
