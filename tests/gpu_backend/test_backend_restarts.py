"""A backend SIGKILLed and restarted ten times (cpu engine, demo model) leaves at most its current ring in
/dev/shm: its ring is named from its control address, and each start removes what the killed one left.
A second backend that would take a live backend's ring is refused before it loads a model."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from protocols.shm import SHM_DIR, ring_holder, stable_ring_name, unlink_ring
from tests.conftest import ROOT, free_port

NUM_RESTARTS = 10
READY_TIMEOUT_S = 120


def start_backend(control: str, log_path, *extra: str) -> subprocess.Popen:
    from gpu_backend.models.demo import ensure_demo_model

    model_dir = str(ensure_demo_model(progress=False))
    return subprocess.Popen(
        [sys.executable, "-m", "blink.cli", "backend", "--mode", "cpu", "--model", model_dir, "--control", control,
         "--context-len", "256", "--kv-cache-mb", "16", "--num-slots", "4", "--threads", "1", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))


def wait_ready(proc: subprocess.Popen, log_path) -> str:
    """The `backend ready` line (it comes once the ring exists and the control plane listens)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        ready = [line for line in log_path.read_text().splitlines() if line.startswith("backend ready")]
        if ready:
            return ready[0]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"backend not ready (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")


def shm_files_of(pids: list[int], ring: str) -> list[str]:
    """Our files in /dev/shm: the ring, and any named after one of our backends' pids (the old default)."""
    return sorted(f for f in os.listdir(SHM_DIR) if f == ring or set(f.split("-")) & set(map(str, pids)))


@pytest.mark.slow
def test_sigkilled_backend_restarted_ten_times_leaves_only_its_current_ring(tmp_path):
    control = f"127.0.0.1:{free_port()}"
    ring = stable_ring_name(control)
    pids = []
    try:
        for i in range(NUM_RESTARTS):
            log_path = tmp_path / f"backend{i}.log"
            proc = start_backend(control, log_path)
            pids.append(proc.pid)
            assert f"ring={ring} " in wait_ready(proc, log_path)
            assert ("removed the stale ring" in log_path.read_text()) == (i > 0)  # what the one before left
            assert ring_holder(ring) == proc.pid
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert shm_files_of(pids, ring) == [ring]  # the killed one's ring, and nothing else of ours
        assert ring_holder(ring) is None  # stale: the next start may take it
    finally:
        unlink_ring(ring)  # what the last kill left: tests clean up what they kill
    assert shm_files_of(pids, ring) == []


@pytest.mark.slow
def test_a_live_backends_ring_is_refused_before_a_model_loads(tmp_path):
    first_control, second_control = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ring = stable_ring_name(first_control)
    first = start_backend(first_control, tmp_path / "first.log")
    try:
        wait_ready(first, tmp_path / "first.log")
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "blink.cli", "backend", "--control", second_control,
                                 "--ring", ring], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"ring {ring!r}" in second.stderr and f"process {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert time.monotonic() - started < 60  # refused before any model loads
        assert ring_holder(ring) == first.pid  # and the live ring untouched
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.wait(timeout=30)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
        unlink_ring(ring)
    assert not os.path.exists(os.path.join(SHM_DIR, ring))


def test_the_default_ring_name_comes_from_the_control_address():
    from gpu_backend.config import BackendConfig

    assert BackendConfig(control="10.0.0.2:50051").ring_name == "blink-10.0.0.2-50051"
    assert BackendConfig(control="10.0.0.2:50051", ring="blink-0").ring_name == "blink-0"  # --ring wins
    assert BackendConfig(control="127.0.0.1:0").ring_name == f"blink-{os.getpid()}"  # no stable port to name it by


def test_serve_names_its_ring_after_its_gateway_address(monkeypatch):
    from blink import cli

    launched = []
    monkeypatch.setattr(cli, "_taken_ports", lambda *a: "")
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kw: launched.append(argv) or _Exited())
    monkeypatch.setattr(cli, "_wait_ready", lambda *a: False)
    monkeypatch.setattr(cli, "_stop_all", lambda procs: None)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # serve's handlers stay out of this process
    args = cli.build_parser().parse_args(["serve", "--port", "8301", "--grpc-port", "0"])
    cli.serve(args)
    backend, gateway = launched
    ring = backend[backend.index("--ring") + 1]
    assert ring == "blink-serve-127.0.0.1-8301" and gateway[gateway.index("--expect-ring") + 1] == ring


class _Exited:
    returncode = 0

    def poll(self) -> int:
        return 0
