"""The engine's end of a shared-memory ring (protocols/shm.py), for the CPU and host engines (the GPU loop
implements the same in CUDA): `RingConsumer` takes new requests, publishes tokens and finishes them; it
writes only the consumer's words.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from protocols import ring as R
from protocols.ring import ErrorCode, FinishReason, RequestSpec, TokenLogprob
from protocols.shm import RingFull, ShmRing


@dataclass(frozen=True)
class TakenRequest:
    slot: int
    seq: int
    spec: RequestSpec


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
        """Every request queued since the last call, in submission order; resets their response areas."""
        tail = self.ring.hdr_u64(R.HDR_SQ_TAIL)
        taken = []
        while self._head < tail:
            slot = int(self.ring.u32[(self.geometry.sq_offset + 4 * (self._head % self.geometry.num_slots)) // 4])
            self._head += 1
            taken.append(self._take(slot))
        self.ring.u64[R.HDR_SQ_HEAD // 8] = self._head
        return taken

    def _take(self, slot: int) -> TakenRequest:
        ring, base = self.ring, self.ring.req(slot)
        seq = int(ring.u64[base // 8])
        n_prompt = min(int(ring.u32[(base + R.REQ_PROMPT_LEN) // 4]), self.geometry.max_prompt_len)
        n_stop = min(int(ring.u32[(base + R.REQ_NUM_STOP_IDS) // 4]), self.geometry.max_stop_ids)
        flags = int(ring.u32[(base + R.REQ_FLAGS) // 4])
        n_bias = min(int(ring.u32[(base + R.REQ_NUM_LOGIT_BIAS) // 4]), self.geometry.max_logit_bias)
        b0 = ring.bias(slot) // 4
        v0 = (ring.bias(slot) + self.geometry.logit_bias_bytes // 2) // 4  # ids, then biases
        p0, s0 = (base + self.geometry.prompt_offset) // 4, (base + R.REQ_STOP_IDS) // 4
        spec = RequestSpec(
            request_id=int(ring.u64[(base + R.REQ_REQUEST_ID) // 8]),
            prompt_ids=ring.i32[p0 : p0 + n_prompt].tolist(),
            max_tokens=int(ring.u32[(base + R.REQ_MAX_TOKENS) // 4]),
            temperature=float(ring.f32[(base + R.REQ_TEMPERATURE) // 4]),
            top_p=float(ring.f32[(base + R.REQ_TOP_P) // 4]),
            top_k=int(ring.i32[(base + R.REQ_TOP_K) // 4]),
            min_p=float(ring.f32[(base + R.REQ_MIN_P) // 4]),
            seed=int(ring.u64[(base + R.REQ_SEED) // 8]) if flags & R.FLAG_HAS_SEED else None,
            stop_ids=tuple(ring.i32[s0 : s0 + n_stop].tolist()),
            ignore_eos=bool(flags & R.FLAG_IGNORE_EOS),
            priority=int(ring.u32[(base + R.REQ_PRIORITY) // 4]),
            presence_penalty=float(ring.f32[(base + R.REQ_PRESENCE_PENALTY) // 4]),
            frequency_penalty=float(ring.f32[(base + R.REQ_FREQUENCY_PENALTY) // 4]),
            repetition_penalty=float(ring.f32[(base + R.REQ_REPETITION_PENALTY) // 4]),
            logit_bias=tuple(zip(ring.i32[b0 : b0 + n_bias].tolist(), ring.f32[v0 : v0 + n_bias].tolist())),
            num_logprobs=min(int(ring.u32[(base + R.REQ_NUM_LOGPROBS) // 4]), self.geometry.max_logprobs)
            if flags & R.FLAG_LOGPROBS else None,
        )
        self._reset_response(slot, seq, n_prompt)
        self._capacity[slot] = self.geometry.logprob_window if spec.num_logprobs is not None \
            else self.geometry.max_output_len
        return TakenRequest(slot=slot, seq=seq, spec=spec)

    def _reset_response(self, slot: int, seq: int, prompt_len: int) -> None:
        ring, base = self.ring, self.ring.resp(slot)
        ring.u32[(base + R.RESP_PRODUCED) // 4] = 0
        ring.u32[(base + R.RESP_FINISH_REASON) // 4] = FinishReason.NONE
        ring.u32[(base + R.RESP_ERROR_CODE) // 4] = ErrorCode.NONE
        ring.u32[(base + R.RESP_PROMPT_LEN) // 4] = prompt_len
        ring.u64[(base + R.RESP_FIRST_TOKEN_NS) // 8] = 0
        ring.u64[(base + R.RESP_LAST_TOKEN_NS) // 8] = 0
        ring.u64[(base + R.RESP_SEQ) // 8] = seq  # last: the counters above now belong to `seq`
        self._produced[slot] = 0

    def cancelled(self, slot: int, seq: int) -> bool:
        return int(self.ring.u64[(self.ring.req(slot) + R.REQ_CANCEL_SEQ) // 8]) == seq

    def room(self, slot: int) -> int:
        """Tokens that may be published now without overwriting unread ones."""
        consumed = int(self.ring.u32[(self.ring.resp(slot) + R.RESP_CONSUMED) // 4])
        return self._capacity[slot] - (self._produced[slot] - consumed)

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
        ring, base, cap = self.ring, self.ring.resp(slot), self.geometry.max_output_len
        u32, u64, i32 = ring.u32, ring.u64, ring.i32
        produced = self._produced[slot]
        room = self._capacity[slot] - (produced - int(u32[(base + R.RESP_CONSUMED) // 4]))
        if n > room:
            raise RingFull(f"slot {slot}: {n} tokens but room for {room}")
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

    def finish(self, slot: int, reason: FinishReason, error: ErrorCode = ErrorCode.NONE) -> None:
        """Last word on a slot: after this the engine never touches it again."""
        base = self.ring.resp(slot)
        self.ring.u32[(base + R.RESP_ERROR_CODE) // 4] = error
        self.ring.u32[(base + R.RESP_FINISH_REASON) // 4] = reason
        self._produced.pop(slot, None)
        self._capacity.pop(slot, None)

    def beat(self) -> None:
        self._beats += 1
        self.ring.u64[R.HDR_HEARTBEAT // 8] = self._beats

    def set_state(self, state: R.EngineState) -> None:
        self.ring.u32[R.HDR_ENGINE_STATE // 4] = state

    def set_stats(self, free_kv_blocks: int, total_kv_blocks: int, running: int, waiting: int) -> None:
        u32 = self.ring.u32
        u32[R.HDR_FREE_KV_BLOCKS // 4] = free_kv_blocks
        u32[R.HDR_TOTAL_KV_BLOCKS // 4] = total_kv_blocks
        u32[R.HDR_RUNNING // 4] = running
        u32[R.HDR_WAITING // 4] = waiting
