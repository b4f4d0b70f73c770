"""Shared-memory transport: a ring (protocols/ring.py) in POSIX shared memory (`ShmRing`: create, attach,
unlink), and the lock its producers share. Its two ends: `shm_producer.ShmProducer`, the gateway's
(submit, cancel, poll new tokens, release), and `shm_consumer.RingConsumer`, the engine's (take new
requests, publish tokens, finish). Each end writes only its own words.

Backpressure is explicit: `submit` raises `RingFull` when every slot is in use, and the engine may
publish only `room(slot)` tokens until the gateway has consumed what it wrote. Nothing is overwritten
and nothing is dropped.

Ordering: numpy stores are plain stores, and x86-64 keeps stores in program order (TSO), which is what
the payload-then-sequence-word rule needs between two CPU processes. The GPU side adds
`__threadfence_system()`; an ARM host would need explicit barriers here.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re

import numpy as np

from protocols import ring as R
from protocols.ring import RingGeometry, RingLayoutError

SHM_DIR = "/dev/shm"


class RingFull(RuntimeError):
    """Every slot is in use: wait for one to be released (backpressure, not an error)."""


class RingAttachError(RuntimeError):
    """The named ring does not exist, or its layout is not the one this side expects."""


class RingInUseError(RuntimeError):
    """A live process (another backend) holds the ring of that name: it is not stale and is left alone."""


def _path(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"ring name {name!r} must be a non-empty name without '/'")
    return os.path.join(SHM_DIR, name)


class ShmRing:
    """A mapped ring with typed views. Use `create_ring` / `attach_ring` to get one."""

    def __init__(self, name: str, mm: mmap.mmap, geometry: RingGeometry, owner: bool, lock_fd: int | None = None):
        self.name, self.geometry, self.owner = name, geometry, owner
        self._mm = mm
        self._lock_fd = lock_fd  # the creator's flock on the ring file: held while it lives (see create_ring)
        self.buf = np.frombuffer(mm, dtype=np.uint8)  # [total_bytes] uint8, shared
        self.u32 = self.buf.view(np.uint32)
        self.u64 = self.buf.view(np.uint64)
        self.i32 = self.buf.view(np.int32)
        self.f32 = self.buf.view(np.float32)
        g = geometry  # structured views of the header and of every slot's fixed fields, made once
        self._hdr = self.buf[:R.HEADER_BYTES].view(R.HEADER_DTYPE)  # [1]
        self._requests = np.ndarray((g.num_slots,), R.REQUEST_DTYPE, self.buf, g.requests_offset, (g.request_bytes,))
        self._responses = np.ndarray((g.num_slots,), R.RESPONSE_DTYPE, self.buf, g.responses_offset,
                                     (g.response_bytes,))

    # Byte offsets of a slot's request and response areas, and of their version-2 and -3 extensions.
    def req(self, slot: int) -> int:
        return self.geometry.requests_offset + slot * self.geometry.request_bytes

    def resp(self, slot: int) -> int:
        return self.geometry.responses_offset + slot * self.geometry.response_bytes

    def bias(self, slot: int) -> int:
        return self.geometry.logit_bias_offset + slot * self.geometry.logit_bias_bytes

    def logprobs(self, slot: int) -> int:
        return self.geometry.logprobs_offset + slot * self.geometry.logprob_bytes

    def hashes(self, slot: int) -> int:
        return self.geometry.block_hashes_offset + slot * self.geometry.block_hash_bytes

    def mask(self, slot: int) -> int:
        return self.geometry.masks_offset + slot * self.geometry.mask_bytes

    def logprob_words(self, slot: int, index: int, k: int) -> tuple[int, int, int]:
        """Word indices of token `index`'s chosen logprob, first alternative id and first alternative logprob
        (k = max_logprobs words per token)."""
        g, base, w = self.geometry, self.logprobs(slot), index % self.geometry.logprob_window
        return ((base + 4 * w) // 4, (base + g.logprob_top_ids_offset + 4 * w * k) // 4,
                (base + g.logprob_top_offset + 4 * w * k) // 4)

    # Named fields (numpy structured views: stores go to the ring), for everything but the per-token paths,
    # which read words at offsets precomputed from the same generated names (a field read through a
    # structured view costs several times a memoryview's word).
    @property
    def header(self) -> np.void:
        return self._hdr[0]

    def request_fields(self, slot: int) -> np.void:
        return self._requests[slot]

    def response_fields(self, slot: int) -> np.void:
        return self._responses[slot]

    def hdr_u32(self, off: int) -> int:
        return int(self.u32[off // 4])

    def hdr_u64(self, off: int) -> int:
        return int(self.u64[off // 8])

    @property
    def fingerprint(self) -> str:
        return R.read_fingerprint(self.buf)

    @property
    def heartbeat(self) -> int:
        return self.hdr_u64(R.HDR_HEARTBEAT)  # read per routing decision: a word, not a view

    @property
    def engine_state(self) -> R.EngineState:
        return R.EngineState(int(self.header["engine_state"]))

    def stats(self) -> dict[str, int]:
        hdr = self.header
        names = ("free_kv_blocks", "total_kv_blocks", "running", "waiting", "generated_tokens", "sq_head", "sq_tail",
                 "cached_kv_blocks", "prefix_cache_queries", "prefix_cache_hits")
        return {n: int(hdr[n]) for n in names}

    def close(self) -> None:
        """Unmap; the creator also unlinks the name. Views taken earlier become invalid."""
        self.buf = self.u32 = self.u64 = self.i32 = self.f32 = None  # drop exports before closing
        self._hdr = self._requests = self._responses = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        if self.owner:
            unlink_ring(self.name)  # before the lock goes: a successor must never find our file unlocked
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def create_ring(name: str, geometry: RingGeometry, fingerprint: str, replace: bool = True) -> ShmRing:
    """Create a zeroed ring, write its header, and hold an exclusive flock on its file while this process lives.

    A ring of that name left by a process that died (SIGKILL leaves the file in /dev/shm) is stale: with
    `replace` it is removed first. One whose creator still lives (its flock is held) raises RingInUseError;
    so does any existing ring without `replace`. The kernel drops the flock when its holder dies however it
    dies, which is what makes the lock, not a pid in the header, the test of life."""
    path = _path(name)
    if os.path.exists(path):
        if not replace:
            raise RingInUseError(f"a ring named {name!r} already exists in {SHM_DIR}")
        remove_stale_ring(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:  # another process created it since the check
        raise RingInUseError(_in_use_message(name, ring_holder(name))) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocking: only a `ring_holder` probe can hold it, for microseconds
        os.ftruncate(fd, geometry.total_bytes)
        mm = mmap.mmap(fd, geometry.total_bytes)
    except BaseException:
        os.close(fd)
        unlink_ring(name)
        raise
    ring = ShmRing(name, mm, geometry, owner=True, lock_fd=fd)
    R.write_header(ring.buf, geometry, fingerprint)
    return ring


def ring_holder(name: str) -> int | None:
    """The pid of the live process that holds the ring `name` (its creator's flock), 0 when a holder exists but
    /proc/locks does not name it, None when the ring is free or stale (or absent)."""
    try:
        fd = os.open(_path(name), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _flock_pid(os.fstat(fd).st_ino)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_ring_free(name: str) -> None:
    """Raise RingInUseError (naming the ring and the holder's pid) if a live process holds the ring `name`."""
    holder = ring_holder(name)
    if holder is not None:
        raise RingInUseError(_in_use_message(name, holder))


def remove_stale_ring(name: str) -> bool:
    """Unlink the ring `name` if no live process holds it (True if one was removed); RingInUseError if one does."""
    check_ring_free(name)
    if not os.path.exists(_path(name)):
        return False
    unlink_ring(name)
    return True


def _in_use_message(name: str, holder: int | None) -> str:
    who = f"process {holder}" if holder else "a live process"
    return (f"ring {name!r} in {SHM_DIR} is held by {who} (another backend with the same ring name?); "
            f"stop it, or give this backend another --ring")


def _flock_pid(inode: int) -> int:
    """The pid that /proc/locks names for a FLOCK on `inode` (0 if none is listed)."""
    try:
        lines = open("/proc/locks").read().splitlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split()  # e.g. "1: FLOCK ADVISORY WRITE 4242 00:1a:123456 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return int(fields[4])
    return 0


def stable_ring_name(address: str, prefix: str = "blink") -> str:
    """A ring name derived from a HOST:PORT this instance owns (`blink-127.0.0.1-50051`), so that a restarted
    backend finds, and removes, the ring its crashed predecessor left instead of adding another."""
    host, _, port = address.rpartition(":")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prefix}-{host.strip('[]')}-{port}")


def attach_ring(name: str, expect: RingGeometry | None = None, fingerprint: str | None = None) -> ShmRing:
    """Map an existing ring; raise RingAttachError if it is missing or not what `expect` says."""
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise RingAttachError(f"no ring named {name!r} in {SHM_DIR}: is the backend running?") from None
    try:
        size = os.fstat(fd).st_size
        if size < R.HEADER_BYTES:
            raise RingAttachError(f"ring {name!r} is {size} bytes, smaller than a header")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    try:
        geometry = R.geometry_from_header(mm)
    except RingLayoutError as exc:
        mm.close()
        raise RingAttachError(f"ring {name!r}: {exc}") from None
    problem = None
    if geometry.total_bytes != size:
        problem = f"its size {size} does not match its header ({geometry.total_bytes})"
    elif expect is not None and geometry != expect:
        problem = f"geometry {geometry} differs from the expected {expect}"
    ring = ShmRing(name, mm, geometry, owner=False)
    if problem is None and fingerprint is not None and ring.fingerprint != fingerprint:
        problem = f"model fingerprint {ring.fingerprint!r} differs from the expected {fingerprint!r}"
    if problem:
        ring.close()
        raise RingAttachError(f"ring {name!r}: {problem}")
    return ring


def unlink_ring(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


class SqLock:
    """An exclusive lock file (flock) shared by the producers of one ring, one per process."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> SqLock:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)
