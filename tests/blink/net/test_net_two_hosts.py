"""Two hosts in network namespaces: the gateway in one, a CPU backend and its tcp agent in the other,
joined by a veth pair that a network profile configures (MTU 9000), with mutual TLS between them (a CA made
here: the backend's control plane and agent require the gateway's client certificate). A gateway with a
certificate from another CA is refused and says so; then OpenAI requests through the tcp transport across
the link: plain and streamed, a client that disconnects mid-stream (its slot comes back), the link going
down and up, and a backend restart (requests fail cleanly, then it serves again).

Skips with a message where namespaces cannot be created (not root). Slow: it loads the demo model.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from blink import ctl
from netns_helpers import drop_netns, make_netns

sys.path.append(str(Path(__file__).resolve().parents[2] / "gateway"))
from tls_pki import make_pki  # noqa: E402  (the TLS tests' throwaway CA)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CLONE_NEWNET = 0x40000000
GW_IP, BE_IP = "10.90.0.1", "10.90.0.2"
NUM_SLOTS = 8
KEY = "net-test-key"


def enter_netns(name: str) -> None:
    """Move the calling thread (only it) into a network namespace: its sockets are then created there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


class Hosts:
    """Two namespaces, the processes in them, and a thread pool whose threads live in the gateway's."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.gw, self.be = make_netns("blink-gw"), None
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            self.be = make_netns("blink-be")
        except BaseException:
            drop_netns(self.gw)
            raise
        self.pool = concurrent.futures.ThreadPoolExecutor(2, initializer=enter_netns, initargs=(self.gw,))
        self.ring = f"blink-net-{os.getpid()}"
        (tmp_path / "pki").mkdir()
        self.pki = make_pki(tmp_path / "pki", ips=(GW_IP, BE_IP))

    def profiles(self) -> None:
        gw = self.tmp / "gw.yaml"
        gw.write_text(f"netns: {self.gw}\nlinks:\n  - {{name: lo, state: up}}\n"
                      f"  - {{name: g0, kind: veth, peer: b0, peer_netns: {self.be}, mtu: 9000, state: up}}\n"
                      f"addresses:\n  - {{link: g0, address: {GW_IP}/24}}\n")
        be = self.tmp / "be.yaml"
        be.write_text(f"netns: {self.be}\nlinks:\n  - {{name: lo, state: up}}\n  - {{name: b0, mtu: 9000, state: up}}\n"
                      f"addresses:\n  - {{link: b0, address: {BE_IP}/24}}\n")
        assert ctl.main(["net", "apply", str(gw)]) == 0 and ctl.main(["net", "apply", str(be)]) == 0

    def spawn(self, name: str, netns: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "ab")
        env = {**os.environ, "BLINK_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-m", "blink.cli", *args],
                                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_backend(self) -> None:
        self.spawn("backend", self.be, "backend", "--mode", "cpu", "--model", "demo", "--ring", self.ring,
                   "--control", f"{BE_IP}:50051", "--transport", "tcp", "--listen", f"{BE_IP}:50053",
                   "--context-len", "512", "--kv-cache-mb", "32", "--num-slots", str(NUM_SLOTS), "--threads", "1",
                   "--control-ssl-certfile", str(self.pki.server.cert), "--control-ssl-keyfile", str(self.pki.server.key),
                   "--control-ssl-ca-certs", str(self.pki.ca))

    def start_gateway(self, name: str = "gateway", pair: str = "client") -> None:
        cert = getattr(self.pki, pair)
        self.spawn(name, self.gw, "gateway", "--host", GW_IP, "--port", "8000", "--backend", f"{BE_IP}:50051",
                   "--backend-ssl-certfile", str(cert.cert), "--backend-ssl-keyfile", str(cert.key),
                   "--backend-ssl-ca-certs", str(self.pki.ca))

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def run(self, fn, *args, timeout_s: float = 60):
        """Call `fn(*args)` on a thread inside the gateway's namespace."""
        return self.pool.submit(fn, *args).result(timeout=timeout_s)

    def link(self, state: str) -> None:
        subprocess.run(["ip", "-n", self.gw, "link", "set", "g0", state], check=True)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in self.tmp.glob("*.log"))

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        self.pool.shutdown(wait=False, cancel_futures=True)
        drop_netns(self.gw)
        drop_netns(self.be)
        subprocess.run(["rm", "-f", f"/dev/shm/{self.ring}"])


def client() -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{GW_IP}:8000/v1", api_key=KEY, max_retries=0, timeout=30)


def health() -> dict:
    req = urllib.request.Request(f"http://{GW_IP}:8000/health", headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def wait_until(cond, timeout_s: float, what: str, hosts: Hosts) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.3)
    pytest.fail(f"{what} not reached in {timeout_s} s (last error {last!r})\n{hosts.logs()}")


def chat(max_tokens: int = 8, stream: bool = False, **extra):
    return client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=max_tokens, stream=stream, extra_body=extra or None)


MODEL = "smollm2-135m-instruct"


def ok_request() -> bool:
    return bool(chat().choices[0].message.content)


def stream_then(action, hosts: Hosts) -> tuple[BaseException | None, float]:
    """Start a long stream, read two chunks, do `action`, read on; returns what the client raised, and when."""
    def body():
        stream = chat(max_tokens=400, stream=True, ignore_eos=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        action()
        t0 = time.monotonic()
        try:
            for _ in chunks:
                pass
        except openai.APIError as exc:
            return exc, time.monotonic() - t0
        return None, time.monotonic() - t0
    return hosts.run(body)


@pytest.fixture
def hosts(tmp_path):
    h = Hosts(tmp_path)
    try:
        yield h
    finally:
        h.close()


def test_two_hosts_over_tcp(hosts):
    hosts.profiles()
    hosts.start_backend()
    # a gateway whose certificate another CA signed: refused by the backend, it stops and says why
    hosts.start_gateway("rogue-gateway", "rogue_client")
    wait_until(lambda: hosts.procs["rogue-gateway"].poll() is not None, 180, "the rogue gateway gave up", hosts)
    rogue_log = (hosts.tmp / "rogue-gateway.log").read_text()
    assert hosts.procs.pop("rogue-gateway").returncode == 1, hosts.logs()
    assert "refused the gateway's client certificate" in rogue_log, hosts.logs()
    hosts.start_gateway()
    wait_until(lambda: hosts.run(health)["status"] == "ok", 180, "gateway up", hosts)

    # plain and streamed requests across the link
    reply = hosts.run(lambda: chat(max_tokens=8))
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    text = hosts.run(lambda: "".join(c.choices[0].delta.content or "" for c in chat(max_tokens=8, stream=True) if c.choices))
    assert text

    # a client that goes away mid-stream: the engine is cancelled and the slot comes back
    def disconnect():
        stream = chat(max_tokens=400, stream=True, ignore_eos=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.close()
    hosts.run(disconnect)
    wait_until(lambda: hosts.run(health)["backends"][0]["free_slots"] == NUM_SLOTS, 20, "slot freed after disconnect", hosts)

    # the link goes down mid-stream: that request fails (no hang), new ones get 503, then it recovers
    # (whichever notices first: the tcp link's idle timeout, or the pool's probe of a backend whose
    # heartbeat stopped finding its control plane unreachable)
    failure, after_s = stream_then(lambda: hosts.link("down"), hosts)
    assert isinstance(failure, openai.APIError) and any(
        why in str(failure) for why in ("lost the connection", "control plane unreachable")), (failure, hosts.logs())
    assert after_s < 10  # the gateway's idle timeout (3 s), not the client's own timeout
    with pytest.raises(openai.APIStatusError) as exc:
        hosts.run(lambda: chat())
    assert exc.value.status_code == 503
    hosts.link("up")
    wait_until(lambda: hosts.run(ok_request), 30, "serving again after the link came back", hosts)

    # the backend restarts: the request in flight fails cleanly, then the gateway reconnects
    failure, after_s = stream_then(lambda: hosts.stop("backend"), hosts)
    assert isinstance(failure, openai.APIError) and not isinstance(failure, openai.APITimeoutError), failure
    assert after_s < 20, failure
    hosts.start_backend()
    wait_until(lambda: hosts.run(ok_request), 180, "serving again after the backend restarted", hosts)
    wait_until(lambda: hosts.run(health)["backends"][0]["free_slots"] == NUM_SLOTS, 20, "every slot free", hosts)
