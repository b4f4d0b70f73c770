"""bench/device_structured.sh and the helpers it shares with device_prefix.sh (bench/lib.sh). The smoke run is the
whole script on the cpu backend with a random-weight model, tiny: what a GPU host runs, minus the GPU."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port

SCRIPTS = ("bench/lib.sh", "bench/device_prefix.sh", "bench/device_structured.sh")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse(script):
    subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)


def test_lib_defines_the_shared_helpers_and_both_scripts_source_it():
    out = subprocess.run(["bash", "-c", "source bench/lib.sh; type -t wait_http bench start_serve stop_serve pin_gateway"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["function"] * 5
    for script in SCRIPTS[1:]:
        text = (ROOT / script).read_text()
        assert "source bench/lib.sh" in text and "wait_http() {" not in text


@pytest.mark.slow
def test_the_script_runs_on_the_cpu_backend(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out"),
           "MODE": "cpu", "MODEL": "random:smollm2-135m", "PORT": str(free_port()), "C": "2", "N": "2",
           "PROMPT_LEN": "8", "OUT_LEN": "4", "CHECK_N": "1", "CHECK_LEN": "8", "GATEWAY_CORES": "",
           "STRUCT_CACHE": str(tmp_path / "cache"),
           "SERVE_FLAGS": "--context-len 512 --num-slots 4 --max-output-len 64 --kv-cache-mb 64 --no-prefix-caching"}
    run = subprocess.run(["bash", "bench/device_structured.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "constrained/plain at concurrency 2: TPOT mean" in run.stdout
    [pair] = json.loads((tmp_path / "out" / "structured-cpu.json").read_text())["pairs"]
    plain, constrained = pair["plain"], pair["constrained"]
    assert (plain["completed"], constrained["completed"]) == (2, 2) and pair["concurrency"] == 2
    assert constrained["constrained"] and not plain["constrained"]
    assert plain["finish_reasons"] == {"length": 2}  # ignore_eos: every plain answer runs to OUT_LEN
    assert constrained["tokens_per_request"] <= 4 and constrained["gateway_cpu_s_per_token"] is not None
    # the check ran under the byte-level tokenizer: answered (cut by its 8 tokens), no request failed
    check = json.loads((tmp_path / "out" / "structured-check-cpu.json").read_text())
    assert check["num_requests"] == 1 and check["failed"] == [] and check["length"] == 1
    [records] = (tmp_path / "out" / "structured-cpu-c2-json").glob("*.records.json.gz")
    assert all(r["completion_tokens"] >= 1 and r["error"] is None for r in json.load(gzip.open(records))["requests"])
