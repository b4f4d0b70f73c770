"""The backend's control plane: `Control.Describe` / `Control.Health` plus the standard grpc.health.v1.

It reads liveness from the ring header (the engine's heartbeat), never from the engine's Python state,
so it reports the same thing whichever engine mode runs, including a GPU loop with no host thread.
With `tls` (BackendConfig.control_ssl_*, protocols/mtls.py) every service on it, health included, is
served over TLS, and with client certificates required a gateway without one signed by the CA is refused
at the handshake; `tls.reload()` (SIGHUP) gives new connections the files' new certificate.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protocols import control_pb2, control_pb2_grpc
from protocols.messages import STALL_AFTER_OTHER_S, STALL_AFTER_S
from protocols.mtls import ServerTls
from protocols.messages import BackendDescription as Description  # the shared message, by the name used here
from protocols.ring import EngineState
from protocols.shm import ShmRing


class HeartbeatWatch:
    """Tracks when the heartbeat last moved; stale after `stale_after_s` without a change."""

    def __init__(self, ring: ShmRing, stale_after_s: float = 2.0):
        self.ring, self.stale_after_s = ring, stale_after_s
        self._last, self._last_change = ring.heartbeat, time.monotonic()

    def age_s(self) -> float:
        beat = self.ring.heartbeat
        if beat != self._last:
            self._last, self._last_change = beat, time.monotonic()
        return time.monotonic() - self._last_change

    def state(self) -> int:
        engine = self.ring.engine_state
        if engine in (EngineState.STOPPING, EngineState.STOPPED):
            return control_pb2.HealthReply.STOPPING
        if engine is EngineState.STARTING:
            return control_pb2.HealthReply.UNKNOWN
        return control_pb2.HealthReply.STALLED if self.age_s() > self.stale_after_s else control_pb2.HealthReply.SERVING


class ControlService(control_pb2_grpc.ControlServicer):
    def __init__(self, desc: Description, ring: ShmRing, watch: HeartbeatWatch, rdma=None):
        self.desc, self.ring, self.watch = desc, ring, watch
        self.rdma = rdma  # gpu_backend.rdma_export.RdmaExport when the rdma transport is served
        self._lock = threading.Lock()

    def Describe(self, request, context):
        return self.desc.to_reply(self.ring.name, self.ring.geometry)

    def ConnectRdma(self, request, context):
        from protocols.rdma_verbs import endpoint_from_proto, endpoint_to_proto

        if self.rdma is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this backend serves the {self.desc.transport} transport, not rdma")
        try:
            return endpoint_to_proto(self.rdma.connect(endpoint_from_proto(request)))
        except Exception as exc:  # a verbs error: say what failed instead of a bare UNKNOWN
            context.abort(grpc.StatusCode.INTERNAL, f"rdma connect failed: {exc}")

    def Health(self, request, context):
        with self._lock:
            stats = self.ring.stats()
            return control_pb2.HealthReply(
                state=self.watch.state(), heartbeat=self.ring.heartbeat, heartbeat_age_s=self.watch.age_s(),
                running=stats["running"], waiting=stats["waiting"], free_kv_blocks=stats["free_kv_blocks"],
                total_kv_blocks=stats["total_kv_blocks"], generated_tokens=stats["generated_tokens"],
            )


class ControlServer:
    """gRPC server plus a thread that mirrors the heartbeat into grpc.health.v1 once a second."""

    def __init__(self, address: str, desc: Description, ring: ShmRing, stale_after_s: float | None = None,
                 rdma=None, tls: ServerTls | None = None):
        if stale_after_s is None:
            stale_after_s = STALL_AFTER_S.get(desc.engine_mode, STALL_AFTER_OTHER_S)
        self.watch = HeartbeatWatch(ring, stale_after_s)
        # grpc sets SO_REUSEPORT by default: a second backend on the port would share it and take half of
        # its connections. Off, a taken port fails here.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        control_pb2_grpc.add_ControlServicer_to_server(ControlService(desc, ring, self.watch, rdma), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.tls = tls
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, tls.grpc_credentials())
        except RuntimeError:  # grpc's "Failed to bind": the port is taken or the address is not local
            self.port = 0
        if self.port == 0:
            raise OSError(f"the control plane cannot listen on {address}: the port is taken or the address "
                          f"is not this host's")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._mirror_health, name="health", daemon=True)

    def start(self) -> None:
        self.server.start()
        self._thread.start()

    def _mirror_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while not self._stop.wait(1.0):
            ok = self.watch.state() == control_pb2.HealthReply.SERVING
            for service in ("", "blink.control.v1.Control"):
                self.health.set(service, serving if ok else not_serving)

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
