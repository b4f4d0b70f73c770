"""Loader of the GPU-resident loop (`csrc/persistent_loop.cu` over `blink_loop.cuh`, `blink_loop_build.cuh`,
`blink_loop_spec.cuh`, `blink_loop_ext.cuh`, `blink_sched.h`, `blink_ring.h` and `blink_admit.h`):
compiled with nvcc for sm_90 on first use, cached by a hash of the sources, loaded with ctypes.

`LoopArgs`, `LoopCtl`, `LoopExt` and the options struct are generated from `kernels/loop_decl.py` (as is
their C side, `blink_loop_layout.h`); `load()` checks their sizes against the library's. How the loop is
built is a `LoopOptions` (the one place its environment variables are read). The product library has no
benchmark probes; `load(bench=True)` builds the one that has them (`-DBLINK_BENCH_PROBES`, for bench/).
The engine that drives it is `gpu_backend/engine/persistent.py`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kernels.loop_layout import (MAX_EOS, LoopArgs, LoopCounters, LoopCtl, LoopError, LoopExt, LoopFault,
                                 LoopOptionsStruct)
from kernels.sched_host import CSRC, cached_build

__all__ = ["ARCH", "COUNTERS", "MAX_EOS", "LoopArgs", "LoopCtl", "LoopError", "LoopExt", "LoopFault", "LoopOptions",
           "build", "check", "ctl_values", "fault_message", "load", "nvcc"]

_INCLUDE = CSRC / "include"
SOURCES = (CSRC / "persistent_loop.cu", *(_INCLUDE / name for name in (
    "blink_loop.cuh", "blink_loop_build.cuh", "blink_loop_spec.cuh", "blink_loop_ext.cuh", "blink_loop_layout.h",
    "blink_sched.h", "blink_prefix_cache.h", "blink_block_hash.h", "blink_sched_layout.h", "blink_step_layout.h",
    "blink_sched_par.cuh", "blink_ring.h", "blink_ring_layout.h", "blink_admit.h", "blink_sys_mem.cuh")))
BENCH_SOURCES = (_INCLUDE / "blink_loop_bench.cuh", _INCLUDE / "blink_graph_measure.cuh")
ARCH = os.environ.get("BLINK_CUDA_ARCH", "sm_90")
_u32, _u64, _p = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
COUNTERS = tuple(name for name, _ in LoopCounters._fields_)  # blink_loop_counters


@dataclass(frozen=True)
class LoopOptions:
    """How `blink_loop_create` builds the loop. The defaults are the product's; every other value is for
    measuring (bench/loop_ab.py). `from_env` reads the BLINK_LOOP_* variables, here and nowhere else."""

    smem: bool = True  # the scheduler's hot state in shared memory when it fits (BLINK_LOOP_SMEM=0: global)
    spec_tail_check: bool = True  # requests queued after the speculation looked drop it (BLINK_LOOP_SPEC_TAIL_CHECK=0)
    async_take: bool = True  # launch the next step before the tokens come (BLINK_LOOP_ASYNC=0: wait for them)
    spec_priority: bool = True  # side kernels at the greatest node priority (BLINK_LOOP_SPEC_PRIORITY=0)
    side_root: bool = False  # publish -> spec as a root of each bucket graph (BLINK_LOOP_SIDE_ROOT=1)
    spec_at: float | None = None  # publish -> spec after the node at this fraction of the model graph
    #                               (BLINK_LOOP_SPEC_AT=f, 0..1; None: after its first node)
    plain_edges: bool = False  # the model graph's programmatic edges made plain (BLINK_LOOP_PLAIN_EDGES=1; bench build)
    stamps: bool = False  # stamp kernels after the model's nodes (BLINK_LOOP_STAMPS=1; bench build)
    spinner_ns: int = 0  # a block holding an SM this long beside each graph (BLINK_LOOP_SPINNER_NS; bench build)
    spec_masked: bool = True  # speculate past steps with token-masked rows too (BLINK_LOOP_SPEC_MASKED=0: not; H200,
    #                           64 constrained streams: TPOT 1.028x -> 1.011x plain, bench/RESULTS.md)

    def __post_init__(self) -> None:
        if self.spec_at is not None and not 0.0 <= self.spec_at <= 1.0:
            raise ValueError(f"LoopOptions.spec_at: {self.spec_at} is outside 0..1")
        if not 0 <= self.spinner_ns < 1 << 64:
            raise ValueError(f"LoopOptions.spinner_ns: {self.spinner_ns} must be a non-negative 64-bit int")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LoopOptions:
        """The options the BLINK_LOOP_* variables of `env` (default os.environ) ask for."""
        env = os.environ if env is None else env
        spec_at = env.get("BLINK_LOOP_SPEC_AT")
        spinner = env.get("BLINK_LOOP_SPINNER_NS")
        try:
            return cls(smem=env.get("BLINK_LOOP_SMEM") != "0",
                       spec_tail_check=env.get("BLINK_LOOP_SPEC_TAIL_CHECK") != "0",
                       async_take=env.get("BLINK_LOOP_ASYNC") != "0",
                       spec_priority=env.get("BLINK_LOOP_SPEC_PRIORITY") != "0",
                       side_root=env.get("BLINK_LOOP_SIDE_ROOT") == "1",
                       spec_at=None if spec_at is None else float(spec_at),
                       plain_edges=env.get("BLINK_LOOP_PLAIN_EDGES") == "1",
                       stamps=env.get("BLINK_LOOP_STAMPS") == "1",
                       spinner_ns=int(spinner) if spinner else 0,
                       spec_masked=env.get("BLINK_LOOP_SPEC_MASKED") != "0")
        except ValueError as exc:
            raise ValueError(f"a BLINK_LOOP_* environment variable: {exc}") from None

    @property
    def needs_bench_build(self) -> bool:
        """Options only the library with the benchmark probes implements (`load(bench=True)`)."""
        return self.stamps or self.plain_edges or self.spinner_ns > 0

    def to_struct(self) -> LoopOptionsStruct:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec_at"}
        return LoopOptionsStruct(**{k: int(v) for k, v in fields.items()},
                                 spec_at=-1.0 if self.spec_at is None else self.spec_at)


def fault_message(code: int) -> str:
    """What `LoopCtl.error` says, for a log line."""
    try:
        return LoopFault(code).message
    except ValueError:
        return f"unknown fault {code}"


def ctl_values(ctl: LoopCtl) -> dict[str, int]:
    """The control block's words and counters, flat (`exited`, `error`, `steps`, ...)."""
    return {"stop": ctl.stop, "exited": ctl.exited, "error": ctl.error, **{n: getattr(ctl, n) for n in COUNTERS}}


def nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME (default /usr/local/cuda); None when there is none."""
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    return found if Path(found).exists() else None


def prebuilt_library(variable: str) -> Path | None:
    """The library the environment variable names (prebuilt: a container image without nvcc), None when unset."""
    value = os.environ.get(variable)
    if not value:
        return None
    if not Path(value).is_file():
        raise RuntimeError(f"{variable}={value}: no such file")
    return Path(value)


def library_argv(source: Path, needed_by: str) -> list[str]:
    """nvcc's command for a shared library of `source` with device graph launch (-rdc, cudadevrt), as the loop
    and tensor parallelism's kernels build; RuntimeError naming `needed_by` when there is no nvcc."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError(f"nvcc not found (PATH, $CUDA_HOME/bin): {needed_by} compiles its kernels with it")
    return [compiler, f"-arch={ARCH}", "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
            "-rdc=true", "-I", str(_INCLUDE), str(source), "-lcudadevrt"]


def build(bench: bool = False) -> Path:
    """The library: $BLINK_LOOP_LIB when set (prebuilt, e.g. in a container image without nvcc; not for
    `bench`), else compiled now unless a build of these exact sources is cached. `bench`: with the benchmark
    probes (-DBLINK_BENCH_PROBES), cached apart."""
    prebuilt = None if bench else prebuilt_library("BLINK_LOOP_LIB")
    if prebuilt:
        return prebuilt
    argv = library_argv(SOURCES[0], "--mode persistent")
    if bench:
        return cached_build("persistent_loop_bench", SOURCES + BENCH_SOURCES, [*argv, "-DBLINK_BENCH_PROBES"])
    return cached_build("persistent_loop", SOURCES, argv)


def load(bench: bool = False) -> ctypes.CDLL:
    """The loop's library (`bench`: the build with the benchmark probes), its functions typed and its
    structs' sizes checked against the generated ctypes views; loaded once per kind."""
    return _load(bool(bench))


@functools.cache
def _load(bench: bool) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(bench)))
    i32, pp = ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "blink_loop_args_bytes": (_u64, []),
        "blink_loop_ctl_bytes": (_u64, []),
        "blink_loop_ext_bytes": (_u64, []),
        "blink_loop_options_bytes": (_u64, []),
        "blink_loop_has_bench_probes": (_u32, []),
        "blink_loop_register": (i32, [_p, _u64, pp]),
        "blink_loop_unregister": (i32, [_p]),
        "blink_loop_alloc_ctl": (i32, [pp, pp]),
        "blink_loop_read_globaltimer": (i32, [ctypes.POINTER(_u64)]),
        "blink_loop_create": (i32, [ctypes.POINTER(LoopArgs), ctypes.POINTER(LoopOptionsStruct), pp, pp, _u32, pp]),
        "blink_loop_take_linked": (_u32, [_p]),
        "blink_loop_launch": (i32, [_p]),
        "blink_loop_smem_bytes": (_u32, [_p]),
        "blink_loop_poll": (i32, [_p]),
        "blink_loop_destroy": (i32, [_p]),
    }
    if bench:
        sigs["blink_loop_bench_mechanism"] = (i32, [_p, _u32, _u32, ctypes.c_int32, _u32, ctypes.POINTER(ctypes.c_double)])
        sigs["blink_loop_stamps"] = (i32, [ctypes.c_int32, _u32, ctypes.POINTER(ctypes.c_double)])
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    for name, struct in (("blink_loop_args_bytes", LoopArgs), ("blink_loop_ctl_bytes", LoopCtl),
                         ("blink_loop_ext_bytes", LoopExt), ("blink_loop_options_bytes", LoopOptionsStruct)):
        if getattr(lib, name)() != ctypes.sizeof(struct):
            raise RuntimeError(f"{name}: the library's struct is {getattr(lib, name)()} bytes, "
                               f"kernels/loop_layout.py's {ctypes.sizeof(struct)} (rebuild: stale cache?)")
    return lib


def check(code: int, what: str) -> None:
    """Library calls return 0 or LoopError * 1000 + cudaError_t: raise RuntimeError naming both."""
    if not code:
        return
    stage, err = divmod(code, 1000)
    try:
        error = LoopError(stage)
    except ValueError:
        raise RuntimeError(f"{what} failed with unknown code {code}") from None
    cuda = f" (cudaError {err})" if err else ""
    raise RuntimeError(f"{what} failed: {error.name}: {error.message}{cuda}")
