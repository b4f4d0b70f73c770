"""Shared fixtures: a live `blink serve` (CPU backend + gateway, real processes, real sockets)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def pick_free_port():
    """`free_port` for fixtures in other conftest files."""
    return free_port


@dataclass
class LiveServer:
    base_url: str  # ".../v1"
    root_url: str
    api_key: str
    model: str
    model_dir: str
    context_len: int
    control: str  # backend control-plane address
    grpc_addr: str  # the gateway's gRPC inference API
    proc: subprocess.Popen
    admin_key: str = ""  # for /admin/


def _describe(control: str):
    import grpc

    from protocols import control_pb2, control_pb2_grpc

    with grpc.insecure_channel(control) as ch:
        return control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)


def _wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"blink serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"blink serve not ready after {timeout_s} s")


@pytest.fixture(scope="session")
def live_server():
    port, control_port, grpc_port = free_port(), free_port(), free_port()
    control = f"127.0.0.1:{control_port}"
    api_key, admin_key = "test-key-" + os.urandom(6).hex(), "test-admin-" + os.urandom(6).hex()
    # the mask step limit raised: on 2 cores shared with the CPU engine one CI run stalled a structured-corpus mask
    # step past the default 5 s (its steps take 5-18 ms otherwise); a step that never ends still fails, after 60 s.
    # The limit's own behaviour: tests/gateway/test_structured_mask_watch.py, test_structured_gateway.py
    env = {**os.environ, "BLINK_API_KEY": api_key, "BLINK_ADMIN_KEY": admin_key, "PYTHONUNBUFFERED": "1",
           "BLINK_GRPC_PORT": str(grpc_port), "BLINK_MASK_STEP_LIMIT_S": "60"}
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", str(port), "--control", control,
           "--ring", f"blink-test-{os.getpid()}", "--context-len", "2048", "--kv-cache-mb", "256",
           "--num-slots", "32"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout_s=600)
        desc = _describe(control)
        yield LiveServer(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}", api_key, desc.model_name,
                         desc.model_dir, desc.context_len, control, f"127.0.0.1:{grpc_port}", proc, admin_key)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture()
def no_slot_leaks(live_server):
    """After the test, every request has left the live server's ring (use with `usefixtures`)."""
    yield
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with urllib.request.urlopen(live_server.root_url + "/health", timeout=10) as resp:
            if json.loads(resp.read())["backends"][0]["in_flight"] == 0:
                return
        time.sleep(0.1)
    raise AssertionError("ring slots still in flight after the test")


@pytest.fixture(scope="module")
def live_client(live_server):
    """The official `openai` client on the live server."""
    import openai

    return openai.OpenAI(base_url=live_server.base_url, api_key=live_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def live_tokenizer(live_server):
    """The live server's model tokenizer (the `tokenizers` library's, without special-token handling)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(live_server.model_dir) / "tokenizer.json"))
