"""The backend's control plane over real gRPC: Describe, Health, and the standard grpc.health.v1."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocols import control_pb2, control_pb2_grpc
from protocols.ring import RING_VERSION
from protocols.shm import attach_ring

pytestmark = pytest.mark.slow


def test_describe_names_the_model_and_the_ring(live_server):
    with grpc.insecure_channel(live_server.control) as ch:
        d = control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)
    assert d.model_name == live_server.model and d.engine_mode == "cpu" and d.transport == "shm"
    assert d.context_len == 2048 and d.vocab_size > 1000 and len(d.eos_token_ids) >= 1
    assert d.ring_version == RING_VERSION and d.geometry.num_slots == 32
    ring = attach_ring(d.ring_name, fingerprint=d.model_fingerprint)
    assert ring.geometry.max_prompt_len == d.geometry.max_prompt_len == 2048


def test_health_reports_a_live_heartbeat_and_kv_blocks(live_server):
    with grpc.insecure_channel(live_server.control) as ch:
        stub = control_pb2_grpc.ControlStub(ch)
        h1 = stub.Health(control_pb2.HealthRequest(), timeout=5)
        import time

        time.sleep(0.3)
        h2 = stub.Health(control_pb2.HealthRequest(), timeout=5)
    assert h1.state == h2.state == control_pb2.HealthReply.SERVING
    assert h2.heartbeat > h1.heartbeat  # the engine loop is turning, even idle
    assert 0 < h2.free_kv_blocks <= h2.total_kv_blocks


def test_standard_grpc_health_is_serving(live_server):
    import time

    time.sleep(0.6)  # the health mirror updates twice a second
    with grpc.insecure_channel(live_server.control) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
