"""Helpers shared by the kernel wrappers: argument checks (host metadata only, never a device sync)
and cached facts about the device.

Every check reads shapes, dtypes, strides and devices, which live on the host; none reads tensor
contents, so a wrapper that calls them stays capturable in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch


def check(name: str, t: torch.Tensor, *, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
          ndim: int | None = None, shape: tuple[int | None, ...] | None = None,
          device: torch.device | None = None, inner_contiguous: bool = True) -> None:
    """Raise ValueError naming `name` when `t` is not what a kernel expects.

    shape: expected sizes, None for any; inner_contiguous: the last dim has stride 1.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else dtype
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and (t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape))):
        want = tuple("*" if e is None else e for e in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if inner_contiguous and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132 (an H100) under the interpreter, so configs match."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# PDL pays where a step is many short kernels: the batch-1 step (the GEMV path). At batch 8 the dense step's
# GEMMs are cuBLAS's and it lost 1.5% with PDL on (H100, fbfb920); batches 64 and 256 moved under 0.5%.
PDL_AUTO_MAX_TOKENS = 1
_step_tokens: contextvars.ContextVar[int | None] = contextvars.ContextVar("blink_pdl_step_tokens", default=None)


@functools.cache
def pdl_mode() -> str:
    """`BLINK_PDL`: "auto" (the default: on for steps of at most PDL_AUTO_MAX_TOKENS tokens), "1" (every step),
    "0" (never); "off" where the launch does not exist: Triton's interpreter, a GPU before Hopper."""
    mode = os.environ.get("BLINK_PDL", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"BLINK_PDL must be auto, 0 or 1, got {mode!r}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "off"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        return "off"
    return mode  # no GPU: kernels/compile_check.py compiling for sm_90


def pdl_on() -> bool:
    """Programmatic dependent launch for the kernel being launched now (Hopper or later): launched with
    `launch_pdl`, it waits for its predecessor inside the kernel (`gdc_wait`) before its first load and lets its
    successor launch (`gdc_launch_dependents`) once its own loads are done (kernels/pdl.py), so a launch's
    latency hides under the previous kernel's tail. bench/pdl_probe.py measured -0.68 us a kernel on an H100, in
    host replays and the persistent loop's device-launched graphs alike; the batch-1 step of Llama-3-8B shapes
    -2.1%, of Qwen3-30B-A3B -6.7% (bench/RESULTS.md). Every kernel launched so waits before touching memory, so a
    kernel completing implies its predecessors completed; a kernel launched without it (torch, cuBLAS) waits for
    its predecessor whole, as always. Under "auto" the step being built says (`pdl_step`); outside one, off."""
    mode = pdl_mode()
    if mode == "1":
        return True
    if mode != "auto":
        return False
    tokens = _step_tokens.get()
    return tokens is not None and tokens <= PDL_AUTO_MAX_TOKENS


@contextlib.contextmanager
def pdl_step(num_tokens: int):
    """The kernels launched (or captured) inside belong to a step of `num_tokens` tokens: "auto" decides by it."""
    token = _step_tokens.set(num_tokens)
    try:
        yield
    finally:
        _step_tokens.reset(token)


def pdl_launch() -> dict:
    """The launch options `pdl_on` asks for: {"launch_pdl": True} or none."""
    return {"launch_pdl": True} if pdl_on() else {}
