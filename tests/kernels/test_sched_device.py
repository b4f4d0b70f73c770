"""blink_sched.h on a GPU makes the very decisions the host build makes: tests/kernels/sched_device_check.cu
applies one pseudo-random trace to a device copy and a host copy of the state and compares both (state and
step buffer) byte for byte after every schedule and update, with now and then a sequence marked STOPPING
before the update (the loop's asynchronous take). Needs nvcc and a CUDA GPU (sm_90)."""
import subprocess
from pathlib import Path

import pytest
import torch

from tests.kernels.test_sched_device_compile import INCLUDE, nvcc_path

HARNESS = Path(__file__).resolve().parent / "sched_device_check.cu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here; run on a GPU host (sm_90)")
def test_device_scheduler_matches_host_build_step_by_step(tmp_path):
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin)")
    exe = tmp_path / "sched_device_check"
    subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-O2", "-I", str(INCLUDE), str(HARNESS), "-o", str(exe)],
                   check=True, timeout=300)
    res = subprocess.run([str(exe), "20000"], capture_output=True, text=True, timeout=300)
    print(res.stdout)
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout + res.stderr
