"""grpc.health.v1 on the backend: a stalled heartbeat is judged by the engine mode's own time (issue 21, item 7)."""
import os

import pytest

from gpu_backend.control_server import ControlServer
from protocols.messages import STALL_AFTER_S, BackendDescription
from protocols.ring import RingGeometry
from protocols.shm import create_ring


@pytest.fixture
def ring():
    ring = create_ring(f"blink-test-health-{os.getpid()}", RingGeometry(4, 64, 16), "fp")
    yield ring
    ring.close()


@pytest.mark.parametrize("mode", ["cpu", "host", "persistent"])
def test_each_mode_gets_its_own_stall_time(ring, mode):
    desc = BackendDescription("m", "", "fp", 64, 100, (), mode)
    server = ControlServer("127.0.0.1:0", desc, ring)
    try:
        assert server.watch.stale_after_s == STALL_AFTER_S[mode]
    finally:
        server.server.stop(None)


def test_an_explicit_time_wins(ring):
    desc = BackendDescription("m", "", "fp", 64, 100, (), "cpu")
    server = ControlServer("127.0.0.1:0", desc, ring, stale_after_s=0.5)
    try:
        assert server.watch.stale_after_s == 0.5
    finally:
        server.server.stop(None)
