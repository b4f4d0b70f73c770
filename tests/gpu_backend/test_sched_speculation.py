"""The GPU loop's speculation, replayed on the host build of the scheduler (kernels/csrc/include/blink_sched.h).

The loop (kernels/csrc/include/blink_loop_spec.cuh) schedules step n+1 on a copy of the hot state over the
shared cold arrays (block tables, block refs, the lookups' marks, ...), with spec_mode set; a step that would
change the cache taints the copy, which is dropped, and the full step schedules again from the real hot state.
Here the same thing on one host buffer: save the hot prefix, schedule with spec_mode, put the prefix back.
Whatever the dropped speculation left in the cold arrays must not change the full step's decisions.
"""
import numpy as np
import pytest

from kernels import sched_host
from protocols.prefix_hash import block_hashes
from protocols.ring import RequestSpec

if sched_host.host_compiler() is None:
    pytest.skip("no C++ compiler on PATH (set CXX or install g++): the native scheduler cannot be built",
                allow_module_level=True)

from gpu_backend.engine.sched_native import SLOT_FREE, NativeScheduler, SchedulerConfig  # noqa: E402

BLOCK, SLOTS = 16, 4
SYSTEM = list(range(100, 170))  # 70 tokens: 4 full blocks shared by every prompt below


def _spec(request_id: int, tail: list[int]) -> RequestSpec:
    prompt = SYSTEM + tail
    return RequestSpec(request_id, prompt, 8, block_hashes=tuple(block_hashes(prompt, BLOCK, "m", "salt")))


def _scheduler() -> NativeScheduler:
    cfg = SchedulerConfig(64, 8, 512, (0,), enable_prefix_caching=True)
    return NativeScheduler(cfg, 96, BLOCK, SLOTS)


def _room() -> np.ndarray:
    return np.full(SLOTS, 100, np.int32)


def _hot_bytes(nat: NativeScheduler) -> int:
    """Bytes of the hot prefix: the cold arrays start right after it (blink_sched_bind_split)."""
    return nat.a["stop_ids"].ctypes.data - nat.state.ctypes.data


def _speculate(nat: NativeScheduler) -> bool:
    """One speculative schedule on a copy of the hot state, dropped afterwards; returns whether it tainted."""
    raw = nat.state.view(np.uint8)
    saved = raw[: _hot_bytes(nat)].copy()
    nat.h.spec_mode, nat.h.spec_tainted = 1, 0
    nat.schedule(_room())
    tainted = bool(nat.h.spec_tainted)
    raw[: len(saved)] = saved
    return tainted


def _run_to_end(nat: NativeScheduler, slot: int) -> None:
    for token in range(2, 100):
        if not nat.schedule(_room()):
            break
        nat.update([token] * nat.h.num_sampled)
    assert nat.a["status"][slot] == SLOT_FREE  # finished: its prompt blocks are published and evictable


def _admit_after_dropped_speculation(nat: NativeScheduler, slot: int, spec: RequestSpec) -> int:
    nat.add(slot, spec, 0)
    assert _speculate(nat), "a speculation that would take cached blocks must taint its step"
    nat.schedule(_room())
    return nat.cached_tokens(slot)


def test_a_dropped_speculation_leaves_no_mark_that_hides_cached_blocks():
    """The full step after a dropped speculation finds the cached prefix the speculation found (on the GPU the
    speculation's marks once hid it: cached_tokens [0, 64, 0, 64, 0] in test_prefix_cache_gpu.py)."""
    nat = _scheduler()
    nat.add(0, _spec(1, [7] * 12), 0)
    _run_to_end(nat, 0)
    assert _admit_after_dropped_speculation(nat, 1, _spec(2, [8] * 30)) == 4 * BLOCK
    assert _admit_after_dropped_speculation(nat, 2, _spec(3, [9] * 45)) == 4 * BLOCK


def test_the_full_step_decides_as_if_nothing_had_been_speculated():
    """Same batch, block tables and counters with and without a dropped speculation before each step."""
    plain, spec = _scheduler(), _scheduler()
    for nat in (plain, spec):
        nat.add(0, _spec(1, [7] * 12), 0)
        _run_to_end(nat, 0)
        nat.add(1, _spec(2, [8] * 30), 0)
        nat.add(2, _spec(3, [9] * 45), 0)
    for token in range(2, 12):
        _speculate(spec)
        batches = [[(e.slot, e.q_len) for e in nat.schedule(_room())] for nat in (plain, spec)]
        assert batches[0] == batches[1]
        for nat in (plain, spec):
            nat.update([token] * nat.h.num_sampled)
    for slot in (1, 2):
        assert plain.block_table(slot) == spec.block_table(slot)
        assert plain.cached_tokens(slot) == spec.cached_tokens(slot) == 4 * BLOCK
    assert plain.prefix_cache_stats() == spec.prefix_cache_stats()
