"""The prefix-caching workloads of `blink bench` against a live `blink serve` (CPU engine, demo model)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blink.bench.results import read_records
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def run_bench(live_server, tmp_path, *args: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "blink.bench", "--url", live_server.base_url, *args, "--rates", "inf",
           "--max-concurrency", "4", "--out", str(tmp_path), "--no-progress"]
    env = {**os.environ, "BLINK_API_KEY": live_server.api_key}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = Path(tmp_path).glob("*.json")
    return {**json.loads(path.read_text()), **read_records(path)}, proc.stdout


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multi_turn_runs_every_turn_after_the_one_before(live_server, tmp_path, endpoint):
    doc, stdout = run_bench(live_server, tmp_path, "--workload", "multi-turn", "--conversations", "3", "--turns",
                            "3", "--user-len", "20", "--answer-len", "4", "--endpoint", endpoint)
    m = doc["metrics"]
    assert (m["completed"], m["failed"]) == (9, 0)
    records = sorted(doc["requests"], key=lambda r: r["index"])
    for i, r in enumerate(records[3:], start=3):  # turn t of conversation c is request t * 3 + c
        before = records[i - 3]
        assert r["sent_s"] >= before["sent_s"] + before["e2el_s"] - 1e-3
        assert r["prompt_tokens"] > before["prompt_tokens"]
        if endpoint == "completions":
            assert r["prompt_tokens"] == before["prompt_tokens"] + 4 + 20  # token ids: exact
    reusable = doc["workload"]["reusable_prompt_tokens"]
    assert reusable == sum(r["prompt_len"] for r in records[:6])  # each later turn can reuse the turn before
    assert f"prefix reuse the workload allows {reusable}/" in stdout and "measured hit rate" in stdout
    assert 0 <= m["prefix_cache"]["cached_tokens"] <= m["prefix_cache"]["prompt_tokens"]


def test_shared_prefix_reports_the_reuse_it_allows(live_server, tmp_path):
    doc, stdout = run_bench(live_server, tmp_path, "--workload", "shared-prefix", "--num-requests", "4",
                            "--system-len", "64", "--question-len", "8", "--answer-len", "4")
    assert doc["metrics"]["completed"] == 4
    assert doc["workload"]["reusable_prompt_tokens"] >= 3 * 64
    assert all(r["prompt_tokens"] == 72 for r in doc["requests"])
    assert "measured hit rate" in stdout
