"""The poller's round in C for plain streams (`gateway/streaming/csrc/stream_round.c`): its loader and Python face.

A backend on a shared-memory ring has one `StreamRound`. Its `round` replaces the poller's scan of the
ring for news: it delivers the tokens of the streams C owns (detokenized, framed as their SSE chunk and
sent on a dup of the client's socket, one send each) and returns every other slot with news for the
Python path. A stream becomes C's with `enable` (`gateway/api/sse.py` does that once it writes plain text
chunks: one choice, no stop strings, no logprobs) and Python's again with `take_back`, which returns
what C did meanwhile (`Taken`) for the stream's own state. C hands a stream back by itself for its
finish and for anything it does not do (an invalid UTF-8 sequence, a key's budget, a socket that would
block): Python then reads the update as it always does.

Built with the C compiler on first use and cached (`protocols/native_build.py`);
where none exists, or with `GatewayConfig.native_stream` off, every stream stays on the Python path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocols import ring as R
from protocols.native_build import cached_build, find_compiler

from .. import env
from .stream_round_layout import BackReason, SrRing, SrTaken, SrTap


log = logging.getLogger("blink.gateway.stream_round")

SOURCE = Path(__file__).resolve().parent / "csrc" / "stream_round.c"
LAYOUT_HEADER = SOURCE.parent / "stream_round_layout.h"  # generated, as is .stream_round_layout
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror")
NO_BUDGET = (1 << 32) - 1
# Why C handed a stream back (SR_BACK_*), for logs and tests.
BACK_REASONS = tuple(reason.name.lower() for reason in BackReason)


@dataclass(frozen=True, slots=True)
class Taken:
    """What C did with a stream while it was C's: the ring's tokens read (`consumed`), the stream's token
    count, the bytes of a character still incomplete, when the last token came (perf_counter ns, 0: none),
    the bytes it sent, the rest of a chunk the socket took only in part (for Python's transport to write
    first), and why C handed it back (`BACK_REASONS`)."""

    consumed: int
    num_tokens: int
    pending: bytes
    last_token_ns: int
    bytes_sent: int
    unsent: bytes
    reason: str


def c_compiler() -> str | None:
    """$CC, else the first of gcc, cc, clang on PATH; None when there is none."""
    return find_compiler((env.CC.get(), "gcc", "cc", "clang"))


def cache_dir() -> Path:
    """Where the library is cached: beside the backend's native builds ($BLINK_CACHE/kernels)."""
    return env.CACHE.value() / "kernels"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built now unless cached; None (logged once) when it cannot be built."""
    cc = c_compiler()
    if cc is None:
        log.warning("no C compiler (set CC or install gcc): streams take the Python path only")
        return None
    try:
        lib = ctypes.CDLL(str(cached_build("stream_round", (SOURCE, LAYOUT_HEADER), [cc, *FLAGS, str(SOURCE)],
                                           cache_dir())), use_errno=True)
    except (RuntimeError, OSError) as exc:
        log.warning("the native stream round did not build (%s): streams take the Python path only", exc)
        return None
    p, u32, i32, i64, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
    sigs = {
        "sr_create": (p, [ctypes.POINTER(SrRing)]),
        "sr_destroy": (None, [p]),
        "sr_set_tap": (None, [p, p]),
        "sr_template_bytes": (u32, []),
        "sr_enable": (ctypes.c_int, [p, u32, ctypes.c_int, u64, u32, u32, u32, u32, u32, ctypes.c_char_p, u32,
                                     ctypes.c_char_p, u32, ctypes.c_char_p, u32]),
        "sr_take_back": (ctypes.c_int, [p, u32, ctypes.POINTER(SrTaken), p]),
        "sr_round": (i32, [p, p, i32, i64, p, p]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class PieceTable:
    """Every token's piece as UTF-8 bytes in one buffer (`TokenPieces`' bytes for byte-level vocabularies,
    the UTF-8 of its text otherwise), for C: piece i is bytes[offsets[i] : offsets[i + 1]]."""

    def __init__(self, pieces: list[bytes]):
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.uint32, count=len(pieces))
        self.offsets = np.zeros(len(pieces) + 1, dtype=np.uint32)  # [vocab + 1] uint32
        np.cumsum(lengths, out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(pieces) or b"\0", dtype=np.uint8).copy()  # [total] uint8
        self.vocab_size = len(pieces)


@functools.cache  # by the object: one table per tokenizer's TokenPieces (a gateway has one per model)
def table_for(pieces) -> PieceTable:
    """The `PieceTable` of a tokenizer's `TokenPieces`."""
    return PieceTable(pieces.utf8_pieces())


class StreamRound:
    """One ring's C round and the streams C owns on it. Use from the event loop's thread only."""

    def __init__(self, lib: ctypes.CDLL, ring_buf: np.ndarray, geometry: R.RingGeometry, table: PieceTable):
        """`ring_buf`: [total_bytes] uint8, the ring's shared memory (`ShmRing.buf`); close this before the ring."""
        self._lib, self.table = lib, table  # the table's arrays must outlive the state that points at them
        self._ring_buf = ring_buf
        spec = SrRing(ring=ring_buf.ctypes.data, responses_offset=geometry.responses_offset,
                      response_bytes=geometry.response_bytes, num_slots=geometry.num_slots, off_seq=R.RESP_SEQ,
                      off_produced=R.RESP_PRODUCED, off_finish=R.RESP_FINISH_REASON, off_consumed=R.RESP_CONSUMED,
                      off_tokens=R.RESP_TOKENS, max_output_len=geometry.max_output_len,
                      piece_offsets=table.offsets.ctypes.data, piece_bytes=table.data.ctypes.data,
                      vocab_size=table.vocab_size)
        self._state = lib.sr_create(ctypes.byref(spec))
        if not self._state:
            raise MemoryError("sr_create failed")
        self._out = np.zeros(geometry.num_slots, dtype=np.int32)  # [num_slots] int32: slots for Python
        self._stats = np.zeros(2, dtype=np.uint64)
        self._out_p, self._stats_p = self._out.ctypes.data, self._stats.ctypes.data
        self._round = lib.sr_round
        self._taken = SrTaken()
        self.template_bytes = lib.sr_template_bytes()
        self._tap: tuple | None = None
        self._slots, self._slots_array, self._slots_p = None, None, 0  # the last `round`'s list, its array, address

    def round(self, slots: list[int], now_ns: int) -> tuple[list[int], int, int]:
        """`slots`: the slots in flight. Returns (the slots with news for Python, updates C delivered,
        outstanding tokens that fell). A list passed again (the same object) is taken to hold the same slots,
        as `ShmProducer.ready_slots` takes it."""
        if slots is not self._slots:  # made once per list: an array and its address (`.ctypes` makes an object)
            self._slots, self._slots_array = slots, np.array(slots, dtype=np.int32)  # [n] int32
            self._slots_p = self._slots_array.ctypes.data
        num_out = self._round(self._state, self._slots_p, len(slots), now_ns, self._out_p, self._stats_p)
        stats = self._stats
        return self._out[:num_out].tolist(), int(stats[0]), int(stats[1])

    def enable(self, slot: int, fd: int, seq: int, consumed: int, num_tokens: int, budget: int | None,
               tokens_left: int, chunked: bool, pending: bytes, head: bytes, tail: bytes) -> bool:
        """C owns the stream of `slot` from now on, writing to a dup of `fd`; False if it cannot take it."""
        if len(head) + len(tail) > self.template_bytes or len(pending) > 3:
            return False
        rc = self._lib.sr_enable(self._state, slot, fd, seq, consumed, num_tokens,
                                 NO_BUDGET if budget is None else min(budget, NO_BUDGET - 1), max(tokens_left, 0),
                                 int(chunked), pending, len(pending), head, len(head), tail, len(tail))
        if rc != 0:
            log.warning("slot %d stays on the Python path: %s", slot, os.strerror(ctypes.get_errno() or 22))
        return rc == 0

    def take_back(self, slot: int) -> Taken | None:
        """The stream of `slot` is Python's again: what C did meanwhile; None if C did not own it."""
        taken, state = self._taken, self._state
        if not self._lib.sr_take_back(state, slot, ctypes.byref(taken), None):
            return None
        unsent = b""
        if taken.unsent_len:
            buf = ctypes.create_string_buffer(taken.unsent_len)
            self._lib.sr_take_back(state, slot, ctypes.byref(taken), buf)
            unsent = buf.raw
        return Taken(taken.consumed, taken.num_tokens, bytes(taken.pending[:taken.num_pending]),
                     taken.last_token_ns, taken.bytes_sent, unsent, BACK_REASONS[taken.reason])

    def set_tap(self, max_chunks: int, max_bytes: int) -> None:
        """Benchmarks: record each chunk C sends (`bench/gateway_probe.py`), up to these limits."""
        times, ends, data = (np.zeros(max_chunks, dtype=np.int64), np.zeros(max_chunks, dtype=np.int64),
                             np.zeros(max_bytes, dtype=np.uint8))
        tap = SrTap(times_ns=times.ctypes.data, ends=ends.ctypes.data, bytes=data.ctypes.data, cap_entries=max_chunks,
                    cap_bytes=max_bytes)
        self._tap = (tap, times, ends, data)
        self._lib.sr_set_tap(self._state, ctypes.byref(tap))

    def tapped(self) -> tuple[np.ndarray, np.ndarray, bytes]:
        """The tap's (send times ns, byte ends, bytes) so far."""
        tap, times, ends, data = self._tap
        n = tap.num_entries
        return times[:n].copy(), ends[:n].copy(), data[:tap.num_bytes].tobytes()

    def close(self) -> None:
        if self._state:
            self._lib.sr_destroy(self._state)
            self._state = None
