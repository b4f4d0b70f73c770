"""`--workers 2`: two gateway processes on one port share one backend's ring, slot by slot; the HTTP port's
connections passed by the supervisor (`--worker-balance connections`) or hashed by SO_REUSEPORT (`kernel`)."""

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

import pytest

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


@pytest.mark.parametrize("balance", ["connections", "kernel"])
def test_two_workers_share_one_port(echo_backend, pick_free_port, balance):
    control, engine, loop = echo_backend
    port, grpc_port = pick_free_port(), pick_free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway", "--backend", control, "--port", str(port), "--grpc-port", str(grpc_port),
           "--workers", "2", "--api-key", "client-k", "--admin-key", "admin-k", "--connect-timeout", "10",
           "--worker-balance", balance]
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
    from protocols.shm import RingFull, SqLock, attach_ring, create_ring
    from protocols.shm_consumer import RingConsumer
    from protocols.shm_producer import ShmProducer

    ring = create_ring(f"blink-split-test-{os.getpid()}", RingGeometry(8, 16, 4, 2), "fp")
    try:
        lock_path = str(tmp_path / "sq.lock")
        producers = [ShmProducer(attach_ring(ring.name), slots=range(i, 8, 2), sq_lock=SqLock(lock_path))
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


# ---------------------------------------------------------------- limits across workers


def _open_on_workers(port: int, admin_key: str, per_worker: int) -> dict[int, list]:
    """Keep-alive connections grouped by the worker (pid) that accepted them: SO_REUSEPORT picks the
    worker when a connection opens, so a connection's first answer tells which one holds it."""
    import http.client

    by_pid: dict[int, list] = {}
    for _ in range(80):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/admin/status", headers={"Authorization": f"Bearer {admin_key}"})
        resp = conn.getresponse()
        by_pid.setdefault(json.loads(resp.read())["pid"], []).append(conn)
        if len(by_pid) == 2 and all(len(c) >= per_worker for c in by_pid.values()):
            return by_pid
    raise AssertionError(f"connections did not reach both workers: {({p: len(c) for p, c in by_pid.items()})}")


def _post(conn, key: str, body: dict) -> tuple[int, dict, dict]:
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), dict(resp.getheaders())


def test_key_limits_hold_across_workers(echo_backend, pick_free_port, tmp_path):
    """max_streams and requests_per_minute count a key's requests on every worker together."""
    from concurrent.futures import ThreadPoolExecutor

    from gateway.policy.keys import KeyLimits, KeyStore

    control, engine, _ = echo_backend
    store = KeyStore(tmp_path / "keys.yaml")
    streams_key = store.add("streams", limits=KeyLimits(max_streams=2))
    rpm_key = store.add("rpm", limits=KeyLimits(requests_per_minute=4))
    port = pick_free_port()
    cmd = [sys.executable, "-m", "gateway", "--backend", control, "--port", str(port), "--grpc-port", "0",
           "--workers", "2", "--keys", str(tmp_path / "keys.yaml"), "--admin-key", "admin-k",
           "--connect-timeout", "10"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3}
    try:
        _wait_both_workers(f"http://127.0.0.1:{port}", proc)
        (a, b) = _open_on_workers(port, "admin-k", per_worker=4).values()
        engine.paused = True  # requests stay in flight (no token comes)
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(_post, a[0], streams_key, body), pool.submit(_post, b[0], streams_key, body)]
            _wait_in_flight(a[1], "streams", 2)
            for conn in (a[1], b[1]):  # one in flight on each worker: per worker, a third would pass
                status, reply, headers = _post(conn, streams_key, body)
                assert status == 429 and "max_streams" in reply["error"]["message"], reply
                assert headers["Retry-After"] == "1"
            engine.paused = False
            assert [f.result(timeout=20)[0] for f in held] == [200, 200]
        assert _post(a[1], streams_key, body)[0] == 200  # freed on both workers alike
        statuses = [_post(conn, rpm_key, body)[0] for conn in (a[2], b[2], a[2], b[2], a[3], b[3])]
        assert statuses == [200, 200, 200, 200, 429, 429], statuses  # 4 per minute for the gateway, not per worker
    finally:
        engine.paused = False
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not list(Path("/dev/shm").glob(f"blink-gateway-{port}-*.limits"))  # the supervisor removed its table


def _wait_both_workers(url: str, proc: subprocess.Popen) -> None:
    pids, deadline = set(), time.monotonic() + 60
    while len(pids) < 2:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"only workers {pids} answered"
        try:
            pids.add(_call(url + "/admin/status", "admin-k")[1]["pid"])
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)


def _wait_in_flight(conn, key_name: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        conn.request("GET", "/admin/status", headers={"Authorization": "Bearer admin-k"})
        seen = json.loads(conn.getresponse().read())["in_flight_by_key"].get(key_name)
        if seen == count:
            return
        assert time.monotonic() < deadline, f"in flight for {key_name}: {seen}, expected {count}"
        time.sleep(0.05)


# ---------------------------------------------------------------- connections spread by load


def _worker_of(conn, admin_key: str) -> int:
    conn.request("GET", "/admin/status", headers={"Authorization": f"Bearer {admin_key}"})
    resp = conn.getresponse()
    return json.loads(resp.read())["pid"]


def test_new_connections_go_to_the_worker_with_the_fewest_open(echo_backend, pick_free_port):
    """--worker-balance connections (the default): the supervisor passes each new connection to the worker with
    the fewest open. Under SO_REUSEPORT's hash (--worker-balance kernel) 8 connections split 4/4 about one time
    in four, and 3 new ones all reach the worker whose connections closed one time in eight."""
    import http.client

    control, _, _ = echo_backend
    port, grpc_port = pick_free_port(), pick_free_port()
    cmd = [sys.executable, "-m", "gateway", "--backend", control, "--port", str(port), "--grpc-port", str(grpc_port),
           "--workers", "2", "--api-key", "client-k", "--admin-key", "admin-k", "--connect-timeout", "10"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    conns: list = []
    try:
        deadline = time.monotonic() + 60
        while True:  # both workers up: two connections open at once reach two workers (a worker gets
            # connections from its first report on)
            assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the workers did not start"
            pair = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(2)]
            try:
                if len({_worker_of(c, "admin-k") for c in pair}) == 2:
                    break
            except (OSError, http.client.HTTPException):
                pass
            finally:
                for c in pair:
                    c.close()
            time.sleep(0.2)
        time.sleep(1.0)  # those probes' connections closed and reported
        by_pid: dict[int, list] = {}
        for _ in range(8):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conns.append(conn)
            by_pid.setdefault(_worker_of(conn, "admin-k"), []).append(conn)
        assert sorted(len(c) for c in by_pid.values()) == [4, 4], {p: len(c) for p, c in by_pid.items()}
        for conns_of in by_pid.values():  # each worker counts its own in /admin/status
            conns_of[0].request("GET", "/admin/status", headers={"Authorization": "Bearer admin-k"})
            assert json.loads(conns_of[0].getresponse().read())["connections"] == 4
        emptied, kept = list(by_pid)
        for conn in by_pid[emptied][:3]:
            conn.close()
        time.sleep(1.0)  # the worker reports its open connections within balance.REPORT_S (0.05 s)
        new = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(3)]
        conns.extend(new)
        assert [_worker_of(c, "admin-k") for c in new] == [emptied] * 3
        # a passed connection serves requests like any other
        status, body, _ = _post(new[0], "client-k", {"model": MODEL, "prompt": "hello world", "max_tokens": 3})
        assert status == 200 and body["choices"][0]["text"]
    finally:
        for conn in conns:
            conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # a port that is taken fails the supervisor's start with the flag to change, as a single gateway does
    with __import__("socket").create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        out = subprocess.run([*cmd[:5], "--port", str(busy), "--grpc-port", str(pick_free_port()), *cmd[9:]],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot listen for HTTP" in out.stderr and "--port" in out.stderr, out.stderr
