"""The `tcp` transport's wire format: the ring's writes and reads as length-prefixed binary frames.

A backend host without RDMA runs a small agent (`blink agent`) that is the shm ring's producer on that
host. The gateway sends it the writes it would make to the ring (a request payload, a cancel word, the
consumed counter) and the agent sends back what it reads there (new tokens, finish reason, error code,
prompt length, the header's heartbeat, engine state and stats). The slot numbers on the wire are the
shm ring's slot numbers. This puts the backend host's CPU on the I/O path (never inside the engine).

Frame: `u32 body_len | u8 type | body`, little-endian. One dataclass per message; `encode(msg)` makes a
frame and `decode(type, body)` reads one. Order of a session:

    agent -> gateway   Hello (geometry, fingerprint, the slots free now)
    gateway -> agent   Submit, Cancel, Consumed, Mask, Ping    (any order; applied in order)
    agent -> gateway   Tokens (per slot, the finish last), Freed (slots drained from earlier sessions),
                       State (every few tens of ms: also the agent's keepalive)

Slot ownership: a slot the gateway submitted to belongs to it until a Tokens with a finish arrives; the
agent has then already released it in the ring. Slots left running by a lost session are cancelled by
the agent and announced in Freed once the engine confirms, so nothing is reused while still running.
"""
from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import dataclasses

from .ring import (FINGERPRINT_BYTES, FLAG_CONSTRAINED, REQUEST_HEAD, REQUEST_HEAD_NAMES, EngineState, ErrorCode,
                   FinishReason, RequestSpec, RingGeometry, TokenLogprob, request_head, spec_from_head)

# 2: ring version 2 (penalties, logit bias, logprobs); 3: Submit carries the ring's request head; 4: ring version 3
# (Submit's block hashes and mask 0, Tokens' cached_tokens, State's prefix-cache counters, Hello's kv_block_size
# and mask_words, Mask for the masks after the first)
WIRE_VERSION = 4
_GEOMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(RingGeometry))
WIRE_MAGIC = 0x4B4E_494C  # b"LINK"
MAX_FRAME_BYTES = 16 << 20  # a frame larger than this is a protocol error, not an allocation
_FRAME = struct.Struct("<IB")


class WireError(ValueError):
    """A frame that does not parse: the connection is unusable and is closed."""


@dataclass(frozen=True)
class Hello:
    """First frame of a session, agent -> gateway."""

    TYPE: ClassVar[int] = 1
    geometry: RingGeometry
    fingerprint: str
    free_slots: tuple[int, ...]
    version: int = WIRE_VERSION
    _MAGIC: ClassVar = struct.Struct("<II")  # magic, version: first, so a version mismatch is readable
    _HEAD: ClassVar = struct.Struct(f"<{len(_GEOMETRY_FIELDS)}I{FINGERPRINT_BYTES}sI")

    def pack(self) -> bytes:
        fp = self.fingerprint.encode("ascii")[:FINGERPRINT_BYTES]
        geometry = (getattr(self.geometry, name) for name in _GEOMETRY_FIELDS)
        head = self._MAGIC.pack(WIRE_MAGIC, self.version) + self._HEAD.pack(*geometry, fp, len(self.free_slots))
        return head + _u32s(self.free_slots)

    @classmethod
    def unpack(cls, body: bytes) -> Hello:
        magic, version = cls._MAGIC.unpack_from(body)
        if magic != WIRE_MAGIC:
            raise WireError("not a blink tcp agent (bad magic)")
        if version != WIRE_VERSION:  # the rest of an older Hello does not parse as ours
            return cls(RingGeometry(), "", (), version)
        *geometry, fp, n_free = cls._HEAD.unpack_from(body, cls._MAGIC.size)
        free = _read_u32s(body, cls._MAGIC.size + cls._HEAD.size, n_free)
        return cls(RingGeometry(**dict(zip(_GEOMETRY_FIELDS, geometry))), fp.rstrip(b"\0").decode("ascii", "replace"),
                   free, version)


@dataclass(frozen=True)
class Submit:
    """gateway -> agent: write this request into `slot` and queue it (the ring's `submit`). The body is the
    slot, the ring's fixed request fields as the slot holds them (`ring.REQUEST_HEAD`), then the stop ids,
    the prompt, the logit bias (ids, then biases), the block hashes (u64 each) and, with FLAG_CONSTRAINED, mask 0
    (u32 count, words)."""

    TYPE: ClassVar[int] = 2
    slot: int
    spec: RequestSpec
    _SLOT: ClassVar = struct.Struct("<I")

    def pack(self) -> bytes:
        s = self.spec
        head = self._SLOT.pack(self.slot) + REQUEST_HEAD.pack(*request_head(s))
        bias_ids, biases = [t for t, _ in s.logit_bias], [b for _, b in s.logit_bias]
        mask = b"" if s.token_mask is None else struct.pack("<I", len(s.token_mask) // 4) + s.token_mask
        return (head + _i32s(s.stop_ids) + _i32s(s.prompt_ids) + _i32s(bias_ids) + _f32s(biases)
                + struct.pack(f"<{len(s.block_hashes)}Q", *s.block_hashes) + mask)

    @classmethod
    def unpack(cls, body: bytes) -> Submit:
        (slot,) = cls._SLOT.unpack_from(body)
        head = REQUEST_HEAD.unpack_from(body, cls._SLOT.size)
        n = dict(zip(REQUEST_HEAD_NAMES, head))
        n_stop, n_prompt, n_bias = n["num_stop_ids"], n["prompt_len"], n["num_logit_bias"]
        offset = cls._SLOT.size + REQUEST_HEAD.size
        stop_ids = _read_i32s(body, offset, n_stop)
        prompt_ids = _read_i32s(body, offset + 4 * n_stop, n_prompt)
        offset += 4 * (n_stop + n_prompt)
        bias = tuple(zip(_read_i32s(body, offset, n_bias), _read_f32s(body, offset + 4 * n_bias, n_bias)))
        offset += 8 * n_bias
        n_hashes = n["num_block_hashes"]
        hashes = struct.unpack_from(f"<{n_hashes}Q", body, offset)
        offset += 8 * n_hashes
        mask = _read_mask(body, offset) if n["flags"] & FLAG_CONSTRAINED else None
        return cls(slot, spec_from_head(head, prompt_ids, stop_ids, bias, block_hashes=hashes, token_mask=mask))


@dataclass(frozen=True)
class Cancel:
    """gateway -> agent: set the slot's cancel word (ignored if the slot already finished)."""

    TYPE: ClassVar[int] = 3
    slot: int

    def pack(self) -> bytes:
        return struct.pack("<I", self.slot)

    @classmethod
    def unpack(cls, body: bytes) -> Cancel:
        return cls(*struct.unpack_from("<I", body))


@dataclass(frozen=True)
class Consumed:
    """gateway -> agent: the consumed counters of these slots (backpressure reaches the engine)."""

    TYPE: ClassVar[int] = 4
    counts: tuple[tuple[int, int], ...]  # (slot, tokens consumed so far)

    def pack(self) -> bytes:
        return struct.pack(f"<I{2 * len(self.counts)}I", len(self.counts), *(x for pair in self.counts for x in pair))

    @classmethod
    def unpack(cls, body: bytes) -> Consumed:
        flat = _read_u32s(body, 4, 2 * struct.unpack_from("<I", body)[0])
        return cls(tuple(zip(flat[::2], flat[1::2])))


@dataclass(frozen=True)
class Mask:
    """gateway -> agent: the allowed tokens of the slot's generated token `token_index` (`put_mask`): u32
    words, little-endian, as the ring holds them. The agent writes them, then the slot's mask_seq."""

    TYPE: ClassVar[int] = 9
    slot: int
    token_index: int
    words: bytes
    _HEAD: ClassVar = struct.Struct("<II")

    def pack(self) -> bytes:
        return self._HEAD.pack(self.slot, self.token_index) + struct.pack("<I", len(self.words) // 4) + self.words

    @classmethod
    def unpack(cls, body: bytes) -> Mask:
        slot, token_index = cls._HEAD.unpack_from(body)
        return cls(slot, token_index, _read_mask(body, cls._HEAD.size))


@dataclass(frozen=True)
class Ping:
    """gateway -> agent keepalive: an agent that hears nothing for its idle timeout drops the session."""

    TYPE: ClassVar[int] = 5

    def pack(self) -> bytes:
        return b""

    @classmethod
    def unpack(cls, body: bytes) -> Ping:
        return cls()


@dataclass(frozen=True)
class Tokens:
    """agent -> gateway: what a poll of the slot found (new tokens; a finish is the slot's last word)."""

    TYPE: ClassVar[int] = 6
    slot: int
    tokens: tuple[int, ...] = ()
    finish: FinishReason = FinishReason.NONE
    error_code: ErrorCode = ErrorCode.NONE
    prompt_len: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, or none
    cached_tokens: int = 0  # prompt tokens from the engine's prefix cache
    _HEAD: ClassVar = struct.Struct("<IIIIIiI")  # ..., tokens, alternatives per token (-1: no logprobs), cached

    def pack(self) -> bytes:
        num_top = len(self.logprobs[0].top) if self.logprobs else -1
        extra = b""
        if self.logprobs:  # chosen logprobs, then per token its alternatives' ids and logprobs
            extra = _f32s([e.logprob for e in self.logprobs]) + b"".join(
                _i32s([t for t, _ in e.top]) + _f32s([lp for _, lp in e.top]) for e in self.logprobs)
        return self._HEAD.pack(self.slot, self.finish, self.error_code, self.prompt_len, len(self.tokens),
                               num_top, self.cached_tokens) + _i32s(self.tokens) + extra

    @classmethod
    def unpack(cls, body: bytes) -> Tokens:
        slot, finish, code, prompt_len, n, num_top, cached = cls._HEAD.unpack_from(body)
        try:
            finish, code = FinishReason(finish), ErrorCode(code)
        except ValueError:
            raise WireError(f"Tokens: unknown finish reason {finish} or error code {code}") from None
        return cls(slot, _read_i32s(body, cls._HEAD.size, n), finish, code, prompt_len,
                   _read_logprobs(body, cls._HEAD.size + 4 * n, n, num_top), cached)


@dataclass(frozen=True)
class Freed:
    """agent -> gateway: slots of an earlier session that the engine has finished; free to use."""

    TYPE: ClassVar[int] = 7
    slots: tuple[int, ...]

    def pack(self) -> bytes:
        return struct.pack("<I", len(self.slots)) + _u32s(self.slots)

    @classmethod
    def unpack(cls, body: bytes) -> Freed:
        return cls(_read_u32s(body, 4, struct.unpack_from("<I", body)[0]))


@dataclass(frozen=True)
class State:
    """agent -> gateway: the ring header's engine words (heartbeat, state, stats)."""

    TYPE: ClassVar[int] = 8
    heartbeat: int
    engine_state: EngineState
    stats: dict[str, int] = field(default_factory=dict)
    STAT_NAMES: ClassVar = ("free_kv_blocks", "total_kv_blocks", "running", "waiting", "generated_tokens",
                            "cached_kv_blocks", "prefix_cache_queries", "prefix_cache_hits")
    _BODY: ClassVar = struct.Struct("<QIIIIIQIQQ")

    def pack(self) -> bytes:
        return self._BODY.pack(self.heartbeat, self.engine_state, *(self.stats.get(n, 0) for n in self.STAT_NAMES))

    @classmethod
    def unpack(cls, body: bytes) -> State:
        heartbeat, state, *stats = cls._BODY.unpack_from(body)
        return cls(heartbeat, EngineState(state), dict(zip(cls.STAT_NAMES, stats)))


MESSAGES = {m.TYPE: m for m in (Hello, Submit, Cancel, Consumed, Ping, Tokens, Freed, State, Mask)}
Message = Hello | Submit | Cancel | Consumed | Ping | Tokens | Freed | State | Mask


def encode(msg: Message) -> bytes:
    body = msg.pack()
    return _FRAME.pack(len(body), msg.TYPE) + body


def decode(msg_type: int, body: bytes) -> Message:
    cls = MESSAGES.get(msg_type)
    if cls is None:
        raise WireError(f"unknown message type {msg_type}")
    try:
        return cls.unpack(body)
    except (struct.error, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed {cls.__name__} frame ({len(body)} bytes): {exc}") from None


async def read_message(reader: asyncio.StreamReader) -> Message:
    """The next message; raises asyncio.IncompleteReadError at EOF and WireError on garbage."""
    body_len, msg_type = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if body_len > MAX_FRAME_BYTES:
        raise WireError(f"frame of {body_len} bytes is over the limit of {MAX_FRAME_BYTES}")
    return decode(msg_type, await reader.readexactly(body_len))


class Outbox:
    """Frames queued during one pass of the event loop and written with one `write` (fewer syscalls)."""

    def __init__(self) -> None:
        self._frames: list[bytes] = []

    def put(self, msg: Message) -> None:
        self._frames.append(encode(msg))

    def __bool__(self) -> bool:
        return bool(self._frames)

    def flush(self, writer: asyncio.StreamWriter) -> None:
        if self._frames:
            data, self._frames = b"".join(self._frames), []
            writer.write(data)


def _u32s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def _i32s(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _read_u32s(body: bytes, offset: int, n: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{n}I", body, offset)


def _read_i32s(body: bytes, offset: int, n: int) -> tuple[int, ...]:
    return struct.unpack_from(f"<{n}i", body, offset)


def _f32s(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _read_f32s(body: bytes, offset: int, n: int) -> tuple[float, ...]:
    return struct.unpack_from(f"<{n}f", body, offset)


def _read_mask(body: bytes, offset: int) -> bytes:
    """A u32 word count, then that many words (as bytes): a mask on the wire."""
    (n,) = struct.unpack_from("<I", body, offset)
    words = body[offset + 4 : offset + 4 + 4 * n]
    if len(words) != 4 * n:
        raise WireError(f"mask of {n} words runs past the frame")
    return words


def _read_logprobs(body: bytes, offset: int, n: int, num_top: int) -> tuple[TokenLogprob, ...]:
    if num_top < 0:
        return ()
    chosen = _read_f32s(body, offset, n)
    entries, offset = [], offset + 4 * n
    for logprob in chosen:
        ids, lps = _read_i32s(body, offset, num_top), _read_f32s(body, offset + 4 * num_top, num_top)
        entries.append(TokenLogprob(logprob, tuple(zip(ids, lps))))
        offset += 8 * num_top
    return tuple(entries)
