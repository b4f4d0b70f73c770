"""bench/isolate_cores.py: while the block runs, a process that may run anywhere is kept off the given core,
one named in `keep` is left alone, and both get their cores back afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from isolate_cores import isolate_cores  # noqa: E402

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores: one to give away, one for the rest")
def test_threads_leave_the_isolated_core_while_the_block_runs_and_come_back():
    core = CORES[-1]
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    moved, kept = sleepers
    try:
        time.sleep(0.2)  # started
        assert core in os.sched_getaffinity(moved.pid) and core in os.sched_getaffinity(kept.pid)
        with isolate_cores({core}, keep={kept.pid}) as names:
            assert core not in os.sched_getaffinity(moved.pid)
            assert os.sched_getaffinity(moved.pid) == set(CORES) - {core}
            assert os.sched_getaffinity(kept.pid) == set(CORES)
            assert Path(f"/proc/{moved.pid}/comm").read_text().strip() in names
        assert os.sched_getaffinity(moved.pid) == set(CORES)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_nothing_moves_when_no_core_is_given():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        before = os.sched_getaffinity(sleeper.pid)
        with isolate_cores(set(), keep=set()) as names:
            assert names == []
            assert os.sched_getaffinity(sleeper.pid) == before
    finally:
        sleeper.kill()
        sleeper.wait()
