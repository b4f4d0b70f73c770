"""kernels/csrc/include/blink_sched.h compiles as device code for an H100/H200 (sm_90), with the serial
steps on thread 0 and the step-buffer fill split over the block's threads: the shape the loop kernel uses.
Needs nvcc, not a GPU."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

INCLUDE = Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "include"

KERNEL = r"""
#include "blink_sched.h"
__global__ void sched_step(uint8_t* mem, uint8_t* step_buf, const int32_t* room, const int32_t* sampled) {
  __shared__ int32_t order[1024];
  blink_sched s;
  blink_sched_bind(&s, mem, &((blink_sched_header*)mem)->cfg);
  if (threadIdx.x == 0) {
    blink_sched_update(&s, sampled);
    blink_sched_schedule(&s, room, order);
    blink_fill_prologue(&s, step_buf);
  }
  __syncthreads();
  blink_fill_tokens(&s, step_buf, threadIdx.x, blockDim.x);
}
"""


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    return found if Path(found).exists() else None


def test_blink_sched_compiles_as_sm90_device_code(tmp_path):
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin): cannot check the device build of blink_sched.h")
    src = tmp_path / "sched_step.cu"
    src.write_text(KERNEL)
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-I", str(INCLUDE),
                          "-c", str(src), "-o", str(tmp_path / "sched_step.o")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_device_check_harness_compiles(tmp_path):
    """The GPU lockstep harness (run by test_sched_device.py on a GPU host) builds here too."""
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin): cannot build tests/kernels/sched_device_check.cu")
    harness = Path(__file__).resolve().parent / "sched_device_check.cu"
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-I", str(INCLUDE), "-c",
                          str(harness), "-o", str(tmp_path / "check.o")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
