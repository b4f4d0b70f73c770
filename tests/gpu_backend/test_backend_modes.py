"""`blink backend` refuses, with a clear message and exit code 2, the modes this machine cannot run."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _backend(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blink.cli", "backend", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_persistent_mode_is_refused_until_it_exists():
    run = _backend("--mode", "persistent", "--model", "random:smollm2-135m")
    assert run.returncode == 2
    assert "--mode persistent" in run.stderr and "--mode host or cpu" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: host mode would start")
def test_host_mode_without_a_gpu_says_so():
    run = _backend("--mode", "host", "--model", "random:smollm2-135m")
    assert run.returncode == 2
    assert "needs a CUDA GPU" in run.stderr and "--mode cpu" in run.stderr
