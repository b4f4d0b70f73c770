"""Several `blink serve` instances on one machine (issue 21, item 1): each gets its own control port, a
listener that cannot bind stops its instance with a message naming the port and the flag, and a gateway
never adopts a ring that another instance's backend announces."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.backends.transports import BackendConnectError
from gateway.config import GatewayConfig
from gateway.server import start_gateway
from gpu_backend.control_server import ControlServer, Description
from protocols.ring import RING_VERSION, RingGeometry
from protocols.shm import create_ring
from tests.conftest import ROOT, _describe, _wait_health, free_port

KEY = "first-run-" + os.urandom(4).hex()
PROMPT = "The capital of France is"
SMALL = ["--context-len", "512", "--kv-cache-mb", "64", "--num-slots", "8", "--threads", "1"]


class Instance:
    """One `blink serve` with the default control port (a free one), as a user starts it."""

    def __init__(self, *extra: str):
        self.port, self.grpc_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", str(self.port), "--grpc-port",
               str(self.grpc_port), *SMALL, *extra]
        env = {**os.environ, "BLINK_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def wait(self) -> None:
        _wait_health(self.url + "/health", self.proc, timeout_s=600)

    def greedy(self) -> str:
        model = self.client.models.list().data[0].id
        r = self.client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        return r.choices[0].text

    def control(self) -> str:
        import json
        import urllib.request
        with urllib.request.urlopen(self.url + "/health", timeout=10) as resp:
            return json.loads(resp.read())["backends"][0]["addr"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


ADMIN_KEY = "first-run-admin-" + os.urandom(4).hex()


@pytest.fixture(scope="module")
def two_instances():
    """The first instance alone (its greedy answer then), then a second beside it with --admin-key."""
    first = Instance()
    try:
        first.wait()
        alone = first.greedy()
        second = Instance("--admin-key", ADMIN_KEY)
        try:
            second.wait()
            yield first, second, alone
        finally:
            second.stop()
    finally:
        first.stop()


@pytest.mark.slow
def test_two_instances_serve_their_own_requests_concurrently(two_instances):
    first, second, alone = two_instances
    controls = first.control(), second.control()
    assert controls[0] != controls[1]
    assert _describe(controls[0]).ring_name != _describe(controls[1]).ring_name
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda inst: inst.greedy(), [first, second, first, second]))
    assert answers == [alone] * 4


def blinkctl(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("BLINK_URL", "BLINK_ADMIN_KEY")}
    return subprocess.run([sys.executable, "-m", "blink.ctl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**environ, **env})


@pytest.mark.slow
def test_serve_admin_key_opens_the_admin_api_and_blinkctl_takes_the_v1_url(two_instances):
    first, second, _ = two_instances
    done = blinkctl("status", BLINK_URL=second.url + "/v1", BLINK_ADMIN_KEY=ADMIN_KEY)
    assert done.returncode == 0, done.stderr
    assert second.control() in done.stdout and "requests in flight" in done.stdout
    done = blinkctl("status", "--url", first.url + "/v1/", "--admin-key", ADMIN_KEY)
    assert done.returncode == 1
    assert "403" in done.stderr and "blink serve --admin-key" in done.stderr and "BLINK_ADMIN_KEY" in done.stderr


def test_blinkctl_without_a_key_says_so():
    done = blinkctl("status", "--url", f"http://127.0.0.1:{free_port()}")  # nothing listens: no call is made
    assert done.returncode == 2
    assert "no admin key given" in done.stderr and "BLINK_ADMIN_KEY" in done.stderr


def _listening_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--control-port"])
def test_a_taken_port_stops_serve_naming_port_and_flag(flag):
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        args = {"--port": str(free_port()), "--grpc-port": str(free_port()), flag: str(port)}
        cmd = [sys.executable, "-m", "blink.cli", "serve", *(x for kv in args.items() for x in kv)]
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "BLINK_API_KEY": KEY})
    assert done.returncode == 2
    assert f"127.0.0.1:{port}" in done.stderr and flag in done.stderr
    assert time.monotonic() - started < 60  # before any model is loaded


def test_a_taken_control_port_stops_the_backend_before_it_loads_a_model():
    with _listening_socket() as taken:
        control = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run([sys.executable, "-m", "blink.cli", "backend", "--control", control, "--ring",
                               f"blink-taken-{os.getpid()}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert control in done.stderr and "--control" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture()
def ring_and_desc(model_dir, byte_tokenizer):
    ring = create_ring(f"blink-first-run-{os.getpid()}", RingGeometry(4, 64, 8, 4), "fp-first-run")
    desc = Description("tiny", str(model_dir), "fp-first-run", 64, byte_tokenizer.get_vocab_size(), (0,), "echo")
    yield ring, desc
    ring.close()


def test_a_second_control_server_on_a_port_fails_instead_of_sharing_it(ring_and_desc):
    ring, desc = ring_and_desc
    address = f"127.0.0.1:{free_port()}"
    first = ControlServer(address, desc, ring)
    first.start()
    try:
        with pytest.raises(OSError, match=address):  # grpc's SO_REUSEPORT would let it share the port
            ControlServer(address, desc, ring)
    finally:
        first.stop(0)


def test_the_gateway_refuses_a_backend_that_announces_another_ring(ring_and_desc):
    ring, desc = ring_and_desc
    address = f"127.0.0.1:{free_port()}"
    control = ControlServer(address, desc, ring)
    control.start()
    config = GatewayConfig(port=0, grpc_port=0, backend_addrs=(address,), connect_timeout_s=10,
                           expect_ring="blink-another-instance")
    try:
        with pytest.raises(BackendConnectError, match=f"{ring.name}.*blink-another-instance"):
            asyncio.run(start_gateway(config))
    finally:
        control.stop(0)


def test_the_gateway_refuses_a_backend_of_another_ring_version_by_name(ring_and_desc, monkeypatch):
    """A backend from another release (e.g. ring version 2: no kv_block_size in its geometry) is refused at
    connect with the two versions named, not with a traceback about its geometry."""
    ring, desc = ring_and_desc
    real = Description.to_reply

    def older(self, *args):
        reply = real(self, *args)
        reply.ring_version, reply.geometry.kv_block_size = RING_VERSION - 1, 0
        return reply
    monkeypatch.setattr(Description, "to_reply", older)
    address = f"127.0.0.1:{free_port()}"
    control = ControlServer(address, desc, ring)
    control.start()
    config = GatewayConfig(port=0, grpc_port=0, backend_addrs=(address,), connect_timeout_s=10)
    try:
        with pytest.raises(BackendConnectError, match=f"ring version {RING_VERSION - 1}, this side {RING_VERSION}"):
            asyncio.run(start_gateway(config))
    finally:
        control.stop(0)


def test_expect_ring_names_one_backend():
    with pytest.raises(ValueError, match="expect_ring"):
        GatewayConfig(backend_addrs=("a:1", "b:2"), expect_ring="blink-1")


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_gateway_on_a_taken_port_fails_naming_port_and_flag(echo_backend, flag):
    control, _, _ = echo_backend
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--grpc-port": str(free_port()), flag: str(port)}
        done = subprocess.run([sys.executable, "-m", "gateway", "--backend", control, "--connect-timeout", "10",
                               *(x for kv in ports.items() for x in kv)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in done.stderr and flag in done.stderr and "Traceback" not in done.stderr
