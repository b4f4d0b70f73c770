"""The gateway installs and runs without the backend's packages (a DPU image has no torch): started through
both entry points with those packages made uninstallable, it serves a request; any attempt to import one,
caught or not, fails the test with the importing stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-echo"  # what the echo_backend fixture (conftest.py) describes
# The backend's own dependencies (pyproject's `backend` extra) and its code: none of it may load in a gateway.
NOT_ON_A_GATEWAY_HOST = ("torch", "triton", "safetensors", "gguf", "transformers", "tqdm", "gpu_backend", "kernels")

# Runs first in a `python -I` interpreter (no PYTHONPATH, no user site, no current directory on the path).
PRELUDE = """
import sys, traceback
sys.path.insert(0, {root!r})
BLOCKED, LOG = {blocked!r}, {log!r}
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            with open(LOG, "a") as f:
                f.write(f"import of {{name}}:\\n" + "".join(traceback.format_stack()) + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on a gateway host)", name=name)
        return None
already = sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED)
if already:
    open(LOG, "a").write(f"loaded before the gateway started: {{already}}\\n")
sys.meta_path.insert(0, NotInstalled())
"""


def without_backend_packages(log: Path, code: str, blocked: tuple[str, ...] = NOT_ON_A_GATEWAY_HOST) -> list[str]:
    """`python -I -c` argv running `code` after the prelude, with `blocked` packages unimportable."""
    prelude = PRELUDE.format(root=str(ROOT), blocked=blocked, log=str(log))
    return [sys.executable, "-I", "-c", prelude + code]


def test_the_prelude_catches_an_import_of_torch_even_a_caught_one(tmp_path):
    log = tmp_path / "blocked.txt"
    code = "try:\n    import torch\nexcept ImportError:\n    pass\nimport gpu_backend.engine\n"
    proc = subprocess.run(without_backend_packages(log, code), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not on a gateway host" in proc.stderr
    assert "import of torch" in log.read_text() and "import of gpu_backend" in log.read_text()


def _get(url: str, key: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the gateway did not answer /health"
        try:
            if _get(url + "/health", "k")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)


@pytest.mark.parametrize("entry", ["blink gateway", "python -m gateway"])
def test_the_gateway_serves_without_the_backend_packages(entry, echo_backend, pick_free_port, tmp_path):
    control, _, _ = echo_backend
    port, log = pick_free_port(), tmp_path / "blocked.txt"
    flags = ["--backend", control, "--port", str(port), "--grpc-port", "0", "--api-key", "k", "--connect-timeout", "10"]
    module, argv = ("blink.cli", ["blink", "gateway", *flags]) if entry == "blink gateway" else ("gateway", ["gateway", *flags])
    code = f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    proc = subprocess.Popen(without_backend_packages(log, code), cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 3}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={
            "Authorization": "Bearer k", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read())["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not log.exists(), f"{entry} imported what a gateway host does not have:\n{log.read_text()}"


def test_a_backend_command_on_a_gateway_only_install_says_what_to_install(tmp_path):
    code = "from blink.cli import main\nsys.exit(main(['backend', '--help']))\n"
    installed_code = tuple(p for p in NOT_ON_A_GATEWAY_HOST if p not in ("gpu_backend", "kernels"))  # pip installs all
    proc = subprocess.run(without_backend_packages(tmp_path / "blocked.txt", code, installed_code),
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'blink-serve[backend]'" in proc.stderr and "Traceback" not in proc.stderr
