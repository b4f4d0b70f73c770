"""A real gateway process over TLS (uvloop, signals, its own log) in front of the echo engine's control plane
(tests/gateway/conftest.py `echo_backend`): a certificate swapped and reloaded with SIGHUP while a stream
goes on, and a run with keys and a TLS key whose log must hold none of them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2
import openai
import pytest

from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc
from tls_pki import Pair, Pki, make_pki, served_name

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-echo"  # what the echo_backend fixture describes
PROMPT = "hello world hello there"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    log_path: Path
    port: int
    grpc_port: int

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout_s: float = 30, after: int = 0, count: int = 1) -> None:
        """Until `text` shows in the log past character `after` (`count` times)."""
        deadline = time.monotonic() + timeout_s
        while self.log()[after:].count(text) < count:
            assert self.proc.poll() is None, f"the gateway exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"{text!r} not logged:\n{self.log()}"
            time.sleep(0.05)

    def reload(self, expect: str, count: int = 1) -> None:
        """SIGHUP, then wait for the reload's verdict in the log (from `count` workers)."""
        mark = len(self.log())
        self.proc.send_signal(signal.SIGHUP)
        self.wait_for_log(expect, after=mark, count=count)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(timeout=30) == 0


@pytest.fixture()
def start_gateway(echo_backend, tmp_path, pick_free_port):
    """`start_gateway(live_pair, *flags)`: `python -m gateway` over TLS with the certificate files of
    `live_pair` (copies the test may overwrite), its log in tmp_path; stopped after the test."""
    control, _, _ = echo_backend
    started = []

    def start(live: Pair, *flags: str) -> GatewayProcess:
        port, grpc_port = pick_free_port(), pick_free_port()
        log_path = tmp_path / "gateway.log"
        cmd = [sys.executable, "-m", "gateway", "--backend", control, "--port", str(port), "--grpc-port",
               str(grpc_port), "--connect-timeout", "10", "--ssl-certfile", str(live.cert), "--ssl-keyfile",
               str(live.key), *flags]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log,
                                    stderr=subprocess.STDOUT)
        gateway = GatewayProcess(proc, log_path, port, grpc_port)
        started.append(gateway)
        gateway.wait_for_log("gateway listening on")
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def _live_copy(pair: Pair, tmp_path: Path) -> Pair:
    live = Pair(tmp_path / "live.pem", tmp_path / "live.key")
    _swap(live, pair)
    return live


def _swap(live: Pair, new: Pair) -> None:
    shutil.copyfile(new.cert, live.cert)
    shutil.copyfile(new.key, live.key)


def test_sighup_serves_a_new_certificate_while_an_open_stream_finishes(start_gateway, echo_backend, pki, tmp_path):
    _, engine, _ = echo_backend
    live = _live_copy(pki.server, tmp_path)
    gateway = start_gateway(live, "--api-key", "k")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=30,
                           http_client=httpx2.Client(verify=pki.client_context()))
    expected = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12).choices[0].text
    assert served_name(gateway.port, pki.client_context()) == "server"
    engine.step_s = 0.25  # 12 tokens take 3 s: the stream is open across the reload
    try:
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True)
        chunks = [next(stream)]
        _swap(live, pki.server2)
        gateway.reload("TLS certificate reloaded")
        reloaded_s = time.monotonic()
        assert served_name(gateway.port, pki.client_context()) == "server2"
        assert served_name(gateway.grpc_port, pki.client_context(), alpn="h2") == "server2"
        for chunk in stream:
            chunks.append(chunk)
        finished_s = time.monotonic()
    finally:
        engine.step_s = 0.001
    assert finished_s - reloaded_s > 0.5  # the stream really went on past the reload
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    # The new certificate serves requests (same CA); a reload of a key that does not match keeps it.
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].text
    shutil.copyfile(pki.client.key, live.key)
    gateway.reload("TLS reload refused")
    assert served_name(gateway.port, pki.client_context()) == "server2"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].finish_reason == "length"


def test_every_worker_reloads_on_sighup(start_gateway, pki, tmp_path):
    """`--workers 2`: the supervisor passes SIGHUP on; whichever worker a connection reaches shows the new one."""
    live = _live_copy(pki.server, tmp_path)
    gateway = start_gateway(live, "--workers", "2")
    gateway.wait_for_log("gateway listening on", count=2)
    _swap(live, pki.server2)
    gateway.reload("TLS certificate reloaded", count=2)
    assert {served_name(gateway.port, pki.client_context()) for _ in range(8)} == {"server2"}
    assert gateway.proc.poll() is None  # SIGHUP did not end the supervisor


def _requests(gateway: GatewayProcess, pki: Pki, admin_url: str, keys: dict[str, str]) -> list[str]:
    """Good and bad calls of every kind; returns the response bodies (checked for secrets too)."""
    verify, bodies = pki.client_context(), []

    def call(method, url, key, expect, **kwargs):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        reply = httpx2.request(method, url, headers=headers, verify=verify, timeout=10, **kwargs)
        assert reply.status_code == expect, (url, reply.text)
        bodies.append(reply.text)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    api = gateway.url + "/v1/chat/completions"
    call("POST", api, keys["api"], 200, json=chat)
    call("POST", api, keys["api"], 200, json={**chat, "stream": True})
    call("POST", api, keys["wrong_api"], 401, json=chat)
    call("POST", api, keys["admin"], 403, json=chat)
    call("POST", api, keys["api"], 400, content=b"{not json")
    for key, expect in ((keys["wrong_admin"], 401), (keys["api"], 403), (keys["admin"], 200)):
        call("GET", admin_url + "/admin/status", key, expect)
    call("GET", admin_url + "/admin/keys", keys["admin"], 200)
    for key, expect in ((None, 401), (keys["wrong_metrics"], 401), (keys["metrics"], 200)):
        call("GET", admin_url + "/metrics", key, expect)
    with grpc.secure_channel(f"127.0.0.1:{gateway.grpc_port}", grpc.ssl_channel_credentials(pki.ca.read_bytes())) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(model=MODEL, prompt=PROMPT),
                 metadata=(("authorization", f"Bearer {keys['wrong_api']}"),), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bodies.append(info.value.details())
    return bodies


def _pem_body(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("-----")]


def test_keys_and_the_private_key_never_reach_the_log(start_gateway, pki, tmp_path, pick_free_port):
    keys = {name: f"{name}-{os.urandom(8).hex()}" for name in
            ("api", "admin", "metrics", "wrong_api", "wrong_admin", "wrong_metrics")}
    live = _live_copy(pki.server, tmp_path)
    admin_port = pick_free_port()
    gateway = start_gateway(live, "--api-key", keys["api"], "--admin-key", keys["admin"], "--metrics-key",
                            keys["metrics"], "--admin-port", str(admin_port), "--log-level", "DEBUG")
    bodies = _requests(gateway, pki, f"https://127.0.0.1:{admin_port}", keys)
    shutil.copyfile(pki.client.key, live.key)  # a reload that fails: its error names files, not key bytes
    gateway.reload("TLS reload refused")
    gateway.stop()
    log = gateway.log()
    assert "TLS on" in log and "TLS reload refused" in log  # the run reached the TLS paths
    leaked = [name for name, key in keys.items() if key in log or any(key in body for body in bodies)]
    assert not leaked, f"keys in the log or in replies: {leaked}"
    for key_file in (pki.server.key, pki.client.key):
        assert not [line for line in _pem_body(key_file) if line in log], f"{key_file.name}'s PEM body is in the log"
    assert "PRIVATE KEY" not in log


@pytest.mark.slow
def test_blink_serve_over_mutual_tls_with_the_demo_model(pki, tmp_path, pick_free_port):
    """`blink serve` passes the TLS flags to its gateway, and mutual TLS between them (control plane and tcp
    agent): the official client chats with the demo model, and no private key's PEM lines reach the output."""
    port, grpc_port, key = pick_free_port(), pick_free_port(), "serve-" + os.urandom(6).hex()
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
           "--ring", f"blink-tls-test-{os.getpid()}", "--context-len", "2048", "--kv-cache-mb", "128",
           "--num-slots", "4", "--ssl-certfile", str(pki.server.cert), "--ssl-keyfile", str(pki.server.key),
           "--ssl-ca-certs", str(pki.ca), "--ssl-cert-reqs", "2",
           "--transport", "tcp", "--listen", f"127.0.0.1:{pick_free_port()}",
           "--control-ssl-certfile", str(pki.server2.cert), "--control-ssl-keyfile", str(pki.server2.key),
           "--control-ssl-ca-certs", str(pki.ca), "--backend-ssl-certfile", str(pki.client.cert),
           "--backend-ssl-keyfile", str(pki.client.key), "--backend-ssl-ca-certs", str(pki.ca)]
    out_path = tmp_path / "serve.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "BLINK_API_KEY": key, "PYTHONUNBUFFERED": "1"},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "blink serving the OpenAI API on https://" not in out_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, out_path.read_text(errors="replace")
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120,
                               http_client=httpx2.Client(verify=pki.client_context(pki.client)))
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Say hello."}]
        full = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert full.choices[0].message.content and streamed == full.choices[0].message.content
        with pytest.raises(httpx2.TransportError):  # no client certificate
            httpx2.get(f"https://127.0.0.1:{port}/health", verify=pki.client_context(), timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = out_path.read_text(errors="replace")
    assert "control-plane TLS on" in out and "CN=client" in out  # the agent's session is the gateway's certificate
    for key_file in (pki.server.key, pki.server2.key, pki.client.key):
        assert not [line for line in _pem_body(key_file) if line in out], f"{key_file.name}'s PEM body is in the output"
    assert "PRIVATE KEY" not in out
