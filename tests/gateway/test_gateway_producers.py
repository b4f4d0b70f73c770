"""Every transport's producer has the whole `RingProducer` interface the gateway's backends use."""
from __future__ import annotations

import inspect

import pytest

from gateway.backends.tcp_producer import TcpProducer
from protocols.producer import RingProducer
from protocols.rdma import RdmaProducer
from protocols.shm_producer import ShmProducer

MEMBERS = sorted(name for name in vars(RingProducer) if not name.startswith("_"))


def test_the_protocol_names_what_a_backend_calls():
    assert {"submit", "poll", "ready_slots", "cancel", "release", "reclaim", "heartbeat", "free_slots",
            "connected", "engine_state", "engine_stats", "close"} <= set(MEMBERS)


@pytest.mark.parametrize("producer", [ShmProducer, RdmaProducer, TcpProducer])
def test_each_producer_has_every_member(producer):
    missing = [name for name in MEMBERS if not hasattr(producer, name)]
    assert not missing, f"{producer.__name__} lacks {missing}"
    for name in MEMBERS:  # a property stays a property, a method a method
        is_property = isinstance(inspect.getattr_static(RingProducer, name), property)
        assert isinstance(inspect.getattr_static(producer, name), property) == is_property, (producer, name)
