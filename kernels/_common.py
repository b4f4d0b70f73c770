"""Helpers shared by the kernel wrappers: argument checks (host metadata only, never a device sync)
and cached facts about the device.

Every check reads shapes, dtypes, strides and devices, which live on the host; none reads tensor
contents, so a wrapper that calls them stays capturable in a CUDA graph.
"""

from __future__ import annotations

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


@functools.cache
def pdl_on() -> bool:
    """Programmatic dependent launch for the decode step's kernels (opt-in, `BLINK_PDL=1`; Hopper or later):
    each is launched with `launch_pdl`, waits for its predecessor (`gdc_wait`) before its first load and lets
    its successor launch (`gdc_launch_dependents`) once its own loads are done, so a launch's latency hides
    under the previous kernel's tail. bench/pdl_probe.py measured -0.68 us a kernel on an H100, in host
    replays and in the persistent loop's device-launched graphs alike. Every kernel launched so waits before
    touching memory, so a kernel completing implies its predecessors completed; a kernel launched without it
    (torch, cuBLAS) waits for its predecessor whole, as always. Off under Triton's interpreter."""
    if os.environ.get("BLINK_PDL", "0") != "1" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0] >= 9
    return True  # kernels/compile_check.py: compiling for sm_90 on a machine with no GPU


def pdl_launch() -> dict:
    """The launch options `pdl_on` asks for: {"launch_pdl": True} or none."""
    return {"launch_pdl": True} if pdl_on() else {}
