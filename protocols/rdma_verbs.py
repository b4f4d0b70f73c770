"""Verbs for the `rdma` transport (pyverbs, from rdma-core): RC queue pairs and memory registration.

Both ends use this: the backend registers its ring memory and keeps one passive RC queue pair per
gateway (it never posts a work request: its CPU stays off the path); the gateway connects a queue
pair to it and drives `protocols.rdma.RdmaProducer` through `VerbsLink`. Queue pairs are connected
through the control plane (`Control.ConnectRdma` exchanges QPN, PSN, GID, LID, MTU, and the ring's
address and rkey), not through rdma_cm.

Ring memory: in GPU memory it is registered through dma-buf (`register_gpu_memory`: a CUDA dma-buf
fd from cuMemGetHandleForAddressRange, then pyverbs `DmaBufMR`); in host memory (the shm ring of the
cpu engine, or where dma-buf is unavailable) with an ordinary `MR` at the mapping's address.

Untested on hardware: no RDMA device exists where this was written (tests skip with that message).
pyverbs is not on PyPI; it comes with rdma-core (Debian/Ubuntu: python3-pyverbs).
"""
from __future__ import annotations

import dataclasses
import mmap
import random
import time
from dataclasses import dataclass

from .rdma import RdmaLinkError
from .ring import RingGeometry
from .shm import ShmRing

PORT = 1
MAX_SEND_WR = 64
COMPLETION_TIMEOUT_S = 1.0


class RdmaUnavailable(RuntimeError):
    """pyverbs is missing or no RDMA device exists."""


def _verbs():
    try:
        import pyverbs.enums as e
        from pyverbs import addr, cq, device, mr, pd, qp, wr
    except ImportError:
        raise RdmaUnavailable("pyverbs is not installed (it comes with rdma-core: apt install python3-pyverbs)") from None
    return e, addr, cq, device, mr, pd, qp, wr


def device_names() -> list[str]:
    """Names of the RDMA devices here (empty without pyverbs or devices)."""
    try:
        _, _, _, device, *_ = _verbs()
    except RdmaUnavailable:
        return []
    try:
        found = device.get_device_list()
    except Exception:  # PyverbsRDMAError "Failed to get devices list": no RDMA support in this kernel
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in found]


@dataclass(frozen=True)
class Endpoint:
    """One side of an RC connection, plus (backend side) where its ring is and how to access it."""

    qp_num: int
    psn: int
    gid: str  # 'xxxx:xxxx:...' (RoCE needs it; InfiniBand may use the LID alone)
    lid: int
    mtu: int  # IBV_MTU_* enum
    ring_addr: int = 0
    ring_rkey: int = 0
    ring_bytes: int = 0


class Device:
    """An opened device with a protection domain."""

    def __init__(self, name: str | None = None, gid_index: int = 0):
        e, _, _, device, _, pd, *_ = _verbs()
        names = device_names()
        if not names:
            raise RdmaUnavailable("no RDMA device on this host")
        if name is not None and name not in names:
            raise RdmaUnavailable(f"no RDMA device named {name!r} (have: {', '.join(names)})")
        self.ctx = device.Context(name=name or names[0])
        self.pd = pd.PD(self.ctx)
        self.gid_index = gid_index

    def access(self) -> int:
        e = _verbs()[0]
        return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ

    def register_host_memory(self, address: int, nbytes: int):
        """An MR over host memory (the shm ring's mapping, or a gateway mirror)."""
        return _verbs()[4].MR(self.pd, nbytes, self.access(), address=address)

    def register_gpu_memory(self, dmabuf_fd: int, offset: int, nbytes: int):
        """An MR over GPU memory exported as a dma-buf; remote addresses start at `offset` (the iova)."""
        return _verbs()[4].DmaBufMR(self.pd, nbytes, self.access(), dmabuf=dmabuf_fd, offset=offset)


class RcQueuePair:
    """A reliable-connected queue pair with its own completion queue (polled only by its poster)."""

    def __init__(self, dev: Device):
        e, _, cq, _, _, _, qp, _ = _verbs()
        self.dev = dev
        self.cq = cq.CQ(dev.ctx, 2 * MAX_SEND_WR, None, None, 0)
        cap = qp.QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = qp.QP(dev.pd, qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0))
        port = dev.ctx.query_port(PORT)
        self.local = Endpoint(self.qp.qp_num, random.getrandbits(24), dev.ctx.query_gid(PORT, dev.gid_index).gid,
                              port.lid, port.active_mtu)

    def connect(self, remote: Endpoint) -> None:
        """RESET -> INIT -> RTR -> RTS against the remote endpoint."""
        e, addr, _, _, _, _, qp, _ = _verbs()
        attr = qp.QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.qp_access_flags = self.dev.access()
        attr.port_num, attr.pkey_index = PORT, 0
        self.qp.to_init(attr)
        gid = addr.GID()
        gid.gid = remote.gid
        attr.ah_attr = addr.AHAttr(dlid=remote.lid, port_num=PORT, is_global=1,
                                   gr=addr.GlobalRoute(dgid=gid, sgid_index=self.dev.gid_index))
        attr.path_mtu = min(self.local.mtu, remote.mtu)
        attr.dest_qp_num, attr.rq_psn = remote.qp_num, remote.psn
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, 12  # READs are issued one at a time
        self.qp.to_rtr(attr)
        attr.sq_psn, attr.max_rd_atomic = self.local.psn, 1
        attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 7, 7  # ~67 ms per try, then the link is lost
        self.qp.to_rts(attr)

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class VerbsLink:
    """`RingLink` over an RC queue pair: WRITEs from and READs into a registered mirror of the ring."""

    def __init__(self, qp: RcQueuePair, remote: Endpoint, geometry: RingGeometry):
        if remote.ring_bytes != geometry.total_bytes:
            raise RdmaLinkError(f"the backend exported {remote.ring_bytes} bytes, the ring needs {geometry.total_bytes}")
        self.qp, self.remote, self.geometry = qp, remote, geometry
        self._mm = mmap.mmap(-1, geometry.total_bytes)  # page-aligned, zeroed
        self.mirror = ShmRing("rdma-mirror", self._mm, geometry, owner=False)
        self.mr = qp.dev.register_host_memory(self.mirror.buf.ctypes.data, geometry.total_bytes)
        self._pending = 0
        self._next_id = 0

    def write(self, offset: int, nbytes: int) -> None:
        self._post(_verbs()[0].IBV_WR_RDMA_WRITE, offset, nbytes)

    def read(self, offset: int, nbytes: int) -> None:
        self._post(_verbs()[0].IBV_WR_RDMA_READ, offset, nbytes)
        self.flush()

    def flush(self) -> None:
        e = _verbs()[0]
        deadline = time.monotonic() + COMPLETION_TIMEOUT_S
        while self._pending:
            n, wcs = self.qp.cq.poll(self._pending)
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    self._pending = 0
                    raise RdmaLinkError(f"work request {wc.wr_id} failed with status {wc.status}")
            self._pending -= n
            if self._pending and time.monotonic() > deadline:
                raise RdmaLinkError(f"{self._pending} work requests not completed within {COMPLETION_TIMEOUT_S:g} s")

    def _post(self, opcode: int, offset: int, nbytes: int) -> None:
        e, _, _, _, _, _, _, wr = _verbs()
        if self._pending >= MAX_SEND_WR - 1:
            self.flush()
        self._next_id += 1
        sge = wr.SGE(self.mr.buf + offset, nbytes, self.mr.lkey)
        request = wr.SendWR(wr_id=self._next_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        request.set_wr_rdma(self.remote.ring_rkey, self.remote.ring_addr + offset)
        try:
            self.qp.qp.post_send(request)
        except Exception as exc:  # PyverbsRDMAError: the queue pair is in the error state
            raise RdmaLinkError(f"post_send failed: {exc}") from None
        self._pending += 1

    def close(self) -> None:
        self.mr.close()
        self.qp.close()
        self.mirror.close()


def endpoint_to_proto(ep: Endpoint):
    from . import control_pb2

    return control_pb2.RdmaEndpoint(**dataclasses.asdict(ep))


def endpoint_from_proto(msg) -> Endpoint:
    return Endpoint(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(Endpoint)})


def gpu_dmabuf(ptr: int, nbytes: int) -> tuple[int, int]:
    """(dma-buf fd, offset of `ptr` in it) for a CUDA allocation, via cuda-python's driver API."""
    from cuda.bindings import driver as cu

    page = mmap.PAGESIZE
    base = ptr // page * page
    size = (ptr + nbytes - base + page - 1) // page * page
    err, fd = cu.cuMemGetHandleForAddressRange(
        base, size, cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RdmaUnavailable(f"cuMemGetHandleForAddressRange failed ({err}): no dma-buf for this GPU memory")
    return int(fd), ptr - base
