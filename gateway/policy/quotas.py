"""Per-key rate limits: requests/minute and tokens/minute (token buckets), streams in flight.

Usage lives in a `UsageTable`: fixed 72-byte records, one per key, found by open addressing on a hash
of the key's name. With one worker the table is a private bytearray. With `--workers N` the supervisor
creates one table file in /dev/shm before it starts the workers (`create_shared_table`); every worker
maps it and takes an exclusive `flock` on it around each read-modify-write, so a key's limits hold for
the whole gateway, not per worker. Hot-path cost: an admission is one lock/unlock pair (two syscalls)
around one `struct` unpack and pack; admit + charge + close of one request take 18 us shared against
13 us private on the 2-core dev box; nothing is done per token.

Tokens are charged as they are known: the prompt at admission, the completion when the request ends;
a bucket may go into debt, and the key waits until it is paid back. Buckets refill on
`time.monotonic()`, one clock for every process of the host. A worker that dies with requests in flight
would leave them counted, but the supervisor then stops every worker, and a new gateway makes a new table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import ApiError, rate_limited, server_error
from .keys import KeyLimits, Principal

# key hash, requests bucket (size per minute, level, time), tokens bucket (same), in flight, rejected
RECORD = struct.Struct("<Q3d3dqq")
NUM_RECORDS = 16384  # keys per gateway; a 1.3 MB file in /dev/shm of which only used pages take memory


class TokenBucket:
    """`per_minute` units, refilled continuously; `level` may go negative (debt). A view of three
    numbers of a record: (per_minute, level, t); per_minute 0 means no bucket (unlimited)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic,
                 level: float | None = None, t: float | None = None):
        self.per_minute = per_minute
        self.level = float(per_minute) if level is None else level
        self._clock = clock
        self.t = clock() if t is None else t

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.per_minute, self.level + (now - self.t) * self.per_minute / 60.0)
        self.t = now

    def wait_s(self, need: float = 1.0) -> float:
        """Seconds until `need` units are there (0: now)."""
        self._refill()
        return max(0.0, (need - self.level) * 60.0 / self.per_minute)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


class UsageTable:
    """Fixed records in `buf` (a bytearray, or a shared mmap with the file's `fd` to lock)."""

    def __init__(self, buf: bytearray | mmap.mmap, fd: int | None = None):
        self.buf = buf
        self.fd = fd
        self.num_records = len(buf) // RECORD.size
        self._index: dict[str, int] = {}  # key name -> record, cached: records never move

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if self.fd is None:
            yield
            return
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def find(self, name: str) -> int:
        """The record of `name`, claimed if new (call with the lock held)."""
        index = self._index.get(name)
        if index is not None:
            return index
        key_hash = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") | 1  # 0: free
        start = key_hash % self.num_records
        for probe in range(self.num_records):
            index = (start + probe) % self.num_records
            stored = struct.unpack_from("<Q", self.buf, index * RECORD.size)[0]
            if stored in (0, key_hash):
                if stored == 0:
                    RECORD.pack_into(self.buf, index * RECORD.size, key_hash, 0, 0, 0, 0, 0, 0, 0, 0)
                self._index[name] = index
                return index
        raise server_error(f"the gateway's usage table is full ({self.num_records} keys)")

    def read(self, index: int) -> list:
        return list(RECORD.unpack_from(self.buf, index * RECORD.size))

    def write(self, index: int, record: list) -> None:
        RECORD.pack_into(self.buf, index * RECORD.size, *record)

    def names(self) -> dict[str, int]:
        return dict(self._index)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(BufferError):
                self.buf.close()
            os.close(self.fd)
            self.fd = None


def create_shared_table(path: str, num_records: int = NUM_RECORDS) -> None:
    """The supervisor's part: a zeroed table file for its workers (replaces a stale one)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, num_records * RECORD.size)
    finally:
        os.close(fd)


def attach_shared_table(path: str) -> UsageTable:
    """A worker's view of the supervisor's table."""
    fd = os.open(path, os.O_RDWR)
    size = os.fstat(fd).st_size
    if size == 0 or size % RECORD.size:
        os.close(fd)
        raise ValueError(f"{path} is not a usage table ({size} bytes)")
    return UsageTable(mmap.mmap(fd, size), fd)


class Usage:
    """One key's record, unpacked while the table's lock is held."""

    def __init__(self, record: list, limits: KeyLimits, clock: Callable[[], float]):
        self.record = record
        self.requests = self._bucket(1, limits.requests_per_minute, clock)
        self.tokens = self._bucket(4, limits.tokens_per_minute, clock)

    def _bucket(self, at: int, per_minute: int | None, clock) -> TokenBucket | None:
        """The bucket stored at record[at:at + 3]; one whose size changed (a reloaded keys file) starts full."""
        if per_minute is None:
            return None
        size, level, t = self.record[at:at + 3]
        if size != per_minute:
            return TokenBucket(per_minute, clock)
        return TokenBucket(per_minute, clock, level, t)

    @property
    def num_in_flight(self) -> int:
        return self.record[7]

    def packed(self) -> list:
        for at, bucket in ((1, self.requests), (4, self.tokens)):
            self.record[at:at + 3] = (bucket.per_minute, bucket.level, bucket.t) if bucket else (0, 0.0, 0.0)
        return self.record


@dataclass
class Admission:
    """One admitted generation: charge its tokens, and `close` it once (frees its stream)."""

    quotas: Quotas | None = None
    principal: Principal | None = None
    closed: bool = False

    def charge(self, num_tokens: int) -> None:
        if self.quotas is not None and num_tokens and self.principal.limits.tokens_per_minute is not None:
            self.quotas.update(self.principal, num_tokens, 0)

    def close(self, num_completion_tokens: int = 0) -> None:
        if not self.closed and self.quotas is not None:
            self.closed = True
            self.quotas.update(self.principal, num_completion_tokens, -1)


class Quotas:
    """Admission against per-key limits; `table` is private (one worker) or shared (`--workers N`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, table: UsageTable | None = None):
        self.clock = clock
        self.table = table if table is not None else UsageTable(bytearray(NUM_RECORDS * RECORD.size))

    def admit(self, principal: Principal | None) -> Admission:
        """Admit one generation for `principal`, or raise a 429 `rate_limit_exceeded` with Retry-After."""
        if principal is None:
            return Admission()
        with self.table.locked():
            index = self.table.find(principal.name)
            usage = Usage(self.table.read(index), principal.limits, self.clock)
            try:
                _check(principal, usage)
            except ApiError:
                usage.record[8] += 1
                self.table.write(index, usage.packed())
                raise
            if usage.requests is not None:
                usage.requests.take(1)
            usage.record[7] += 1
            self.table.write(index, usage.packed())
        return Admission(self, principal)

    def update(self, principal: Principal, num_tokens: int, in_flight_delta: int) -> None:
        """Charge tokens to the key's bucket and move its in-flight count."""
        with self.table.locked():
            index = self.table.find(principal.name)
            usage = Usage(self.table.read(index), principal.limits, self.clock)
            if usage.tokens is not None and num_tokens:
                usage.tokens.take(num_tokens)
            usage.record[7] += in_flight_delta
            self.table.write(index, usage.packed())

    def in_flight(self) -> dict[str, int]:
        """Generations in flight per key (all workers), for the keys this worker has seen."""
        with self.table.locked():
            return {name: self.table.read(index)[7] for name, index in self.table.names().items()}


def _check(principal: Principal, usage: Usage) -> None:
    limits = principal.limits
    if limits.max_streams is not None and usage.num_in_flight >= limits.max_streams:
        raise rate_limited(f"key '{principal.name}' has {usage.num_in_flight} requests in flight, its "
                           f"limit (max_streams) is {limits.max_streams}", 1.0, "requests")
    if usage.requests is not None and (wait_s := usage.requests.wait_s(1.0)) > 0:
        raise rate_limited(f"key '{principal.name}' is over its limit of {limits.requests_per_minute} "
                           f"requests per minute", wait_s, "requests")
    if usage.tokens is not None and (wait_s := usage.tokens.wait_s(1.0)) > 0:
        raise rate_limited(f"key '{principal.name}' is over its limit of {limits.tokens_per_minute} "
                           f"tokens per minute (prompt + completion)", wait_s, "tokens")
