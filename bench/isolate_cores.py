"""BENCHMARK-ONLY: gives cores to one process for a benchmark's run, as `isolcpus=` or systemd's
`CPUAffinity=` for every other service would on an appliance.

Every thread of this machine that may run on those cores and also elsewhere (other processes, and kernel
threads that are not bound to one core, such as `kdamond` (DAMON's page-out scan on this VM: 1-4 ms on a
core every 0.5 s) or `kcompactd`) is moved off them while the block runs, and put back afterwards. Per-core
kernel threads (`ksoftirqd/N`, `kworker/N:*`, `migration/N`) cannot move and stay, as they would with
`isolcpus=`; so do the threads of the processes named in `keep` (the gateway's own helper threads run
where it runs). Threads started during the block are not moved.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _threads() -> list[tuple[int, int]]:
    """(pid, tid) of every thread of the machine that is still there."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                out += [(int(proc.name), int(task.name)) for task in (proc / "task").iterdir()]
    return out


@contextlib.contextmanager
def isolate_cores(cores: set[int], keep: set[int]):
    """While the block runs, no thread outside the processes `keep` runs on `cores` if it can run elsewhere.
    Yields the names of the threads moved (`comm`)."""
    moved: dict[int, set[int]] = {}
    names = []
    for pid, tid in _threads():
        if pid in keep:
            continue
        try:
            allowed = os.sched_getaffinity(tid)
            if allowed & cores and allowed - cores:
                os.sched_setaffinity(tid, allowed - cores)
                moved[tid] = allowed
                names.append(Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip())
        except OSError:  # gone meanwhile, or bound to its core (EINVAL), or not ours to move (EPERM)
            continue
    try:
        yield names
    finally:
        for tid, allowed in moved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, allowed)
