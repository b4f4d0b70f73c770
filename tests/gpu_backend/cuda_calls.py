"""Count the host's CUDA runtime and driver API calls over a window, with CUPTI's callback API (GPU tests).

`torch.profiler` turns on CUPTI's activity tracing too, which records every kernel; with the persistent loop's
device-launched graphs that made a window of 150 steps take minutes. Callbacks alone cost nothing until the host
calls CUDA, and then tell which function it called: what a "no host CUDA call per step" test needs.

    with CudaCalls() as calls:          # subscribe before the persistent loop starts (see below)
        ... start the loop ...
        with calls.window():
            ... decode for a while ...
    assert len(calls.names) < 10, calls.names

Subscribe before the persistent kernel runs: on an H100, `cuptiEnableDomain` called while the loop's kernel
was resident never returned (it waits for the device to go idle, which a persistent loop never does).

CUPTI allows one subscriber per process: use it in a child process, not beside `torch.profiler`.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

DRIVER_API, RUNTIME_API = 1, 2     # CUpti_CallbackDomain
API_ENTER = 0                      # CUpti_ApiCallbackSite


class _CallbackData(ctypes.Structure):
    """The head of CUpti_CallbackData (cupti_callbacks.h), as far as the function's name."""
    _fields_ = [("callback_site", ctypes.c_int), ("function_name", ctypes.c_char_p)]


_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p)


def _load_cupti() -> ctypes.CDLL:
    """libcupti: the one torch's profiler loads (the nvidia wheels beside torch), else the CUDA toolkit's."""
    names = ["libcupti.so.13", "libcupti.so.12", "libcupti.so"]
    for root in sys.path:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcupti.so*"), recursive=True))
    names += sorted(glob.glob("/usr/local/cuda*/extras/CUPTI/lib64/libcupti.so*"))
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise RuntimeError("no libcupti found: " + "; ".join(errors[:4]))


class CudaCalls:
    """Names of the CUDA runtime and driver API functions the host called inside the `with` block."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._lib = _load_cupti()
        self._callback = _CALLBACK(self._on_call)  # kept alive as long as CUPTI may call it
        self._subscriber = ctypes.c_void_p()
        self._recording = False

    def window(self) -> "_Window":
        """Record the calls made inside this block (the callbacks run from subscription on)."""
        return _Window(self)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            message = ctypes.c_char_p()
            self._lib.cuptiGetResultString(status, ctypes.byref(message))
            raise RuntimeError(f"{what}: CUPTI error {status} ({(message.value or b'?').decode()})")

    def _on_call(self, _userdata, _domain, _cbid, data) -> None:
        record = ctypes.cast(data, ctypes.POINTER(_CallbackData)).contents
        if self._recording and record.callback_site == API_ENTER:
            self.names.append((record.function_name or b"?").decode())

    def __enter__(self) -> "CudaCalls":
        self._check(self._lib.cuptiSubscribe(ctypes.byref(self._subscriber), self._callback, None), "cuptiSubscribe")
        for domain in (DRIVER_API, RUNTIME_API):
            self._check(self._lib.cuptiEnableDomain(1, self._subscriber, domain), "cuptiEnableDomain")
        return self

    def __exit__(self, *_exc) -> None:
        for domain in (DRIVER_API, RUNTIME_API):
            self._lib.cuptiEnableDomain(0, self._subscriber, domain)
        self._check(self._lib.cuptiUnsubscribe(self._subscriber), "cuptiUnsubscribe")


class _Window:
    def __init__(self, calls: CudaCalls) -> None:
        self._calls = calls

    def __enter__(self) -> CudaCalls:
        self._calls._recording = True
        return self._calls

    def __exit__(self, *_exc) -> None:
        self._calls._recording = False
