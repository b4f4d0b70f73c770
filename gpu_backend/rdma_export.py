"""The backend's side of the `rdma` transport: its ring registered for one-sided access.

The backend registers the ring memory once and, for every gateway that calls `Control.ConnectRdma`,
connects a passive RC queue pair to the gateway's. It never posts a work request: gateways WRITE
requests into the ring and READ responses from it, and the engine polls the ring as it does for shm.

Today every engine's ring is the shm ring in host memory (registered as a host MR). When the GPU loop
keeps its ring in device memory, `export_gpu_ring` registers that through dma-buf instead.
Untested on hardware: no RDMA device exists where this was written.
"""
from __future__ import annotations

import logging
import threading

from protocols.rdma_verbs import Device, Endpoint, RcQueuePair, gpu_dmabuf
from protocols.shm import ShmRing

log = logging.getLogger("blink.backend.rdma")


class RdmaExport:
    """A ring registered with an RDMA device; `connect` makes one queue pair per gateway."""

    def __init__(self, dev: Device, mr, ring_addr: int, ring_bytes: int):
        self.dev, self.mr = dev, mr
        self.ring_addr, self.ring_bytes = ring_addr, ring_bytes
        self._qps: list[RcQueuePair] = []
        self._lock = threading.Lock()  # gRPC calls come from a thread pool

    def connect(self, gateway: Endpoint) -> Endpoint:
        qp = RcQueuePair(self.dev)
        qp.connect(gateway)
        with self._lock:
            self._qps.append(qp)
        log.info("rdma: queue pair %d connected to gateway qp %d (gid %s)", qp.local.qp_num, gateway.qp_num, gateway.gid)
        return Endpoint(qp.local.qp_num, qp.local.psn, qp.local.gid, qp.local.lid, qp.local.mtu,
                        ring_addr=self.ring_addr, ring_rkey=self.mr.rkey, ring_bytes=self.ring_bytes)

    def close(self) -> None:
        with self._lock:
            for qp in self._qps:
                qp.close()
            self._qps.clear()
        self.mr.close()


def export_shm_ring(ring: ShmRing, device: str | None = None, gid_index: int = 0) -> RdmaExport:
    """Register a host-memory ring (the mapping the engine polls)."""
    dev = Device(device, gid_index)
    address = ring.buf.ctypes.data
    mr = dev.register_host_memory(address, ring.geometry.total_bytes)
    return RdmaExport(dev, mr, address, ring.geometry.total_bytes)


def export_gpu_ring(ptr: int, nbytes: int, device: str | None = None, gid_index: int = 0) -> RdmaExport:
    """Register a ring in GPU memory through dma-buf; remote addresses are dma-buf offsets (the iova)."""
    dev = Device(device, gid_index)
    fd, offset = gpu_dmabuf(ptr, nbytes)
    mr = dev.register_gpu_memory(fd, offset, nbytes)
    return RdmaExport(dev, mr, offset, nbytes)
