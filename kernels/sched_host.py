"""Loader of the host build of the scheduling step and the ring's admission check (`csrc/sched_host.cpp` over
`csrc/include/blink_sched.h` and `blink_admit.h`): compiled with the host C++ compiler on first use, cached by a
hash of the sources, loaded with ctypes.

No triton, no torch: the `cpu` engine and CI load it on machines with no GPU. The scheduler's Python face
is `gpu_backend/engine/sched_native.py`.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from protocols import native_build
from protocols.native_build import find_compiler

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "sched_host.cpp", *(CSRC / "include" / name for name in (
    "blink_sched.h", "blink_prefix_cache.h", "blink_block_hash.h", "blink_admit.h", "blink_ring.h",
    "blink_sched_layout.h", "blink_step_layout.h", "blink_ring_layout.h")))  # *_layout.h generated (*_decl.py)
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")


class AdmitLimits(ctypes.Structure):
    """blink_admit_limits (csrc/include/blink_admit.h): the ring's geometry and the model's vocabulary, the
    engine's own values (never read from the ring). `load` checks its size against the build's."""

    _fields_ = [(name, ctypes.c_uint32) for name in ("max_prompt_len", "max_stop_ids", "max_logit_bias", "max_logprobs",
                                                     "vocab", "max_block_hashes", "kv_block_size", "mask_words")]


def host_compiler() -> str | None:
    """$CXX, else the first of g++, c++, clang++ on PATH; None when there is none."""
    return find_compiler((os.environ.get("CXX"), "g++", "c++", "clang++"))


def cache_dir() -> Path:
    # the cache gpu_backend/models/demo.py uses ($BLINK_CACHE, else ~/.cache/blink); kernels/ imports no gpu_backend
    return Path(os.environ.get("BLINK_CACHE") or Path.home() / ".cache" / "blink").expanduser() / "kernels"


def build() -> Path:
    """The shared library's path, compiled now unless a build of these exact sources is cached."""
    cxx = host_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX or install g++): the native scheduler needs one")
    return cached_build("sched_host", SOURCES, [cxx, *FLAGS, "-I", str(CSRC / "include"), str(SOURCES[0])])


def cached_build(stem: str, sources: tuple[Path, ...], argv: list[str]) -> Path:
    """`protocols.native_build.cached_build` into the kernels' cache folder."""
    return native_build.cached_build(stem, sources, argv, cache_dir())


@functools.cache
def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    p, i32, i64, u64, f32, f64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float, ctypes.c_double
    u32 = ctypes.c_uint32
    sigs = {
        "blink_sched_state_bytes": (u64, [p]),
        "blink_sched_step_layout": (u64, [i32, i32, i32, p]),
        "blink_sched_host_init": (None, [p, p]),
        "blink_sched_host_bind": (None, [p, p]),
        "blink_sched_host_check": (i32, [p, i32, i64, f64, f64, i32, f64]),
        "blink_sched_host_add": (None, [p, i32, p, i32, i64, i64, p, i32, i32, f32, i32, f32, f32, u64, p, i32]),
        "blink_sched_host_finish": (None, [p, i32]),
        "blink_sched_host_schedule": (i32, [p, p, p]),
        "blink_sched_host_fill": (i32, [p, p, i32]),
        "blink_sched_host_update": (None, [p, p]),
        "blink_admit_host_error": (i32, [p, p, p, p, u32, p, u32, p, p, u32, i32]),
        "blink_admit_limits_bytes": (u64, []),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.blink_admit_limits_bytes() != ctypes.sizeof(AdmitLimits):
        raise RuntimeError(f"AdmitLimits ({ctypes.sizeof(AdmitLimits)} bytes) does not match blink_admit_limits "
                           f"({lib.blink_admit_limits_bytes()} bytes): kernels/sched_host.py and blink_admit.h differ")
    return lib
