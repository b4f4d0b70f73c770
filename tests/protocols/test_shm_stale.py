"""Stale rings: a ring whose creator died (SIGKILL leaves the file in /dev/shm) is removed by the next
`create_ring` of that name; one whose creator lives is refused, naming the ring and the holder's pid."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from protocols.ring import RingGeometry
from protocols.shm import (SHM_DIR, RingInUseError, attach_ring, create_ring, remove_stale_ring, ring_holder,
                           stable_ring_name, unlink_ring)
from tests.conftest import ROOT

GEOM = RingGeometry(num_slots=4, max_prompt_len=32, max_output_len=8, max_stop_ids=4)
# A child that creates the ring (fingerprint "child") and waits to be killed.
CHILD = ("import sys, time\nfrom protocols.ring import RingGeometry\nfrom protocols.shm import create_ring\n"
         "ring = create_ring(sys.argv[1], RingGeometry(4, 32, 8, 4), 'child')\nprint('ready', flush=True)\n"
         "time.sleep(600)\n")


@pytest.fixture
def name():
    name = f"blink-stale-test-{os.getpid()}"
    yield name
    unlink_ring(name)


def start_holder(name: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, name], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_killed_creators_ring_is_reclaimed(name):
    holder = start_holder(name)
    assert ring_holder(name) == holder.pid
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.path.exists(os.path.join(SHM_DIR, name))  # what SIGKILL leaves behind
    assert ring_holder(name) is None  # the kernel dropped the lock with the process
    ring = create_ring(name, GEOM, "fresh")
    try:
        assert attach_ring(name).fingerprint == "fresh"
        assert ring_holder(name) == os.getpid()
    finally:
        ring.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_live_creators_ring_is_refused_by_name_and_pid(name):
    holder = start_holder(name)
    try:
        with pytest.raises(RingInUseError, match=rf"ring '{name}' .* held by process {holder.pid}"):
            create_ring(name, GEOM, "intruder")
        with pytest.raises(RingInUseError, match=name):
            remove_stale_ring(name)
        assert attach_ring(name).fingerprint == "child"  # untouched
    finally:
        holder.kill()
        holder.wait()


def test_a_ring_file_nobody_locks_is_stale(name):
    with open(os.path.join(SHM_DIR, name), "wb") as f:  # e.g. left by a version that took no lock
        f.write(b"\0" * 4096)
    assert ring_holder(name) is None
    assert remove_stale_ring(name) is True
    assert remove_stale_ring(name) is False  # nothing left


def test_replace_false_refuses_any_existing_ring(name):
    ring = create_ring(name, GEOM, "first")
    try:
        with pytest.raises(RingInUseError, match="already exists"):
            create_ring(name, GEOM, "second", replace=False)
    finally:
        ring.close()


def test_closing_a_ring_unlinks_it_before_dropping_the_lock(name):
    ring = create_ring(name, GEOM, "fp")
    ring.close()
    assert ring_holder(name) is None and not os.path.exists(os.path.join(SHM_DIR, name))
    create_ring(name, GEOM, "again").close()  # the name is free at once


@pytest.mark.parametrize("address, expected", [
    ("127.0.0.1:50051", "blink-127.0.0.1-50051"), ("[::1]:8000", "blink-__1-8000"),
    ("gpu-host.example:50051", "blink-gpu-host.example-50051")])
def test_stable_names_are_file_names(address, expected):
    assert stable_ring_name(address) == expected
    assert stable_ring_name(address, prefix="blink-serve").startswith("blink-serve-")


def test_a_sigkilled_creator_restarted_ten_times_leaves_one_ring(name):
    """The ring-level half of the backend's restart test (tests/gpu_backend/test_backend_restarts.py)."""
    for _ in range(10):
        holder = start_holder(name)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert [f for f in os.listdir(SHM_DIR) if f.startswith(name)] == [name]  # the last one's, and no other
