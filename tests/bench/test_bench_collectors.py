"""Server-side collectors: CPU of a process tree, NVML (absent here), roofline arithmetic."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from blink.bench.collectors import CpuCollector, NvmlCollector, process_tree, roofline
from blink.bench.loadgen import ArrivalConfig, ClientConfig, run_requests
from blink.bench.workloads import BenchRequest, Workload

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"


def test_cpu_collector_counts_descendants_alive_and_reaped():
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{BUSY}'; sleep 30"])
    try:
        c = CpuCollector(parent.pid)
        c.start()
        time.sleep(0.05)
        assert len(process_tree(parent.pid)) >= 2
        deadline = time.monotonic() + 10
        while not any(b"sleep" in cmdline(p) for p in process_tree(parent.pid)[1:]):  # python reaped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out = c.stop(generated_tokens=10)  # the busy child is gone: its CPU is in sh's cutime
        assert out["available"] and out["cpu_s"] >= 0.25
        assert out["cpu_s_per_token"] == pytest.approx(out["cpu_s"] / 10)
    finally:
        parent.kill()
        parent.wait()


# a thread named "spinner" (prctl names the OS thread: /proc's comm) spins 0.3 s of CPU, then waits alive
SPIN_NAMED = """import ctypes, threading, time
def spin(done):
    ctypes.CDLL(None).prctl(15, b"spinner", 0, 0, 0)  # PR_SET_NAME
    t = time.thread_time()
    while time.thread_time() - t < 0.3:
        pass
    done.wait()
done = threading.Event()
threading.Thread(target=spin, args=(done,), daemon=True).start()
time.sleep(30)
"""


def test_cpu_collector_names_the_threads_its_cpu_went_to():
    proc = subprocess.Popen([sys.executable, "-c", "import os, sys; exec(sys.stdin.read())"], stdin=subprocess.PIPE)
    try:
        c = CpuCollector(proc.pid)
        c.start()
        proc.stdin.write(SPIN_NAMED.encode())
        proc.stdin.close()
        time.sleep(1.5)  # the spinning thread has run its 0.3 s (threads live on after their end are not counted)
        out = c.stop(generated_tokens=1)
    finally:
        proc.kill()
        proc.wait()
    threads = out["per_thread_cpu_s"]
    assert threads.get("spinner", 0) >= 0.25, threads
    assert list(threads)[0] == "spinner"  # largest first


def test_cpu_collector_names_the_threads_of_its_child_processes_too():
    """A gateway's grammar threads live in its worker processes: the tree's threads are counted by name."""
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import sys; exec(sys.stdin.read())'; sleep 30"],
                              stdin=subprocess.PIPE)
    try:
        c = CpuCollector(parent.pid)
        c.start()
        parent.stdin.write(SPIN_NAMED.replace("time.sleep(30)", "time.sleep(3)").encode())
        parent.stdin.close()
        time.sleep(1.5)
        out = c.stop(generated_tokens=1)
    finally:
        parent.kill()
        parent.wait()
    assert out["per_thread_cpu_s"].get("spinner", 0) >= 0.25, out["per_thread_cpu_s"]


@pytest.mark.slow
def test_cpu_collector_attributes_generation_to_the_backend(live_server, backend_pid):
    gateway = [p for p in process_tree(live_server.proc.pid)[1:] if b"gateway" in cmdline(p)]
    idle = subprocess.Popen(["sleep", "30"])
    try:
        backend_c, idle_c = CpuCollector(backend_pid), CpuCollector(idle.pid)
        backend_c.start(), idle_c.start()
        cfg = ClientConfig(live_server.base_url, live_server.model, live_server.api_key)
        reqs = (BenchRequest(tuple(range(200, 216)), 8),) * 2
        records, _ = asyncio_run(run_requests(cfg, Workload("t", reqs), ArrivalConfig()))
        tokens = sum(r.completion_tokens for r in records)
        backend, quiet = backend_c.stop(tokens), idle_c.stop(tokens)
    finally:
        idle.kill()
        idle.wait()
    assert gateway and backend_pid not in gateway
    assert tokens == 16 and backend["generated_tokens"] == 16
    assert str(backend_pid) in backend["per_process_cpu_s"]
    assert backend["cpu_s"] > 0.01 and quiet["cpu_s"] < 0.01
    assert not CpuCollector(idle.pid).stop(1)["available"]  # a process that is gone says so


def cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def test_nvml_says_not_available_without_a_gpu():
    c = NvmlCollector()
    c.start()
    out = c.stop(generated_tokens=100)
    if out["available"]:  # a GPU host
        assert out["energy_mj"] >= 0
    else:
        assert out["reason"].startswith("not available: ")


def test_roofline_arithmetic():
    # Llama-3-8B bf16 at batch 1 on an H100 (BENCH.md): 16.1 GB / 3000 GB/s = 5.37 ms floor
    r = roofline(16_100_000_000, 3000.0, step_s=0.010)
    assert r["floor_step_s"] == pytest.approx(0.005367, rel=1e-3)
    assert r["achieved_gbps"] == pytest.approx(1610.0) and r["fraction_of_roofline"] == pytest.approx(0.5367, rel=1e-3)
    kv = roofline(1000, 1.0, step_s=1.0, batch_size=2, kv_bytes_per_token=10, mean_context_len=50)
    assert kv["step_bytes"] == 2000
    assert roofline(None, 3000.0, 0.01)["reason"].startswith("not available")
