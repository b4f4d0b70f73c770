"""How the gateway reaches a backend's ring, by the transport its Describe names: shm, tcp or rdma.

Each returns a producer with the interface `Backend` uses (submit, poll, cancel, release, reclaim,
heartbeat, free_slots, connected, close), so nothing above this module depends on the transport.
"""
from __future__ import annotations

import asyncio
import functools
import os
import tempfile

import grpc

from protocols import control_pb2_grpc
from protocols.messages import BackendInfo
from protocols.producer import RingProducer
from protocols.rdma import RdmaLinkError, RdmaProducer
from protocols.shm import RingAttachError, SqLock, attach_ring
from protocols.shm_producer import ShmProducer

from ..config import GatewayConfig
from ..tls import backend_channel_credentials, backend_ssl_context
from .tcp_producer import AgentMismatch, AgentTlsRefused, TcpProducer


class BackendConnectError(RuntimeError):
    """A backend did not answer Describe, or its ring could not be attached."""


class TlsRefused(BackendConnectError):
    """TLS with a backend (its control plane or tcp agent) failed: a certificate refused on either side, or
    one side speaking plaintext. A configuration matter, not a wait: said at once."""


def control_channel(addr: str, config: GatewayConfig) -> grpc.Channel:
    """A blocking channel to a backend's control plane: over TLS with the gateway's client certificate when
    `backend_ssl_ca_certs` is set (files read now), else plaintext."""
    credentials = backend_channel_credentials(config)
    return grpc.insecure_channel(addr) if credentials is None else grpc.secure_channel(addr, credentials)


def aio_control_channel(addr: str, config: GatewayConfig) -> grpc.aio.Channel:
    """`control_channel` for asyncio (the pool's liveness probes)."""
    credentials = backend_channel_credentials(config)
    return grpc.aio.insecure_channel(addr) if credentials is None else grpc.aio.secure_channel(addr, credentials)


async def connect_transport(info: BackendInfo, config: GatewayConfig) -> RingProducer:
    if config.workers > 1 and info.transport not in ("", "shm"):
        raise BackendConnectError(f"backend {info.addr}: --workers > 1 needs the shm transport (its ring is "
                                  f"shared slot by slot); {info.transport} has one gateway session per ring")
    if info.transport == "tcp":
        return await connect_tcp(info, config)
    if info.transport == "rdma":
        return await asyncio.get_running_loop().run_in_executor(None, connect_rdma, info, config)
    if info.transport not in ("", "shm"):
        raise BackendConnectError(f"backend {info.addr}: unknown transport {info.transport!r}")
    return attach_shm(info, config)


def attach_shm(info: BackendInfo, config: GatewayConfig | None = None) -> ShmProducer:
    try:
        ring = attach_ring(info.ring_name, expect=info.geometry, fingerprint=info.model_fingerprint or None)
    except RingAttachError as exc:
        raise BackendConnectError(f"backend {info.addr}: {exc} (the gateway must run on the backend's host "
                                  f"for the shm transport)") from None
    if config is None or config.workers == 1:
        return ShmProducer(ring)
    # Gateway workers share the ring: each owns every workers-th slot; one lock file orders the queue.
    lock = SqLock(os.path.join(tempfile.gettempdir(), f"{info.ring_name.strip('/')}.sq.lock"))
    return ShmProducer(ring, slots=range(config.worker_index, info.geometry.num_slots, config.workers),
                        sq_lock=lock)


async def connect_tcp(info: BackendInfo, config: GatewayConfig) -> TcpProducer:
    """The producer end of a ring reached through the backend host's tcp agent (`blink agent`)."""
    try:
        producer = TcpProducer(info.tcp_endpoint, info.geometry, info.model_fingerprint or None,
                               idle_timeout_s=config.tcp_idle_timeout_s,
                               ssl_context=functools.partial(backend_ssl_context, config) if config.backend_tls else None)
        await producer.start(config.connect_timeout_s)
    except AgentTlsRefused as exc:
        raise TlsRefused(f"backend {info.addr}: {exc}") from None
    except (ValueError, TimeoutError, AgentMismatch) as exc:
        raise BackendConnectError(f"backend {info.addr}: {exc}") from None
    return producer


def connect_rdma(info: BackendInfo, config: GatewayConfig) -> RdmaProducer:
    """Blocking: connect a queue pair to the backend's through `Control.ConnectRdma`; then one-sided access only."""
    from protocols.rdma_verbs import (Device, RcQueuePair, RdmaUnavailable, VerbsLink, endpoint_from_proto,
                                      endpoint_to_proto)
    try:
        qp = RcQueuePair(Device(config.rdma_device))
        with control_channel(info.addr, config) as channel:
            reply = control_pb2_grpc.ControlStub(channel).ConnectRdma(endpoint_to_proto(qp.local), timeout=10)
        remote = endpoint_from_proto(reply)
        qp.connect(remote)
        return RdmaProducer(VerbsLink(qp, remote, info.geometry))
    except (RdmaUnavailable, RdmaLinkError) as exc:
        raise BackendConnectError(f"backend {info.addr}: rdma transport: {exc}") from None
    except grpc.RpcError as exc:
        raise BackendConnectError(f"backend {info.addr}: ConnectRdma failed: {exc.code().name} {exc.details()}") from None
