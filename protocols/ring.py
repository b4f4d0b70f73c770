"""The request/response ring: the one memory layout shared by the gateway, the engines and the kernels.

This module is the single source of truth. `kernels/csrc/include/blink_ring.h` mirrors it for device
code and `tests/protocols/test_ring_layout.py` compiles that header and compares every offset and size.

Memory map (all little-endian, every region 64-byte aligned):

    [header 256 B][submission queue: num_slots x u32][requests: num_slots x request_bytes]
    [responses: num_slots x response_bytes][logit biases: num_slots x logit_bias_bytes]
    [logprobs: num_slots x logprob_bytes]

The last two regions (version 2) extend a request slot (gateway writes, before `seq`) and a response
slot (engine writes, before `produced`); they sit after the older regions so that every offset of
version 1 stays where it was.

Rules (DESIGN.md, "The rings"):
- every word has exactly one writer, named below; nobody does read-modify-write across processors;
- a writer stores the payload first and the word that validates it last (a request slot's `seq`, a
  response's `produced`, then `finish_reason`); a reader loads the validating word first.
- the gateway (producer) owns a slot from `submit` until it `release`s it after the engine (consumer)
  has written a finish reason; the engine never touches a slot it has finished.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

RING_MAGIC = 0x474E_4952_4B4E_494C  # b"LINKRING" little-endian
RING_VERSION = 2  # 2: penalties, logit bias and logprobs
CACHE_LINE = 64


def _align(n: int, to: int = CACHE_LINE) -> int:
    return (n + to - 1) // to * to


class FinishReason(enum.IntEnum):
    """Why a request ended. Written by the engine into the response area."""

    NONE = 0  # still running
    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens reached
    CANCELLED = 3  # the producer asked (client gone, stop string matched)
    ERROR = 4  # see ErrorCode


class ErrorCode(enum.IntEnum):
    """Detail for FinishReason.ERROR, with a message the gateway can show to the client."""

    NONE = 0
    PROMPT_TOO_LONG = 1
    INVALID_PARAMS = 2
    NO_KV_CAPACITY = 3
    ENGINE_STOPPING = 4
    INTERNAL = 5

    @property
    def message(self) -> str:
        return _ERROR_MESSAGES[self]


_ERROR_MESSAGES = {
    ErrorCode.NONE: "",
    ErrorCode.PROMPT_TOO_LONG: "the prompt plus max_tokens exceeds the model's context length",
    ErrorCode.INVALID_PARAMS: "the engine rejected the sampling parameters",
    ErrorCode.NO_KV_CAPACITY: "the request needs more KV cache than the whole engine holds",
    ErrorCode.ENGINE_STOPPING: "the engine is shutting down and did not finish this request",
    ErrorCode.INTERNAL: "the engine failed while running this request",
}


class EngineState(enum.IntEnum):
    """Engine lifecycle, written by the engine into the header."""

    STARTING = 0
    SERVING = 1
    STOPPING = 2
    STOPPED = 3


# Request flags (RequestSpec booleans packed into one word).
FLAG_HAS_SEED = 1 << 0
FLAG_IGNORE_EOS = 1 << 1
FLAG_LOGPROBS = 1 << 2  # publish the chosen token's logprob and `num_logprobs` alternatives per token


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

    def __post_init__(self) -> None:
        for name in _GEOMETRY_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"RingGeometry.{name} must be a positive int, got {value!r}")
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
    def total_bytes(self) -> int:
        return self.logprobs_offset + self.num_slots * self.logprob_bytes


_GEOMETRY_FIELDS = ("num_slots", "max_prompt_len", "max_output_len", "max_stop_ids", "max_logit_bias",
                    "max_logprobs", "logprob_window")


# ---- header (256 bytes) -------------------------------------------------------------------------
# Lines 0-1, written once by the creator (the backend) before anyone attaches.
HDR_MAGIC = 0  # u64
HDR_VERSION = 8  # u32
HDR_HEADER_BYTES = 12  # u32
HDR_NUM_SLOTS = 16  # u32
HDR_MAX_PROMPT_LEN = 20  # u32
HDR_MAX_OUTPUT_LEN = 24  # u32
HDR_MAX_STOP_IDS = 28  # u32
HDR_REQUEST_BYTES = 32  # u32
HDR_RESPONSE_BYTES = 36  # u32
HDR_SQ_OFFSET = 40  # u64
HDR_REQUESTS_OFFSET = 48  # u64
HDR_RESPONSES_OFFSET = 56  # u64
HDR_TOTAL_BYTES = 64  # u64
HDR_MAX_LOGIT_BIAS = 72  # u32 (version 2)
HDR_MAX_LOGPROBS = 76  # u32
HDR_LOGPROB_WINDOW = 80  # u32
HDR_LOGIT_BIAS_OFFSET = 88  # u64; the logprobs region follows the logit-bias region
FINGERPRINT_BYTES = 32
HDR_FINGERPRINT = 96  # char[32], ASCII, NUL-padded
# Line 2, written by the engine (consumer).
HDR_HEARTBEAT = 128  # u64, bumped every engine loop iteration
HDR_ENGINE_STATE = 136  # u32, EngineState
HDR_SQ_HEAD = 144  # u64, submission-queue entries consumed so far
HDR_FREE_KV_BLOCKS = 152  # u32
HDR_TOTAL_KV_BLOCKS = 156  # u32
HDR_RUNNING = 160  # u32, sequences in the running batch
HDR_WAITING = 164  # u32, admitted-but-waiting sequences
HDR_GENERATED_TOKENS = 168  # u64, total tokens published
# Line 3, written by the gateway (producer).
HDR_SQ_TAIL = 192  # u64, submission-queue entries written so far
HEADER_BYTES = 256

# ---- request slot (gateway writes everything; `seq` last) -----------------------------------------
REQ_SEQ = 0  # u64, nonzero submission number; validates the payload below
REQ_REQUEST_ID = 8  # u64
REQ_PROMPT_LEN = 16  # u32
REQ_MAX_TOKENS = 20  # u32
REQ_TEMPERATURE = 24  # f32, 0 means greedy
REQ_TOP_P = 28  # f32
REQ_TOP_K = 32  # i32, 0 means off
REQ_MIN_P = 36  # f32
REQ_SEED = 40  # u64
REQ_FLAGS = 48  # u32, FLAG_*
REQ_PRIORITY = 52  # u32, 0 = latency-sensitive (first), larger = later
REQ_NUM_STOP_IDS = 56  # u32
REQ_CANCEL_SEQ = 64  # u64, equals `seq` once the gateway asks to cancel this submission
REQ_PRESENCE_PENALTY = 72  # f32, 0 means off (version 2, in what was padding)
REQ_FREQUENCY_PENALTY = 76  # f32, 0 means off
REQ_REPETITION_PENALTY = 80  # f32, 1 means off
REQ_NUM_LOGIT_BIAS = 84  # u32, entries in the slot's logit-bias area
REQ_NUM_LOGPROBS = 88  # u32, alternatives per token when FLAG_LOGPROBS is set
REQ_STOP_IDS = 128  # i32[max_stop_ids], then the prompt i32[max_prompt_len] at geometry.prompt_offset

# ---- response slot (engine writes line 0 and the tokens; gateway writes line 1) ----------------------
RESP_SEQ = 0  # u64, the request `seq` these counters belong to
RESP_PRODUCED = 8  # u32, tokens written so far (monotonic; token i lives at tokens[i % max_output_len])
RESP_FINISH_REASON = 12  # u32, FinishReason; written after the last `produced`
RESP_FIRST_TOKEN_NS = 16  # u64, engine clock (CLOCK_MONOTONIC or GPU globaltimer)
RESP_LAST_TOKEN_NS = 24  # u64
RESP_PROMPT_LEN = 32  # u32, prompt tokens the engine accepted
RESP_ERROR_CODE = 36  # u32, ErrorCode when finish_reason == ERROR
RESP_CONSUMED = 64  # u32, gateway: tokens read so far (backpressure: produced - consumed <= capacity)
RESP_TOKENS = 128  # i32[max_output_len]

# Every scalar field: name -> (offset, C type). The layout test compares these with the C header.
HEADER_FIELDS = {
    "magic": (HDR_MAGIC, "uint64_t"),
    "version": (HDR_VERSION, "uint32_t"),
    "header_bytes": (HDR_HEADER_BYTES, "uint32_t"),
    "num_slots": (HDR_NUM_SLOTS, "uint32_t"),
    "max_prompt_len": (HDR_MAX_PROMPT_LEN, "uint32_t"),
    "max_output_len": (HDR_MAX_OUTPUT_LEN, "uint32_t"),
    "max_stop_ids": (HDR_MAX_STOP_IDS, "uint32_t"),
    "request_bytes": (HDR_REQUEST_BYTES, "uint32_t"),
    "response_bytes": (HDR_RESPONSE_BYTES, "uint32_t"),
    "sq_offset": (HDR_SQ_OFFSET, "uint64_t"),
    "requests_offset": (HDR_REQUESTS_OFFSET, "uint64_t"),
    "responses_offset": (HDR_RESPONSES_OFFSET, "uint64_t"),
    "total_bytes": (HDR_TOTAL_BYTES, "uint64_t"),
    "max_logit_bias": (HDR_MAX_LOGIT_BIAS, "uint32_t"),
    "max_logprobs": (HDR_MAX_LOGPROBS, "uint32_t"),
    "logprob_window": (HDR_LOGPROB_WINDOW, "uint32_t"),
    "logit_bias_offset": (HDR_LOGIT_BIAS_OFFSET, "uint64_t"),
    "fingerprint": (HDR_FINGERPRINT, "char[32]"),
    "heartbeat": (HDR_HEARTBEAT, "uint64_t"),
    "engine_state": (HDR_ENGINE_STATE, "uint32_t"),
    "sq_head": (HDR_SQ_HEAD, "uint64_t"),
    "free_kv_blocks": (HDR_FREE_KV_BLOCKS, "uint32_t"),
    "total_kv_blocks": (HDR_TOTAL_KV_BLOCKS, "uint32_t"),
    "running": (HDR_RUNNING, "uint32_t"),
    "waiting": (HDR_WAITING, "uint32_t"),
    "generated_tokens": (HDR_GENERATED_TOKENS, "uint64_t"),
    "sq_tail": (HDR_SQ_TAIL, "uint64_t"),
}
REQUEST_FIELDS = {
    "seq": (REQ_SEQ, "uint64_t"),
    "request_id": (REQ_REQUEST_ID, "uint64_t"),
    "prompt_len": (REQ_PROMPT_LEN, "uint32_t"),
    "max_tokens": (REQ_MAX_TOKENS, "uint32_t"),
    "temperature": (REQ_TEMPERATURE, "float"),
    "top_p": (REQ_TOP_P, "float"),
    "top_k": (REQ_TOP_K, "int32_t"),
    "min_p": (REQ_MIN_P, "float"),
    "seed": (REQ_SEED, "uint64_t"),
    "flags": (REQ_FLAGS, "uint32_t"),
    "priority": (REQ_PRIORITY, "uint32_t"),
    "num_stop_ids": (REQ_NUM_STOP_IDS, "uint32_t"),
    "cancel_seq": (REQ_CANCEL_SEQ, "uint64_t"),
    "presence_penalty": (REQ_PRESENCE_PENALTY, "float"),
    "frequency_penalty": (REQ_FREQUENCY_PENALTY, "float"),
    "repetition_penalty": (REQ_REPETITION_PENALTY, "float"),
    "num_logit_bias": (REQ_NUM_LOGIT_BIAS, "uint32_t"),
    "num_logprobs": (REQ_NUM_LOGPROBS, "uint32_t"),
    "stop_ids": (REQ_STOP_IDS, "int32_t[]"),
}
RESPONSE_FIELDS = {
    "seq": (RESP_SEQ, "uint64_t"),
    "produced": (RESP_PRODUCED, "uint32_t"),
    "finish_reason": (RESP_FINISH_REASON, "uint32_t"),
    "first_token_ns": (RESP_FIRST_TOKEN_NS, "uint64_t"),
    "last_token_ns": (RESP_LAST_TOKEN_NS, "uint64_t"),
    "prompt_len": (RESP_PROMPT_LEN, "uint32_t"),
    "error_code": (RESP_ERROR_CODE, "uint32_t"),
    "consumed": (RESP_CONSUMED, "uint32_t"),
    "tokens": (RESP_TOKENS, "int32_t[]"),
}


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

    @property
    def flags(self) -> int:
        return ((FLAG_HAS_SEED if self.seed is not None else 0) | (FLAG_IGNORE_EOS if self.ignore_eos else 0)
                | (FLAG_LOGPROBS if self.num_logprobs is not None else 0))

    @functools.cached_property  # the host engine asks for every sampled row of every step
    def uses_sampling_extensions(self) -> bool:
        """Penalties, logit bias or logprobs: what only some engine modes implement."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.num_logprobs is not None)


@dataclass(frozen=True)
class TokenLogprob:
    """A published token's logprob and the best `num_logprobs` alternatives, (token id, logprob) descending."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _finite(x: float) -> bool:
    return abs(x) < float("inf")  # False for inf and NaN alike


class RingLayoutError(ValueError):
    """A ring's header does not match what the attaching side expects."""


def geometry_from_header(buf: memoryview | bytearray | np.ndarray) -> RingGeometry:
    """Check magic, version and self-consistency of a header and return its geometry."""
    hdr = np.frombuffer(bytes(buf[:HEADER_BYTES]), dtype=np.uint8)  # a copy: holds no export of `buf`
    u32 = hdr.view(np.uint32)
    u64 = hdr.view(np.uint64)
    if int(u64[HDR_MAGIC // 8]) != RING_MAGIC:
        raise RingLayoutError("not a blink ring (bad magic); was it created by `blink backend`?")
    version = int(u32[HDR_VERSION // 4])
    if version != RING_VERSION:
        raise RingLayoutError(f"ring version {version} is not supported (this build speaks {RING_VERSION})")
    try:
        geometry = RingGeometry(**{name: int(u32[HEADER_FIELDS[name][0] // 4]) for name in _GEOMETRY_FIELDS})
    except ValueError as exc:
        raise RingLayoutError(f"ring header: {exc}") from None
    stored = {
        "header_bytes": int(u32[HDR_HEADER_BYTES // 4]),
        "request_bytes": int(u32[HDR_REQUEST_BYTES // 4]),
        "response_bytes": int(u32[HDR_RESPONSE_BYTES // 4]),
        "requests_offset": int(u64[HDR_REQUESTS_OFFSET // 8]),
        "responses_offset": int(u64[HDR_RESPONSES_OFFSET // 8]),
        "logit_bias_offset": int(u64[HDR_LOGIT_BIAS_OFFSET // 8]),
        "total_bytes": int(u64[HDR_TOTAL_BYTES // 8]),
    }
    expected = {"header_bytes": HEADER_BYTES, **{k: getattr(geometry, k) for k in list(stored)[1:]}}
    for key, value in stored.items():
        if value != expected[key]:
            raise RingLayoutError(f"ring header field {key}={value} disagrees with its geometry ({expected[key]})")
    return geometry


def write_header(buf: np.ndarray, geometry: RingGeometry, fingerprint: str) -> None:
    """Fill a zeroed header (creator only, before anyone attaches)."""
    u32 = buf[:HEADER_BYTES].view(np.uint32)
    u64 = buf[:HEADER_BYTES].view(np.uint64)
    u32[HDR_VERSION // 4] = RING_VERSION
    u32[HDR_HEADER_BYTES // 4] = HEADER_BYTES
    for name in _GEOMETRY_FIELDS:
        u32[HEADER_FIELDS[name][0] // 4] = getattr(geometry, name)
    u32[HDR_REQUEST_BYTES // 4] = geometry.request_bytes
    u32[HDR_RESPONSE_BYTES // 4] = geometry.response_bytes
    u64[HDR_SQ_OFFSET // 8] = geometry.sq_offset
    u64[HDR_REQUESTS_OFFSET // 8] = geometry.requests_offset
    u64[HDR_RESPONSES_OFFSET // 8] = geometry.responses_offset
    u64[HDR_LOGIT_BIAS_OFFSET // 8] = geometry.logit_bias_offset
    u64[HDR_TOTAL_BYTES // 8] = geometry.total_bytes
    fp = fingerprint.encode("ascii")[:FINGERPRINT_BYTES].ljust(FINGERPRINT_BYTES, b"\0")
    buf[HDR_FINGERPRINT : HDR_FINGERPRINT + FINGERPRINT_BYTES] = np.frombuffer(fp, dtype=np.uint8)
    u64[HDR_MAGIC // 8] = RING_MAGIC  # last: a reader that sees the magic sees a whole header


def read_fingerprint(buf: np.ndarray) -> str:
    raw = bytes(buf[HDR_FINGERPRINT : HDR_FINGERPRINT + FINGERPRINT_BYTES])
    return raw.rstrip(b"\0").decode("ascii", "replace")
