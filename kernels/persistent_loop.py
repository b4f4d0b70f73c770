"""Loader of the GPU-resident loop (`csrc/persistent_loop.cu` over `blink_loop.cuh`, `blink_loop_spec.cuh`,
`blink_loop_ext.cuh`, `blink_sched.h` and `blink_ring.h`):
compiled with nvcc for sm_90 on first use, cached by a hash of the sources, loaded with ctypes.

`LoopArgs`, `LoopCtl` and `LoopExt` mirror the C structs field for field; `load()` checks their sizes against
the library's. The engine that drives it is `gpu_backend/engine/persistent.py`.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
from pathlib import Path

from kernels.sched_host import CSRC, cached_build

SOURCES = (CSRC / "persistent_loop.cu", CSRC / "include" / "blink_loop.cuh", CSRC / "include" / "blink_loop_spec.cuh",
           CSRC / "include" / "blink_loop_ext.cuh", CSRC / "include" / "blink_sched.h", CSRC / "include" / "blink_sched_par.cuh", CSRC / "include" / "blink_ring.h",
           CSRC / "include" / "blink_graph_measure.cuh")
ARCH = os.environ.get("BLINK_CUDA_ARCH", "sm_90")
_u32, _u64, _i64, _p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p


COUNTERS = ("iterations", "steps", "tokens", "busy_ns", "busy_steps", "sched_ns", "idle_polls",  # blink_loop_counters
            "commit_ns", "schedule_ns", "fill_ns", "spec_hits", "spec_misses", "spec_ns", "gap_ns", "gap_steps")
MAX_EOS = 8  # BLINK_SCHED_MAX_EOS


class LoopCtl(ctypes.Structure):  # blink_loop_ctl: pinned, mapped; the host writes `stop` only
    _fields_ = [("stop", _u32), ("exited", _u32)] + [(n, _u64) for n in COUNTERS] + [("error", _u32), ("_pad", _u32)]


class LoopArgs(ctypes.Structure):  # blink_loop_args
    _fields_ = ([("ring", _p)]
                + [(n, _u64) for n in ("sq_offset", "requests_offset", "responses_offset", "request_bytes",
                                       "response_bytes", "prompt_offset")]
                + [(n, _u32) for n in ("num_slots", "max_prompt_len", "max_output_len", "max_stop_ids")]
                + [("sched_mem", _p), ("hot_bytes", _u64), ("smem_bytes", _u32), ("_pad0", _u32)]
                + [(n, _p) for n in ("step_buf", "sampled", "sampled32", "slot_seq", "slot_produced", "room",
                                     "order", "cancel", "par", "ctl")]
                + [("full_exec", _p), ("branch_execs", _p), ("num_branches", _u32),
                   ("check_tail", _u32),
                   ("clock_offset_ns", _i64)]
                + [(n, _u64) for n in ("sq_head", "beats", "generated", "last_commit_ns", "ready_ns",
                                       "take_wait_ns")]
                + [(f"c_{n}", _u64) for n in COUNTERS]
                # the speculation (blink_loop_create fills all but step_buf_alt)
                + [(n, _p) for n in ("step_buf_alt", "hot_alt", "tokens", "stop_ids", "rows", "err_slot", "err_code")]
                + [(n, _u64) for n in ("new_token_offset", "sq_head_alt", "spec_tail")]
                + [(n, _u32) for n in ("cur", "buf", "spec_ok", "spec_branch", "spec_rows", "num_err", "exiting",
                                       "num_eos", "spec_done", "async_take")]
                + [("eos_ids", ctypes.c_int32 * MAX_EOS)]
                + [("ext", _p)])  # a LoopExt in device memory, or None: no sampling extensions


class LoopExt(ctypes.Structure):  # blink_loop_ext (blink_loop_ext.cuh): device memory, set by the engine
    _fields_ = ([(n, _p) for n in ("logits", "scratch", "lp_chosen", "lp_ids", "lp_vals", "post_graphs", "flags",
                                   "num_logprobs", "prompt_len", "num_bias", "capacity", "penalties", "bias_ids",
                                   "bias_vals", "row_slot", "slot_row")]
                + [(n, _u64) for n in ("bias_offset", "bias_bytes", "lp_offset", "lp_bytes", "lp_ids_offset",
                                       "lp_top_offset", "off_sample_rows", "off_seq_ids", "off_sample_pos")]
                + [(n, _u32) for n in ("vocab", "max_rows", "lp_k", "max_bias", "window", "max_logprobs",
                                       "num_buckets", "context_len")]
                + [("num_rows", _u32 * 2), ("extended", _u32 * 2), ("pub_buf", _u32), ("_pad", _u32)])


def nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME (default /usr/local/cuda); None when there is none."""
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    return found if Path(found).exists() else None


def build() -> Path:
    """The library: $BLINK_LOOP_LIB when set (prebuilt, e.g. in a container image without nvcc), else
    compiled now unless a build of these exact sources is cached."""
    prebuilt = os.environ.get("BLINK_LOOP_LIB")
    if prebuilt:
        if not Path(prebuilt).is_file():
            raise RuntimeError(f"BLINK_LOOP_LIB={prebuilt}: no such file")
        return Path(prebuilt)
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME/bin): --mode persistent compiles its loop with it")
    argv = [compiler, f"-arch={ARCH}", "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
            "-rdc=true", "-I", str(CSRC / "include"), str(SOURCES[0]), "-lcudadevrt"]  # device graph launch
    return cached_build("persistent_loop", SOURCES, argv)


@functools.cache
def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    i32, pp = ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "blink_loop_args_bytes": (_u64, []),
        "blink_loop_ctl_bytes": (_u64, []),
        "blink_loop_ext_bytes": (_u64, []),
        "blink_loop_register": (i32, [_p, _u64, pp]),
        "blink_loop_unregister": (i32, [_p]),
        "blink_loop_alloc_ctl": (i32, [pp, pp]),
        "blink_loop_read_globaltimer": (i32, [ctypes.POINTER(_u64)]),
        "blink_loop_create": (i32, [ctypes.POINTER(LoopArgs), pp, pp, _u32, pp]),
        "blink_loop_take_linked": (_u32, [_p]),
        "blink_loop_launch": (i32, [_p]),
        "blink_loop_smem_bytes": (_u32, [_p]),
        "blink_loop_poll": (i32, [_p]),
        "blink_loop_destroy": (i32, [_p]),
        "blink_loop_bench_mechanism": (i32, [_p, _u32, _u32, ctypes.c_int32, ctypes.POINTER(ctypes.c_double)]),
        "blink_loop_stamps": (i32, [ctypes.c_int32, _u32, ctypes.POINTER(ctypes.c_double)]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    for name, struct in (("blink_loop_args_bytes", LoopArgs), ("blink_loop_ctl_bytes", LoopCtl),
                         ("blink_loop_ext_bytes", LoopExt)):
        if getattr(lib, name)() != ctypes.sizeof(struct):
            raise RuntimeError(f"{name}: the library's struct is {getattr(lib, name)()} bytes, "
                               f"kernels/persistent_loop.py's {ctypes.sizeof(struct)}")
    return lib


def check(code: int, what: str) -> None:
    """Library calls return 0 or (step * 1000 + cudaError_t)."""
    if code:
        step, err = divmod(code, 1000)
        raise RuntimeError(f"{what} failed at step {step}: cudaError {err}")
