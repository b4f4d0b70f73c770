"""Loader of the tensor-parallel library (`csrc/tp_comm.cu`: the one-shot all-reduce over peer memory, the step
buffer's announce and wait, the followers' device-launched loop), compiled with nvcc on first use like the
GPU-resident loop's library, and `TpComm`, its handle for one group of ranks in this process.

The kernels go into the ranks' captured step graphs (gpu_backend/parallel/); every launch takes the stream to
run on (torch's current stream, captured when it is capturing). Nothing here runs per step on the host.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from kernels.persistent_loop import library_argv, prebuilt_library
from kernels.sched_host import CSRC, cached_build

SOURCE = CSRC / "tp_comm.cu"
SOURCES = (SOURCE, CSRC / "include" / "blink_sys_mem.cuh")
_p, _u32, _u64, _i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32
DEFAULT_TIMEOUT_S = float(os.environ.get("BLINK_TP_TIMEOUT_S", "10"))  # a peer silent this long is dead


def build() -> Path:
    """The library: $BLINK_TP_LIB when set (prebuilt, e.g. in a container image without nvcc), else compiled now
    unless a build of this exact source is cached (needs nvcc)."""
    prebuilt = prebuilt_library("BLINK_TP_LIB")
    if prebuilt:
        return prebuilt
    return cached_build("tp_comm", SOURCES, library_argv(SOURCE, "--tensor-parallel-size"))


@functools.cache
def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    pp = ctypes.POINTER(_p)
    sigs = {
        "blink_tp_rank_bytes": (_u64, []),
        "blink_tp_create": (_i32, [_u32, ctypes.POINTER(_i32), _u64, _u64, pp]),
        "blink_tp_rank_ptr": (_p, [_p, _u32]),
        "blink_tp_set_step_buffer": (_i32, [_p, _u32, _u32, _p, _u64, _u64, _u64]),
        "blink_tp_set_live": (_i32, [_p, _u32]),
        "blink_tp_set_stop": (None, [_p, _u32]),
        "blink_tp_fault": (_u32, [_p]),
        "blink_tp_allreduce": (_i32, [_p, _p, _u64, _u32, _p]),
        "blink_tp_announce": (_i32, [_p, _u32, _u32, _p]),
        "blink_tp_wait": (_i32, [_p, _p]),
        "blink_tp_follower_create": (_i32, [_p, _u32, pp, _u32, pp]),
        "blink_tp_follower_launch": (_i32, [_p]),
        "blink_tp_follower_poll": (_i32, [_p]),
        "blink_tp_follower_destroy": (_i32, [_p]),
        "blink_tp_destroy": (_i32, [_p]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"tensor parallel: {what} failed (cudaError {code})")


class TpComm:
    """One tensor-parallel group: the ranks' devices (rank 0 leads), peer access between them, their exchange
    buffers (`max_elems` 16-bit elements: max tokens x hidden) and flags. `rank(r)` gives the per-rank handle
    the runner's kernels take."""

    def __init__(self, devices: list[int], max_elems: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.lib, self.devices, self.world = load(), list(devices), len(devices)
        self._handle = _p()
        arr = (_i32 * self.world)(*self.devices)
        _check(self.lib.blink_tp_create(self.world, arr, max_elems, int(timeout_s * 1e9), ctypes.byref(self._handle)),
               f"setting up peer access and buffers on GPUs {self.devices}")
        self.max_elems, self.timeout_s = max_elems, timeout_s

    def rank(self, r: int) -> RankComm:
        return RankComm(self, r, self.lib.blink_tp_rank_ptr(self._handle, r))

    def set_step_buffer(self, rank: int, step_set: int, ptr: int, block_tables_offset: int, block_row_bytes: int,
                        num_seqs_offset: int) -> None:
        _check(self.lib.blink_tp_set_step_buffer(self._handle, rank, step_set, ptr, block_tables_offset,
                                                 block_row_bytes, num_seqs_offset), "registering a step buffer")

    def set_live(self, on: bool) -> None:
        """On: every rank runs every step (the kernels wait for their peers). Off: each rank alone (start-up)."""
        _check(self.lib.blink_tp_set_live(self._handle, int(on)), "setting the group live")

    def set_stop(self, on: bool) -> None:
        self.lib.blink_tp_set_stop(self._handle, int(on))

    @property
    def fault(self) -> int:
        """0, or 1 + the rank that waited past the timeout for a peer (a rank died or stalled)."""
        return int(self.lib.blink_tp_fault(self._handle))

    def follower_loop(self, rank: int, graphs: list[int], num_buckets: int) -> FollowerLoop:
        return FollowerLoop(self, rank, graphs, num_buckets)

    def close(self) -> None:
        if self._handle:
            self.lib.blink_tp_destroy(self._handle)
            self._handle = _p()


class RankComm:
    """One rank's side of a `TpComm`: the launches its captured graphs hold."""

    def __init__(self, comm: TpComm, rank: int, ptr: int):
        self.comm, self.rank, self.world, self._ptr = comm, rank, comm.world, ptr

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, x, stream: int) -> None:
        """Sum x (contiguous bf16/fp16, on this rank's device) over the ranks, in place, on `stream`."""
        n = x.numel()
        if n > self.comm.max_elems:
            raise ValueError(f"all-reduce of {n} elements over the {self.comm.max_elems} the buffers hold")
        fp16 = 1 if str(x.dtype) == "torch.float16" else 0
        _check(self.comm.lib.blink_tp_allreduce(self._ptr, x.data_ptr(), n, fp16, stream), "all-reduce launch")

    def announce(self, step_set: int, bucket_index: int, stream: int) -> None:
        _check(self.comm.lib.blink_tp_announce(self._ptr, step_set, bucket_index, stream), "announce launch")

    def wait(self, stream: int) -> None:
        _check(self.comm.lib.blink_tp_wait(self._ptr, stream), "wait launch")


class FollowerLoop:
    """A follower rank's device-launched loop over its captured graphs (persistent mode): `graphs` are the raw
    cudaGraph_t of (set, bucket) in the order set * num_buckets + bucket; the caller keeps them alive."""

    def __init__(self, comm: TpComm, rank: int, graphs: list[int], num_buckets: int):
        self.comm, self.rank = comm, rank
        self._graphs = (_p * len(graphs))(*graphs)
        self._handle = _p()
        _check(comm.lib.blink_tp_follower_create(comm._handle, rank, self._graphs, num_buckets,
                                                 ctypes.byref(self._handle)), f"building rank {rank}'s loop")

    def launch(self) -> None:
        _check(self.comm.lib.blink_tp_follower_launch(self._handle), f"launching rank {self.rank}'s loop")

    def poll(self) -> int:
        """0 running, 1 ended (or closed), else the CUDA error that ended it."""
        if not self._handle:
            return 1
        return int(self.comm.lib.blink_tp_follower_poll(self._handle))

    def close(self) -> None:
        if self._handle:
            self.comm.lib.blink_tp_follower_destroy(self._handle)
            self._handle = _p()
