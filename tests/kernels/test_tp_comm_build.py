"""kernels/csrc/tp_comm.cu (tensor parallelism's kernels and the followers' loop) builds for sm_90 with no
warnings, and its library refuses a group it cannot form before any CUDA call. Needs nvcc, not a GPU; the
kernels themselves run in tests/gpu_backend/test_tensor_parallel_gpu.py."""
import ctypes
import subprocess

import pytest

from kernels import tp_comm


def test_tp_comm_compiles_without_warnings(nvcc, tmp_path):
    res = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-rdc=true", "-Werror", "all-warnings", "-I",
                          str(tp_comm.CSRC / "include"), "-c", str(tp_comm.SOURCE), "-o", str(tmp_path / "tp.o")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("world", [0, 1, 9])
def test_a_group_of_fewer_than_two_or_more_than_eight_ranks_is_refused(nvcc, world):
    lib, handle = tp_comm.load(), ctypes.c_void_p()
    devices = (ctypes.c_int32 * 9)(*range(9))
    assert lib.blink_tp_create(world, devices, 1024, 10**9, ctypes.byref(handle)) == 1  # cudaErrorInvalidValue
    assert lib.blink_tp_rank_bytes() > 0
