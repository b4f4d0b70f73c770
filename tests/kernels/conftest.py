"""Kernel tests run two ways, chosen by the `device` fixture:

- `gpu` (@pytest.mark.gpu): compiled by Triton on a CUDA GPU, realistic shapes; skipped without a GPU.
- `interpret` (@pytest.mark.interpret): Triton's CPU interpreter on small shapes, only where no GPU
  exists and triton is installed. TRITON_INTERPRET=1 is set here, before anything imports the kernels
  (triton.jit reads it when a kernel is defined).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = HAS_TRITON and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1"


def _interpret_skip_reason() -> str:
    if not HAS_TRITON:
        return "triton is not installed (pip install triton to run the kernels under its CPU interpreter)"
    if HAS_CUDA:
        return "a CUDA GPU is present: the kernels run compiled (the gpu tests), not interpreted"
    return "TRITON_INTERPRET is set to something other than 1"


MODES = [
    pytest.param("cuda", id="gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU here; the lead runs kernels/device_check.sh on one"),
        pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")]),
    pytest.param("cpu", id="interpret", marks=[
        pytest.mark.interpret,
        pytest.mark.skipif(not INTERPRET, reason=_interpret_skip_reason())]),
]


@pytest.fixture(params=MODES)
def device(request) -> str:
    """'cuda' (compiled kernels) or 'cpu' (Triton interpreter)."""
    return request.param


def _patch_interpreter_bf16() -> None:
    """Triton's CPU interpreter (3.x) differs from the GPU in three ways the kernels hit: tl.dot multiplies
    the raw uint16 bits it stores bf16 in; float32 -> bf16 casts truncate instead of rounding to nearest
    even; and comparisons return handles typed like their operands, so a scalar comparison splatted to a block
    becomes int data that masks then reject.
    Fix them here, so the kernels run unchanged and round like the GPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_dot, original_cast, original_binary = builder.create_dot, builder.cast_impl, builder.binary_op

    def widen(handle):
        if handle.dtype != tl.bfloat16 or handle.data.dtype != np.uint16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << np.uint32(16)).view(np.float32), tl.float32)

    def create_dot(self, a, b, *args, **kwargs):
        return original_dot(self, widen(a), widen(b), *args, **kwargs)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original_cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)   # round to nearest even
        return interpreter.TensorHandle(rounded.reshape(src.data.shape), tl.bfloat16)

    def binary_op(self, lhs, rhs, op):
        out = original_binary(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:
            out = interpreter.TensorHandle(out.data, tl.int1)
        return out

    builder.create_dot, builder.cast_impl, builder.binary_op = create_dot, cast_impl, binary_op


if INTERPRET:
    _patch_interpreter_bf16()


@pytest.fixture(scope="session")
def nvcc():
    """nvcc's path for the tests that build the C/CUDA libraries (no GPU needed); skips where there is none."""
    from kernels import persistent_loop

    found = persistent_loop.nvcc()
    if found is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin): cannot build the CUDA libraries")
    return found
