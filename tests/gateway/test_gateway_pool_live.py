"""Many backends, live: three CPU backends (real processes) behind one gateway started with `--config`.

In order: routing spreads requests over both configured backends; a backend stopped and then killed
(SIGKILL) mid-run loses none of the requests that had no token yet (they finish on the other) and
ends its running stream with an error event; a SIGHUP reload adds a backend, and a reload that drops
one drains it (its stream finishes, new work goes elsewhere, then it is gone).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from protocols.shm import remove_stale_ring
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.slow

KEY = "pool-key-" + os.urandom(4).hex()
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from gpu_backend.models.demo import ensure_demo_model
    model_dir = str(ensure_demo_model(progress=False))
    tmp = tmp_path_factory.mktemp("pool")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BLINK_API_KEY": KEY}
    procs: dict[str, subprocess.Popen] = {}
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    rings = [f"blink-pool-{os.getpid()}-{i}" for i in range(3)]
    for i, addr in enumerate(addrs):
        procs[addr] = subprocess.Popen(
            [sys.executable, "-m", "blink.cli", "backend", "--mode", "cpu", "--model", model_dir,
             "--ring", rings[i], "--control", addr, "--context-len", "1024",
             "--kv-cache-mb", "128", "--num-slots", "16", "--threads", "1"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"backend{i}.log", "w"))
    port = free_port()
    config = tmp / "gateway.yaml"
    write_config(config, addrs[:2])
    log_path = tmp / "gateway.log"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "blink.cli", "gateway", "--port", str(port), "--grpc-port", "0", "--config",
         str(config)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    cluster = Cluster(f"http://127.0.0.1:{port}", addrs, procs, gateway, config, log_path)
    try:
        cluster.wait(lambda: cluster.health()["status"] == "ok", 120, "gateway up")
        yield cluster
    finally:
        for proc in [gateway, *procs.values()]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in [gateway, *procs.values()]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ring in rings:  # a SIGKILLed backend (the test kills one) leaves its ring in /dev/shm
            remove_stale_ring(ring)


def write_config(path, addrs) -> None:
    # 3 s: a cpu step with several prefills on one thread of a busy 2-core host can take over a second, and
    # the rule ejects a backend with work pending whose heartbeat stood still that long (a spurious retry)
    path.write_text("routing: least_outstanding_tokens\nheartbeat_timeout_s: 3.0\nprobe_interval_s: 0.3\n"
                    "backends:\n" + "".join(f"  - {a}\n" for a in addrs))


class Cluster:
    def __init__(self, url, addrs, procs, gateway, config, log_path):
        self.url, self.addrs, self.procs, self.gateway = url, addrs, procs, gateway
        self.config, self.log_path = config, log_path
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        self.model = None

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read())

    def counter(self, name: str, **labels) -> float:
        """A counter's value from /metrics (0 when the series does not exist yet)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def backends(self) -> dict[str, dict]:
        return {b["addr"]: b for b in self.health()["backends"]}

    def wait(self, cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                break
            try:
                if cond():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        pytest.fail(f"{what}: not reached in {timeout_s} s\n{self.log_path.read_text()[-4000:]}")

    def complete(self, max_tokens: int = 8, stream: bool = False):
        self.model = self.model or self.client.models.list().data[0].id
        return self.client.completions.create(model=self.model, prompt=PROMPT, max_tokens=max_tokens,
                                              stream=stream, extra_body={"ignore_eos": True})

    def reload(self, addrs) -> None:
        write_config(self.config, addrs)
        self.gateway.send_signal(signal.SIGHUP)


def first_chunk(stream) -> None:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            return
    raise AssertionError("the stream ended before its first token")


def drain_stream(stream) -> tuple[int, str | None]:
    """(text chunks, finish reason) of the rest of a stream."""
    num_chunks, reason = 0, None
    for chunk in stream:
        if chunk.choices:
            num_chunks += bool(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
    return num_chunks, reason


def test_routing_spreads_requests_over_backends(cluster):
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: cluster.complete(8), range(6)))
    assert all(r.usage.completion_tokens == 8 for r in results)
    served = {addr: b["requests"] for addr, b in cluster.backends().items()}
    assert set(served) == set(cluster.addrs[:2]) and all(n > 0 for n in served.values()), served


def test_killed_backend_moves_unstarted_requests_and_ends_its_stream(cluster):
    ballast = cluster.complete(300, stream=True)  # both idle: the first backend takes it
    first_chunk(ballast)
    short = cluster.complete(60, stream=True)  # fewer outstanding tokens there: the other backend
    first_chunk(short)
    backends = cluster.backends()
    assert all(b["in_flight"] == 1 for b in backends.values()), backends
    victim = min(backends, key=lambda a: backends[a]["outstanding_tokens"])
    retries = "blink:request_retries_total"
    assert cluster.counter(retries) == 0.0
    cluster.procs[victim].send_signal(signal.SIGSTOP)  # frozen: requests routed to it get no token
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(cluster.complete, 8) for _ in range(2)]
        cluster.wait(lambda: cluster.backends()[victim]["in_flight"] == 3, 5, "requests queued on the frozen backend")
        cluster.procs[victim].kill()
        results = [w.result(timeout=30) for w in waiting]
    assert all(r.usage.completion_tokens == 8 for r in results)  # nothing lost: they ran on the other backend
    assert cluster.counter(retries, reason="failed_before_first_token") == 2.0  # those two, once each
    with pytest.raises(openai.APIError):  # the stream that had started ends with an error event
        drain_stream(short)
    ballast.close()
    cluster.wait(lambda: victim not in cluster.backends(), 5, "dead backend removed")
    log = cluster.log_path.read_text()
    assert "retrying on" in log and f"backend {victim}" in log
    cluster.victim = victim


def test_reload_adds_a_backend_and_drains_a_removed_one(cluster):
    survivor = next(a for a in cluster.addrs[:2] if a != cluster.victim)
    added = cluster.addrs[2]
    cluster.reload([survivor, added])
    cluster.wait(lambda: added in cluster.backends(), 30, "backend added by reload")
    cluster.wait(lambda: all(b["in_flight"] == 0 for b in cluster.backends().values()), 10, "idle")
    stream = cluster.complete(40, stream=True)  # both idle: the survivor (listed first) takes it
    first_chunk(stream)
    assert cluster.backends()[survivor]["in_flight"] == 1
    cluster.reload([added])
    cluster.wait(lambda: cluster.backends()[survivor]["draining"], 5, "survivor draining")
    before = cluster.backends()[added]["requests"]
    assert cluster.complete(4).usage.completion_tokens == 4  # new work goes to the backend that stays
    assert cluster.backends()[added]["requests"] == before + 1
    num_chunks, reason = drain_stream(stream)  # the drained backend's stream finishes normally
    assert reason == "length" and num_chunks > 0
    cluster.wait(lambda: list(cluster.backends()) == [added], 5, "drained backend closed")
