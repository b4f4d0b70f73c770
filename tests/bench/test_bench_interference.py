"""The interference generator: N threads pinned to the given cores, bounded, and always cleaned up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from blink.bench.collectors import live_group_members, process_tree
from blink.bench.interference import Interference, plan, resolve_cores
from tests.conftest import ROOT


def group_alive(pgid: int) -> bool:
    """A process of the group still runs (zombies waiting for init's reaping do not count)."""
    return bool(live_group_members(pgid))


def test_plan_splits_the_threads():
    assert plan(24) == [("churn", 1), ("build", 11)] + [("bz2", 1)] * 12
    assert sum(j for _, j in plan(3)) == 3 and sum(j for _, j in plan(12)) == 12
    assert plan(2, ("bz2",)) == [("bz2", 1)] * 2
    assert plan(3, ("build",)) == [("build", 3)]
    with pytest.raises(ValueError):
        plan(2, ("sort",))


def test_gateway_cores_are_left_free():
    assert resolve_cores([0, 1, 2, 3], gateway_cores=[2, 3]) == [0, 1]
    with pytest.raises(ValueError, match="gateway"):
        resolve_cores([1], gateway_cores=[1])


def test_workers_are_pinned_and_end_by_themselves():
    it = Interference(threads=3, seconds=1.5, cores=[0, 1], gateway_cores=[1])
    it.start()
    try:
        assert sum(w.jobs for w in it.workers) == 3 and {w.kind for w in it.workers} == {"bz2", "build", "churn"}
        time.sleep(0.6)  # make has started its compilers by now
        tree = [p for w in it.workers for p in process_tree(w.pid)]
        assert len(tree) > len(it.workers)
        for pid in tree:  # children inherit the pinning
            try:
                assert os.sched_getaffinity(pid) == {0}
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 6  # bounded: every group empties without stop()
        while any(w.proc.poll() is None or group_alive(w.pid) for w in it.workers):
            assert time.monotonic() < deadline, "interference outlived its bound"
            time.sleep(0.1)
        assert all(w.proc.poll() == 0 for w in it.workers)
    finally:
        it.stop()
    assert not os.path.exists(it.tmp_dir)


def test_stopped_on_an_exception():
    with pytest.raises(RuntimeError):
        with Interference(threads=2, seconds=60, cores=[0], kinds=("bz2", "build")) as it:
            time.sleep(0.3)
            assert all(group_alive(w.pid) for w in it.workers)
            raise RuntimeError("benchmark failed")
    assert not any(group_alive(w.pid) for w in it.workers)
    assert not os.path.exists(it.tmp_dir)


def test_cli_runs_for_its_bounded_time():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "blink.bench", "interfere", "--threads", "1", "--seconds", "0.5",
                          "--cores", "0"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "'threads': 1" in out.stdout and time.monotonic() - t0 < 10


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_stops_everything_on_a_signal(sig):
    # started as from a script's background job, which inherits SIGINT ignored: the CLI must still stop on it
    cli = subprocess.Popen([sys.executable, "-m", "blink.bench", "interfere", "--threads", "2", "--seconds", "60",
                            "--cores", "0", "--kinds", "bz2"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert "'threads': 2" in cli.stdout.readline()  # printed once the workers are starting
        deadline = time.monotonic() + 10
        while len(workers := process_tree(cli.pid)[1:]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cli.send_signal(sig)
        assert cli.wait(timeout=10) == 0
        assert not any(group_alive(pid) for pid in workers)
    finally:
        cli.kill()
        cli.wait()
