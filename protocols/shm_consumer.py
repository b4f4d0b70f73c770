"""The engine's end of a shared-memory ring (protocols/shm.py), for the CPU and host engines (the GPU loop
implements the same in CUDA): `RingConsumer` takes new requests, publishes tokens and finishes them; it
writes only the consumer's words.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocols import ring as R
from protocols.ring import ErrorCode, FinishReason, RequestSpec, TokenLogprob
from protocols.shm import RingFull, ShmRing

log = logging.getLogger("blink.engine")


@dataclass(frozen=True)
class TakenRequest:
    """A request as the engine read it: `words`, its slot's fixed part (blink_request_slot, REQ_STOP_IDS bytes),
    read once; `spec`, built from those words and the slot's arrays, each clipped to the geometry. Nothing
    here is checked: the engine's admission (kernels/csrc/include/blink_admit.h) decides on both."""

    slot: int
    seq: int
    spec: RequestSpec
    words: bytes


class RingConsumer:
    """The engine's end of a ring (CPU and host engines; the GPU loop implements the same in CUDA)."""

    def __init__(self, ring: ShmRing):
        self.ring = ring
        self.geometry = ring.geometry
        self._head = ring.hdr_u64(R.HDR_SQ_HEAD)
        self._produced: dict[int, int] = {}
        self._capacity: dict[int, int] = {}  # tokens a slot may run ahead: smaller for logprob requests
        self._beats = ring.heartbeat

    def take_new(self) -> list[TakenRequest]:
        """Every request queued since the last call, in submission order; resets their response areas.

        The queue's words come from the producer, maybe another machine: entries older than `num_slots` behind
        the tail were overwritten (at most one lap is read), and an entry naming no slot is skipped with a
        warning (it has no response area to report an error in)."""
        tail, num_slots = self.ring.hdr_u64(R.HDR_SQ_TAIL), self.geometry.num_slots
        if tail - self._head > num_slots:
            log.warning("submission queue tail %d is %d entries ahead of head %d; only the last %d are read",
                        tail, tail - self._head, self._head, num_slots)
            self._head = tail - num_slots
        taken = []
        while self._head < tail:
            slot = int(self.ring.u32[(self.geometry.sq_offset + 4 * (self._head % num_slots)) // 4])
            self._head += 1
            if slot >= num_slots:
                log.warning("submission queue entry names slot %d of %d slots; skipped", slot, num_slots)
                continue
            taken.append(self._take(slot))
        self.ring.u64[R.HDR_SQ_HEAD // 8] = self._head
        return taken

    def _take(self, slot: int) -> TakenRequest:
        ring, g = self.ring, self.geometry
        words = ring.buf[ring.req(slot) : ring.req(slot) + R.REQ_STOP_IDS].tobytes()  # each word read once
        seq = int.from_bytes(words[:8], "little")
        head = R.REQUEST_HEAD.unpack_from(words, R.REQ_REQUEST_ID)
        n = dict(zip(R.REQUEST_HEAD_NAMES, head))
        n_prompt, n_stop = min(n["prompt_len"], g.max_prompt_len), min(n["num_stop_ids"], g.max_stop_ids)
        n_bias = min(n["num_logit_bias"], g.max_logit_bias)
        b0 = ring.bias(slot) // 4
        v0 = (ring.bias(slot) + g.logit_bias_bytes // 2) // 4  # ids, then biases
        p0, s0 = (ring.req(slot) + g.prompt_offset) // 4, (ring.req(slot) + R.REQ_STOP_IDS) // 4
        constrained = n["flags"] & R.FLAG_CONSTRAINED and g.mask_words
        mask0 = bytes(ring.buf[ring.mask(slot) : ring.mask(slot) + 4 * g.mask_words]) if constrained else None
        spec = R.spec_from_head(
            head, ring.i32[p0 : p0 + n_prompt].tolist(), ring.i32[s0 : s0 + n_stop].tolist(),
            zip(ring.i32[b0 : b0 + n_bias].tolist(), ring.f32[v0 : v0 + n_bias].tolist()), g.max_logprobs,
            self._hashes(slot, n["num_block_hashes"], n_prompt), mask0)
        self._reset_response(slot, seq, n_prompt)
        self._capacity[slot] = g.logprob_window if spec.num_logprobs is not None else g.max_output_len
        return TakenRequest(slot=slot, seq=seq, spec=spec, words=words)

    def _hashes(self, slot: int, count: int, prompt_len: int) -> list[int]:
        """The slot's block hashes, clipped to its area and to the prompt's full blocks (the engine's admission
        checks the count); a zero hash ends them (the engine's table uses 0 for "none")."""
        n = min(count, self.geometry.max_hashes_for(prompt_len))
        h0 = self.ring.hashes(slot) // 8
        hashes = self.ring.u64[h0 : h0 + n].tolist()
        return hashes[: hashes.index(0)] if 0 in hashes else hashes

    def _reset_response(self, slot: int, seq: int, prompt_len: int) -> None:
        resp = self.ring.response_fields(slot)
        resp["produced"] = 0
        resp["finish_reason"] = FinishReason.NONE
        resp["error_code"] = ErrorCode.NONE
        resp["prompt_len"] = prompt_len
        resp["cached_tokens"] = 0
        resp["first_token_ns"] = resp["last_token_ns"] = 0
        resp["seq"] = seq  # last: the counters above now belong to `seq`
        self._produced[slot] = 0

    def cancelled(self, slot: int, seq: int) -> bool:
        # per running sequence per step: a word at the generated offset, not a view
        return int(self.ring.u64[(self.ring.req(slot) + R.REQ_CANCEL_SEQ) // 8]) == seq

    def mask(self, slot: int, token_index: int) -> np.ndarray | None:
        """The slot's mask for generated token `token_index` ([mask_words] uint32, a copy), or None while the
        gateway has not written it (mask_seq != token_index + 1). Only for a constrained request."""
        base = self.ring.mask(slot)
        if int(self.ring.u32[(base + self.geometry.mask_seq_offset) // 4]) != token_index + 1:
            return None  # mask_seq first: the words are read only after it validated them
        return self.ring.u32[base // 4 : base // 4 + self.geometry.mask_words].copy()

    def room(self, slot: int) -> int:
        """Tokens that may be published now without overwriting unread ones, in 0..capacity (a `consumed` word
        past `produced` is the producer's error: it never buys more room than the buffer holds)."""
        consumed = int(self.ring.u32[(self.ring.resp(slot) + R.RESP_CONSUMED) // 4])
        return max(0, min(self._capacity[slot], self._capacity[slot] - (self._produced[slot] - consumed)))

    def publish(self, slot: int, tokens: list[int], now_ns: int | None = None,
                logprobs: Sequence[TokenLogprob] | None = None) -> None:
        """Append tokens (caller checked `room`) and, for a logprobs request, their logprobs; then
        advance `produced`.

        Scalar stores, not fancy indexing: this runs once per sequence per step, and at a few hundred
        sequences numpy's per-call set-up would cost more than the stores themselves.
        """
        n = len(tokens)
        if not n:
            return
        room = self.room(slot)
        if n > room:
            raise RingFull(f"slot {slot}: {n} tokens but room for {room}")
        ring, base, cap = self.ring, self.ring.resp(slot), self.geometry.max_output_len
        u32, u64, i32 = ring.u32, ring.u64, ring.i32
        produced = self._produced[slot]
        t0 = (base + R.RESP_TOKENS) // 4
        for k, token in enumerate(tokens):
            i32[t0 + (produced + k) % cap] = token
        for k, entry in enumerate(logprobs or ()):
            self._write_logprob(slot, produced + k, entry)
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if produced == 0:
            u64[(base + R.RESP_FIRST_TOKEN_NS) // 8] = now_ns
        u64[(base + R.RESP_LAST_TOKEN_NS) // 8] = now_ns
        self._produced[slot] = produced + n
        u32[(base + R.RESP_PRODUCED) // 4] = produced + n
        u64[R.HDR_GENERATED_TOKENS // 8] += n  # engine is this word's only writer

    def _write_logprob(self, slot: int, index: int, entry: TokenLogprob) -> None:
        chosen, ids0, lps0 = self.ring.logprob_words(slot, index, self.geometry.max_logprobs)
        self.ring.f32[chosen] = entry.logprob
        for j, (token, logprob) in enumerate(entry.top[:self.geometry.max_logprobs]):
            self.ring.i32[ids0 + j] = token
            self.ring.f32[lps0 + j] = logprob

    def set_cached_tokens(self, slot: int, cached_tokens: int) -> None:
        """Prompt tokens the prefix cache supplied; written before the slot's first token is published."""
        self.ring.u32[(self.ring.resp(slot) + R.RESP_CACHED_TOKENS) // 4] = cached_tokens

    def finish(self, slot: int, reason: FinishReason, error: ErrorCode = ErrorCode.NONE) -> None:
        """Last word on a slot: after this the engine never touches it again."""
        resp = self.ring.response_fields(slot)
        resp["error_code"] = error
        resp["finish_reason"] = reason
        self._produced.pop(slot, None)
        self._capacity.pop(slot, None)

    def beat(self) -> None:
        self._beats += 1
        self.ring.u64[R.HDR_HEARTBEAT // 8] = self._beats  # every iteration: a word, not a view

    def set_state(self, state: R.EngineState) -> None:
        self.ring.header["engine_state"] = state

    def set_stats(self, free_kv_blocks: int, total_kv_blocks: int, running: int, waiting: int,
                  prefix_cache: tuple[int, int, int] = (0, 0, 0)) -> None:
        """`prefix_cache`: (cached_kv_blocks, prefix_cache_queries, prefix_cache_hits), the last two in tokens."""
        hdr = self.ring.header
        hdr["free_kv_blocks"], hdr["total_kv_blocks"] = free_kv_blocks, total_kv_blocks
        hdr["running"], hdr["waiting"] = running, waiting
        hdr["cached_kv_blocks"], hdr["prefix_cache_queries"], hdr["prefix_cache_hits"] = prefix_cache
