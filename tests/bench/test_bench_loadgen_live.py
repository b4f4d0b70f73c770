"""`blink bench` against a live `blink serve` (CPU engine, demo model, real sockets)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blink.bench.loadgen import ArrivalConfig, ClientConfig, run_requests
from blink.bench.results import read_records
from blink.bench.workloads import BenchRequest, Workload
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def sweep(live_server, backend_pid, tmp_path_factory):
    """A tiny two-rate sweep through the CLI: (result documents by rate, stdout)."""
    out = tmp_path_factory.mktemp("bench-results")
    cmd = [sys.executable, "-m", "blink.bench", "--url", live_server.base_url, "--workload", "sharegpt",
           "--num-requests", "6", "--max-input", "24", "--max-output", str(MAX_TOKENS), "--rates", "8,inf",
           "--max-concurrency", "2", "--backend-pid", str(backend_pid), "--goodput", "ttft:60000",
           "--label", "blink-test", "--out", str(out), "--no-progress"]
    env = {**os.environ, "BLINK_API_KEY": live_server.api_key}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [{**json.loads(p.read_text()), **read_records(p)} for p in sorted(Path(out).glob("*.json"))]
    return {d["arrivals"]["rate"]: d for d in docs}, proc.stdout


def test_sweep_writes_one_documented_json_per_rate(sweep, live_server):
    docs, stdout = sweep
    assert set(docs) == {8.0, "inf"}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for doc in docs.values():
        assert doc["environment"]["commit"] == commit and doc["environment"]["host"]
        assert doc["model"] == live_server.model and doc["label"] == "blink-test"
        assert doc["workload"]["name"] == "sharegpt" and doc["workload"]["params"]["scaled"]["max_output"] == MAX_TOKENS
        m = doc["metrics"]
        assert (m["completed"], m["failed"]) == (6, 0)
        assert m["output_throughput_tok_s"] > 0 and m["request_throughput_req_s"] > 0
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "queue_ms"):
            assert set(m[name]) >= {"mean", "median", "p90", "p99"}
        assert m["goodput"]["good_requests"] == 6
    lines = [line for line in stdout.splitlines() if line.strip()]
    reuse = [line for line in lines if "prefix reuse the workload allows" in line]
    assert len(lines) - len(reuse) == 3 and len(reuse) == 2  # header + one row per rate, then a reuse line per rate


def test_every_request_does_the_requested_work(sweep):
    docs, _ = sweep
    for doc in docs.values():
        for r in doc["requests"]:
            assert r["completion_tokens"] == r["max_tokens"] == MAX_TOKENS  # ignore_eos
            assert r["prompt_tokens"] == r["prompt_len"]  # token-id prompts: exact lengths
            assert 0 < r["ttft_s"] <= r["e2el_s"]
            assert len(r["itl_s"]) == MAX_TOKENS - 1
            assert r["tpot_s"] == pytest.approx((r["e2el_s"] - r["ttft_s"]) / (MAX_TOKENS - 1))


def test_queue_time_is_apart_from_ttft_when_gated(sweep):
    docs, _ = sweep
    burst = docs["inf"]["requests"]  # 6 at once through a gate of 2: four of them wait
    assert sum(r["queue_s"] > 0.05 for r in burst) >= 3
    assert docs["inf"]["metrics"]["queue_ms"]["p99"] > 50
    for r in burst:
        assert r["sent_s"] == pytest.approx(r["scheduled_s"] + r["queue_s"], abs=0.05)
        if r["queue_s"] > 0.5:  # TTFT starts at sending: the wait is not in it
            assert r["ttft_s"] < r["queue_s"]


def test_server_side_figures_in_the_run(sweep, backend_pid):
    docs, _ = sweep
    server = docs["inf"]["server"]
    assert server["cpu"]["available"] and server["cpu"]["pid"] == backend_pid
    assert server["cpu"]["cpu_s"] > 0 and server["cpu"]["generated_tokens"] == 6 * MAX_TOKENS
    assert server["nvml"]["reason"].startswith("not available")
    assert server["roofline"]["reason"].startswith("not available")


def run(live_server, reqs, endpoint="completions", **arrivals):
    cfg = ClientConfig(live_server.base_url, live_server.model, live_server.api_key, endpoint)
    return asyncio.run(run_requests(cfg, Workload("t", tuple(reqs)), ArrivalConfig(**arrivals)))


def test_chat_endpoint_and_errors_become_records(live_server):
    ok = BenchRequest(tuple(range(100, 110)), 4)
    too_long = BenchRequest(tuple(range(100, 100 + live_server.context_len + 10)), 4)
    (rec,), _ = run(live_server, [ok], endpoint="chat")
    assert rec.ok and rec.completion_tokens == 4 and rec.ttft_s <= rec.e2el_s
    (good, bad), duration_s = run(live_server, [ok, too_long])
    assert good.ok and not bad.ok and bad.error.startswith("HTTP 400")
    assert duration_s > 0


def interference_processes() -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and b"blink.bench.interference" in Path(entry.path, "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def test_runs_under_interference_and_cleans_up(live_server, tmp_path):
    cmd = [sys.executable, "-m", "blink.bench", "--url", live_server.base_url, "--workload", "batch1",
           "--num-requests", "2", "--prompt-len", "8", "--output-len", "4", "--warmup-requests", "0",
           "--interference", "1", "--kinds", "bz2", "--cores", "0", "--interference-settle", "0.2",
           "--out", str(tmp_path), "--no-progress"]
    env = {**os.environ, "BLINK_API_KEY": live_server.api_key}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (path,) = tmp_path.glob("*_i1_*.json")
    doc = json.loads(path.read_text())
    assert doc["interference"]["threads"] == 1 and doc["interference"]["cores"] == [0]
    assert doc["interference"]["running_at_end"] == 1  # it covered the whole run
    requests = read_records(path)["requests"]
    assert doc["arrivals"]["max_concurrency"] is None and max(r["queue_s"] for r in requests) > 0  # batch1 gate
    assert not interference_processes()
