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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the mode would start")
@pytest.mark.parametrize("mode", ["host", "persistent"])
def test_gpu_modes_without_a_gpu_say_so(mode):
    run = _backend("--mode", mode, "--model", "random:smollm2-135m")
    assert run.returncode == 2
    assert f"--mode {mode} needs a CUDA GPU" in run.stderr and "--mode cpu" in run.stderr
