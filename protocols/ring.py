"""The request/response ring: the one memory layout shared by the gateway, the engines and the kernels.

The fixed part (header, slots, flags, enums) is declared once in `protocols/ring_decl.py`; `python -m
protocols.layout.gen` writes its Python view (`protocols/ring_layout.py`, re-exported here) and its C view
(`kernels/csrc/include/blink_ring_layout.h`, included by `blink_ring.h`). This module adds the geometry
(the regions' sizes and offsets); `tests/protocols/test_ring_layout.py` compiles the C header and compares
every offset and size with both.

Memory map (all little-endian, every region 64-byte aligned):

    [header 256 B][submission queue: num_slots x u32][requests: num_slots x request_bytes]
    [responses: num_slots x response_bytes][logit biases: num_slots x logit_bias_bytes]
    [logprobs: num_slots x logprob_bytes][block hashes: num_slots x block_hash_bytes]
    [token masks: num_slots x mask_bytes]

The version-2 regions extend a request slot (gateway writes, before `seq`) and a response slot (engine
writes, before `produced`); they sit after the older regions so that every offset of version 1 stays where it
was. Version 3 adds two the same way: the block-hash region (a request's prefix-cache keys, gateway writes,
before `seq`) and the token masks of constrained requests (FLAG_CONSTRAINED), a slot's area written by the
gateway only: the mask words (bit t % 32 of word t // 32: token t allowed), then, on its own cache line,
`mask_seq` = the index of the generated token the words are for, plus one, stored last. Mask 0 comes with the
request (before `seq`); the gateway writes mask i + 1 after it read token i, so the engine, which reads mask i
only before it publishes token i, never sees a mask change under it.

Rules (DESIGN.md, "The rings"):
- every word has exactly one writer, named below; nobody does read-modify-write across processors;
- a writer stores the payload first and the word that validates it last (a request slot's `seq`, a
  response's `produced`, then `finish_reason`); a reader loads the validating word first.
- the gateway (producer) owns a slot from `submit` until it `release`s it after the engine (consumer)
  has written a finish reason; the engine never touches a slot it has finished.
"""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

# The fixed layout, generated from protocols/ring_decl.py: RING_MAGIC, RING_VERSION, HEADER_BYTES,
# FINGERPRINT_BYTES, FLAG_*, FinishReason, ErrorCode, EngineState, the HDR_/REQ_/RESP_ offsets, the
# *_FIELDS dicts and the HEADER/REQUEST/RESPONSE numpy dtypes.
from protocols.ring_layout import *  # noqa: F401,F403
from protocols.ring_layout import (ErrorCode, FinishReason, HEADER_BYTES, HEADER_DTYPE, FINGERPRINT_BYTES,
                                   FLAG_CONSTRAINED, FLAG_HAS_SEED, FLAG_IGNORE_EOS, FLAG_LOGPROBS, REQ_STOP_IDS,
                                   RESP_TOKENS, REQUEST_FIELDS, RING_MAGIC, RING_VERSION)
from protocols.layout.views import pack_format

CACHE_LINE = 64


def _align(n: int, to: int = CACHE_LINE) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RingGeometry:
    """Sizes fixed when a ring is created; both sides must agree on them."""

    num_slots: int = 256
    max_prompt_len: int = 8192
    max_output_len: int = 1024  # per-slot response buffer capacity in tokens (a ring: it wraps)
    max_stop_ids: int = 16
    max_logit_bias: int = 300  # logit_bias entries per request (OpenAI's limit)
    max_logprobs: int = 20  # alternatives per token (OpenAI's top_logprobs limit)
    # Tokens of logprobs a slot holds (at most max_output_len): a request that asks for logprobs runs at
    # most this far ahead of the gateway's reads. Small, so that 256 slots x 20 alternatives stay ~3 MB.
    logprob_window: int = 64
    # The engine's KV block size: a block hash covers this many prompt tokens (protocols/prefix_hash.py).
    kv_block_size: int = 16
    mask_words: int = 0  # u32 words of a token mask (ceil(vocab / 32), set by the backend); 0: no masks

    def __post_init__(self) -> None:
        for name in _GEOMETRY_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < (name != "mask_words"):  # mask_words may be 0
                raise ValueError(f"RingGeometry.{name} must be a positive int (mask_words: not negative), "
                                 f"got {value!r}")
        if self.num_slots > 1 << 20:
            raise ValueError(f"RingGeometry.num_slots {self.num_slots} is over the limit of {1 << 20}")
        object.__setattr__(self, "logprob_window", min(self.logprob_window, self.max_output_len))

    @property
    def request_bytes(self) -> int:
        return _align(REQ_STOP_IDS + 4 * self.max_stop_ids) + _align(4 * self.max_prompt_len)

    @property
    def prompt_offset(self) -> int:
        """Offset of the prompt token array inside a request slot."""
        return _align(REQ_STOP_IDS + 4 * self.max_stop_ids)

    @property
    def response_bytes(self) -> int:
        return RESP_TOKENS + _align(4 * self.max_output_len)

    @property
    def sq_offset(self) -> int:
        return HEADER_BYTES

    @property
    def requests_offset(self) -> int:
        return _align(self.sq_offset + 4 * self.num_slots)

    @property
    def responses_offset(self) -> int:
        return self.requests_offset + self.num_slots * self.request_bytes

    @property
    def logit_bias_bytes(self) -> int:
        """Per slot: token ids i32[max_logit_bias], then their biases f32[max_logit_bias]."""
        return 2 * _align(4 * self.max_logit_bias)

    @property
    def logit_bias_offset(self) -> int:
        return self.responses_offset + self.num_slots * self.response_bytes

    @property
    def logprob_bytes(self) -> int:
        """Per slot, indexed by token i % logprob_window: the chosen token's logprob f32[window], then the
        alternatives' ids i32[window][max_logprobs] and their logprobs f32[window][max_logprobs]."""
        return self.logprob_top_offset + _align(4 * self.logprob_window * self.max_logprobs)

    @property
    def logprob_top_ids_offset(self) -> int:
        """Offset of the alternatives' ids inside a slot's logprob area."""
        return _align(4 * self.logprob_window)

    @property
    def logprob_top_offset(self) -> int:
        """Offset of the alternatives' logprobs inside a slot's logprob area."""
        return self.logprob_top_ids_offset + _align(4 * self.logprob_window * self.max_logprobs)

    @property
    def logprobs_offset(self) -> int:
        return self.logit_bias_offset + self.num_slots * self.logit_bias_bytes

    @property
    def max_block_hashes(self) -> int:
        """Block hashes a slot holds: one per full block of the longest prompt (0 when a block is longer)."""
        return self.max_prompt_len // self.kv_block_size

    def max_hashes_for(self, prompt_len: int) -> int:
        """Block hashes a prompt of `prompt_len` tokens may carry: one per full block, as many as a slot holds."""
        return min(prompt_len // self.kv_block_size, self.max_block_hashes)

    @property
    def block_hash_bytes(self) -> int:
        """Per slot: the request's block hashes, u64[max_block_hashes] (version 3)."""
        return _align(8 * self.max_block_hashes)

    @property
    def block_hashes_offset(self) -> int:
        return self.logprobs_offset + self.num_slots * self.logprob_bytes

    @property
    def masks_offset(self) -> int:
        return self.block_hashes_offset + self.num_slots * self.block_hash_bytes

    @property
    def mask_seq_offset(self) -> int:
        """Offset of `mask_seq` (u32) inside a slot's mask area: the cache line after the words."""
        return _align(4 * self.mask_words)

    @property
    def mask_bytes(self) -> int:
        """Per slot: the mask words u32[mask_words], then mask_seq on its own line (none without masks)."""
        return self.mask_seq_offset + CACHE_LINE if self.mask_words else 0

    @property
    def total_bytes(self) -> int:
        return self.masks_offset + self.num_slots * self.mask_bytes


_GEOMETRY_FIELDS = ("num_slots", "max_prompt_len", "max_output_len", "max_stop_ids", "max_logit_bias",
                    "max_logprobs", "logprob_window", "kv_block_size", "mask_words")


@dataclass(frozen=True)
class RequestSpec:
    """One generation request as the gateway submits it (token ids only: text never enters a ring)."""

    request_id: int
    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Sequence[tuple[int, float]] = field(default_factory=tuple)  # (token id, bias)
    num_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and k alternatives
    # Prefix-cache keys: one nonzero u64 per full prompt block of geometry.kv_block_size tokens, chained
    # (protocols/prefix_hash.block_hashes); may stop early (fewer blocks are then shareable). () = no caching.
    block_hashes: Sequence[int] = field(default_factory=tuple)

    # The allowed tokens of generated token 0 (u32 words, little-endian, bit t % 32 of word t // 32 set =
    # token t allowed; geometry.mask_words of them). Not None: the request is constrained (FLAG_CONSTRAINED)
    # and generated token i waits for its mask i (`RingProducer.put_mask(slot, i, words)`). Kept as bytes.
    token_mask: np.ndarray | bytes | None = None

    def __post_init__(self) -> None:
        if self.token_mask is not None and not isinstance(self.token_mask, bytes):
            object.__setattr__(self, "token_mask", mask_bytes(self.token_mask))

    def validate(self, geometry: RingGeometry) -> None:
        """Raise ValueError naming the field when the request cannot be written into a slot."""
        if not 0 < len(self.prompt_ids) <= geometry.max_prompt_len:
            raise ValueError(
                f"prompt_ids: length {len(self.prompt_ids)} is outside 1..{geometry.max_prompt_len}"
            )
        if not 0 < self.max_tokens < 1 << 32:
            raise ValueError(f"max_tokens: {self.max_tokens} must be positive")
        if len(self.stop_ids) > geometry.max_stop_ids:
            raise ValueError(f"stop_ids: {len(self.stop_ids)} ids, at most {geometry.max_stop_ids}")
        if not all(0 <= t < 1 << 31 for t in self.stop_ids):  # int32 words: a bad id must not leak a slot
            raise ValueError("stop_ids: every id must be a non-negative 32-bit int")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or not 0 <= self.top_k < 1 << 31 \
                or not 0 <= self.min_p <= 1:
            raise ValueError("sampling: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1")
        if not 0 <= self.priority < 1 << 32:
            raise ValueError(f"priority: {self.priority} must be a non-negative 32-bit int")
        self._validate_v2(geometry)

    def _validate_v2(self, geometry: RingGeometry) -> None:
        if not (_finite(self.presence_penalty) and _finite(self.frequency_penalty)
                and _finite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("penalties: need finite presence and frequency penalties, repetition_penalty > 0")
        if len(self.logit_bias) > geometry.max_logit_bias:
            raise ValueError(f"logit_bias: {len(self.logit_bias)} entries, at most {geometry.max_logit_bias}")
        if not all(0 <= t < 1 << 31 and _finite(b) for t, b in self.logit_bias):
            raise ValueError("logit_bias: every id must be a non-negative 32-bit int, every bias finite")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= geometry.max_logprobs:
            raise ValueError(f"num_logprobs: {self.num_logprobs} is outside 0..{geometry.max_logprobs}")
        self._validate_v3(geometry)

    def _validate_v3(self, geometry: RingGeometry) -> None:
        full_blocks = geometry.max_hashes_for(len(self.prompt_ids))
        if len(self.block_hashes) > full_blocks:
            raise ValueError(f"block_hashes: {len(self.block_hashes)} hashes, at most {full_blocks} (one per full "
                             f"prompt block of {geometry.kv_block_size} tokens)")
        if not all(0 < h < 1 << 64 for h in self.block_hashes):
            raise ValueError("block_hashes: every hash must be a nonzero unsigned 64-bit int")
        if self.token_mask is not None:
            check_mask(self.token_mask, geometry, "token_mask")

    @property
    def flags(self) -> int:
        return ((FLAG_HAS_SEED if self.seed is not None else 0) | (FLAG_IGNORE_EOS if self.ignore_eos else 0)
                | (FLAG_LOGPROBS if self.num_logprobs is not None else 0)
                | (FLAG_CONSTRAINED if self.token_mask is not None else 0))

    @functools.cached_property  # the host engine asks for every sampled row of every step
    def uses_sampling_extensions(self) -> bool:
        """Penalties, logit bias, logprobs or token masks: what only some engine modes implement."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.num_logprobs is not None or self.token_mask is not None)


def mask_bytes(words: np.ndarray | bytes | Sequence[int]) -> bytes:
    """A token mask as the ring holds it: u32 words, little-endian."""
    if isinstance(words, bytes):
        return words
    return np.ascontiguousarray(words, dtype="<u4").tobytes()


def check_mask(words: bytes, geometry: RingGeometry, name: str) -> None:
    """ValueError naming `name` unless `words` is one mask of this ring (geometry.mask_words u32 words)."""
    if not geometry.mask_words:
        raise ValueError(f"{name}: this backend's ring takes no token masks (mask_words is 0)")
    if len(words) != 4 * geometry.mask_words:
        raise ValueError(f"{name}: {len(words)} bytes, a mask is {geometry.mask_words} u32 words "
                         f"({4 * geometry.mask_words} bytes)")


def put_mask_words(words: np.ndarray | bytes | Sequence[int], token_index: int, geometry: RingGeometry) -> bytes:
    """A producer's `put_mask` arguments checked (ValueError naming them), the words as the ring holds them."""
    words = mask_bytes(words)
    check_mask(words, geometry, "put_mask: words")
    if not 0 <= token_index < (1 << 32) - 1:
        raise ValueError(f"put_mask: token_index {token_index} is outside 0..{(1 << 32) - 2}")
    return words


@dataclass(frozen=True)
class TokenLogprob:
    """A published token's logprob and the best `num_logprobs` alternatives, (token id, logprob) descending."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _finite(x: float) -> bool:
    return abs(x) < float("inf")  # False for inf and NaN alike


# A request's fixed fields after `seq` (request_id .. num_block_hashes; cancel_seq among them, sent as 0) as one
# `struct`: the shm producer packs them into a slot (seq after), the tcp wire's Submit carries the same bytes,
# and the consumer unpacks them.
REQUEST_HEAD_NAMES = tuple(list(REQUEST_FIELDS)[1:list(REQUEST_FIELDS).index("num_block_hashes") + 1])
REQUEST_HEAD = struct.Struct(pack_format(REQUEST_FIELDS, REQUEST_HEAD_NAMES[0], REQUEST_HEAD_NAMES[-1]))
_U64 = (1 << 64) - 1
_F32_MAX = 3.4028234663852886e38


def _f32(value: float) -> float:
    """A float as a f32 word holds it (what numpy's cast gives): beyond f32's range, infinity."""
    return value if -_F32_MAX <= value <= _F32_MAX or value != value else math.copysign(math.inf, value)


def request_head(spec: RequestSpec) -> tuple:
    """`spec`'s values for REQUEST_HEAD, in REQUEST_HEAD_NAMES order."""
    return (spec.request_id & _U64, len(spec.prompt_ids), spec.max_tokens, _f32(spec.temperature), _f32(spec.top_p),
            spec.top_k, _f32(spec.min_p), (spec.seed or 0) & _U64, spec.flags, spec.priority, len(spec.stop_ids), 0,
            _f32(spec.presence_penalty), _f32(spec.frequency_penalty), _f32(spec.repetition_penalty),
            len(spec.logit_bias), spec.num_logprobs or 0, len(spec.block_hashes))


def spec_from_head(head: tuple, prompt_ids: Sequence[int], stop_ids: Sequence[int],
                   logit_bias: Sequence[tuple[int, float]], max_logprobs: int | None = None,
                   block_hashes: Sequence[int] = (), token_mask: bytes | None = None) -> RequestSpec:
    """The RequestSpec of unpacked REQUEST_HEAD values and the slot's arrays (their lengths are the caller's:
    clipped to the geometry on a ring, as sent on the wire); `max_logprobs` clips num_logprobs; `token_mask`
    (mask 0) is kept only with FLAG_CONSTRAINED, which an empty one then still marks."""
    h = dict(zip(REQUEST_HEAD_NAMES, head))
    flags, num_logprobs = h["flags"], h["num_logprobs"]
    if max_logprobs is not None:
        num_logprobs = min(num_logprobs, max_logprobs)
    return RequestSpec(
        request_id=h["request_id"], prompt_ids=prompt_ids, max_tokens=h["max_tokens"], temperature=h["temperature"],
        top_p=h["top_p"], top_k=h["top_k"], min_p=h["min_p"], seed=h["seed"] if flags & FLAG_HAS_SEED else None,
        stop_ids=tuple(stop_ids), ignore_eos=bool(flags & FLAG_IGNORE_EOS), priority=h["priority"],
        presence_penalty=h["presence_penalty"], frequency_penalty=h["frequency_penalty"],
        repetition_penalty=h["repetition_penalty"], logit_bias=tuple(logit_bias),
        num_logprobs=num_logprobs if flags & FLAG_LOGPROBS else None, block_hashes=tuple(block_hashes),
        token_mask=(token_mask or b"") if flags & FLAG_CONSTRAINED else None)


class RingLayoutError(ValueError):
    """A ring's header does not match what the attaching side expects."""


def header_view(buf: np.ndarray) -> np.void:
    """The header's named fields (a structured view of `buf[:HEADER_BYTES]`: stores go to the ring)."""
    return buf[:HEADER_BYTES].view(HEADER_DTYPE)[0]


_DERIVED_FIELDS = ("request_bytes", "response_bytes", "requests_offset", "responses_offset", "logit_bias_offset",
                   "total_bytes")  # the masks follow the logprobs: total_bytes checks their place


def geometry_from_header(buf: memoryview | bytearray | np.ndarray) -> RingGeometry:
    """Check magic, version and self-consistency of a header and return its geometry."""
    hdr = header_view(np.frombuffer(bytes(buf[:HEADER_BYTES]), dtype=np.uint8))  # a copy: holds no export of `buf`
    if int(hdr["magic"]) != RING_MAGIC:
        raise RingLayoutError("not a blink ring (bad magic); was it created by `blink backend`?")
    version = int(hdr["version"])
    if version != RING_VERSION:
        raise RingLayoutError(f"ring version {version} is not supported (this build speaks {RING_VERSION})")
    try:
        geometry = RingGeometry(**{name: int(hdr[name]) for name in _GEOMETRY_FIELDS})
    except ValueError as exc:
        raise RingLayoutError(f"ring header: {exc}") from None
    stored = {"header_bytes": int(hdr["header_bytes"]), **{k: int(hdr[k]) for k in _DERIVED_FIELDS}}
    expected = {"header_bytes": HEADER_BYTES, **{k: getattr(geometry, k) for k in _DERIVED_FIELDS}}
    for key, value in stored.items():
        if value != expected[key]:
            raise RingLayoutError(f"ring header field {key}={value} disagrees with its geometry ({expected[key]})")
    return geometry


def write_header(buf: np.ndarray, geometry: RingGeometry, fingerprint: str) -> None:
    """Fill a zeroed header (creator only, before anyone attaches)."""
    hdr = header_view(buf)
    hdr["version"] = RING_VERSION
    hdr["header_bytes"] = HEADER_BYTES
    for name in _GEOMETRY_FIELDS + _DERIVED_FIELDS:
        hdr[name] = getattr(geometry, name)
    hdr["sq_offset"] = geometry.sq_offset
    hdr["fingerprint"] = fingerprint.encode("ascii")[:FINGERPRINT_BYTES]
    hdr["magic"] = RING_MAGIC  # last: a reader that sees the magic sees a whole header


def read_fingerprint(buf: np.ndarray) -> str:
    raw = bytes(header_view(buf)["fingerprint"])
    return raw.rstrip(b"\0").decode("ascii", "replace")
