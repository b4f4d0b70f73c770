"""bench/device_structured.sh and the helpers it shares with device_prefix.sh (bench/lib.sh). The smoke run is the
whole script on the cpu backend with a random-weight model, tiny: what a GPU host runs, minus the GPU."""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, free_port

SCRIPTS = ("bench/lib.sh", "bench/device_prefix.sh", "bench/device_structured.sh")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse(script):
    subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)


HELPERS = ("wait_http", "bench", "start_serve", "stop_serve", "pin_gateway", "pin_backend", "other_cores",
           "use_carried_wheels")


def _lib(command: str, **env) -> str:
    return subprocess.run(["bash", "-c", f"source bench/lib.sh; {command}"], cwd=ROOT, capture_output=True, text=True,
                          check=True, env={**os.environ, "PY": sys.executable, **env}).stdout


def test_lib_defines_the_shared_helpers_and_both_scripts_source_it():
    assert _lib("type -t " + " ".join(HELPERS)).split() == ["function"] * len(HELPERS)
    for script in SCRIPTS[1:]:
        text = (ROOT / script).read_text()
        assert "source bench/lib.sh" in text and "wait_http() {" not in text


def test_pinning_puts_the_gateway_and_the_backend_tree_on_their_cores():
    cores = sorted(os.sched_getaffinity(0))
    gateway_core, rest = str(cores[-1]), ",".join(map(str, cores[:-1])) or str(cores[-1])
    assert _lib(f"other_cores {gateway_core}").strip() == ",".join(map(str, cores[:-1]))
    sleeper = "import time; time.sleep(20)"
    # a stand-in for `blink serve`: a gateway child and a backend child that has a child of its own
    serve = subprocess.Popen(["bash", "-c", f"{sys.executable} -c '{sleeper}' blink.cli gateway & "
                              f"bash -c \"{sys.executable} -c '{sleeper}' & wait\" blink.cli backend & wait"])
    try:
        time.sleep(1.0)
        _lib(f"pin_gateway {serve.pid} {gateway_core} && pin_backend {serve.pid} {rest}")
        tree = {p: _allowed(p) for p in _descendants(serve.pid)[1:]}  # not the stand-in itself
        gateway = [p for p in tree if b"blink.cli gateway" in _cmdline(p)]
        backend = [p for p in tree if b"blink.cli backend" in _cmdline(p)]
        assert len(gateway) == 1 and len(backend) == 1
        assert tree[gateway[0]] == {int(gateway_core)}
        below = [p for p in _descendants(backend[0]) if p != backend[0]]
        assert below and all(tree[p] == {int(c) for c in rest.split(",")} for p in [backend[0], *below])
    finally:
        for pid in _descendants(serve.pid):  # the stand-in's own tree, by id
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        serve.wait(10)


def test_the_benchmark_client_runs_on_client_cores_when_they_are_set(tmp_path):
    """`bench` under CLIENT_CORES: the client is confined to those cores (never the gateway's); unset, it is not."""
    core = str(sorted(os.sched_getaffinity(0))[0])
    fake = tmp_path / "py"  # stands in for the python: records the cores it may run on, writes a result file
    fake.write_text("#!/bin/sh\ntaskset -cp $$ >&2\nfor a; do [ \"$prev\" = --out ] && echo {} > \"$a/r.json\"; "
                    "prev=$a; done\n")
    fake.chmod(0o755)
    pinned = subprocess.run(["bash", "-c", f"source bench/lib.sh; PY={fake}; bench {tmp_path}/a URL L"], cwd=ROOT,
                            capture_output=True, text=True, check=True, env={**os.environ, "CLIENT_CORES": core})
    assert pinned.stdout.strip().endswith("/a/r.json") and pinned.stderr.strip().endswith(f": {core}")
    free = subprocess.run(["bash", "-c", f"source bench/lib.sh; PY={fake}; bench {tmp_path}/b URL L"], cwd=ROOT,
                          capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if k != "CLIENT_CORES"})
    assert free.stdout.strip().endswith("/b/r.json")
    if len(os.sched_getaffinity(0)) > 1:
        assert not free.stderr.strip().endswith(f": {core}")


def _descendants(pid: int) -> list[int]:
    from blink.bench.collectors import process_tree

    return process_tree(pid)


def _cmdline(pid: int) -> bytes:
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")


def _allowed(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.slow
def test_the_script_runs_on_the_cpu_backend(tmp_path):
    schema = tmp_path / "check.json"  # short enough to end in CHECK_LEN tokens of noise on a slow CPU
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path / "out"),
           "MODE": "cpu", "MODEL": "random:smollm2-135m", "PORT": str(free_port()), "C": "2", "N": "2",
           "PROMPT_LEN": "8", "OUT_LEN": "4", "CHECK_N": "2", "CHECK_LEN": "16", "CHECK_SCHEMA": str(schema),
           "COMPILE_REPEATS": "1", "CORPUS": "0",  # the corpus: tests/bench/test_structured_check.py
           "GATEWAY_CORES": "",
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
    # the check ran under the byte-level tokenizer: noise under the mask wrote {"ok": true|false} and stopped
    check = json.loads((tmp_path / "out" / "structured-check-cpu.json").read_text())
    assert (check["num_requests"], check["ended"], check["valid"], check["failed"]) == (2, 2, 2, [])
    assert len(check["compile"]["cold_ms"]) == len(check["compile"]["cached_ms"]) == 1
    [records] = (tmp_path / "out" / "structured-cpu-c2-json").glob("*.records.json.gz")
    assert all(r["completion_tokens"] >= 1 and r["error"] is None for r in json.load(gzip.open(records))["requests"])
