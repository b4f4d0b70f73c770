"""The gateway's end of a shared-memory ring (protocols/shm.py): `ShmProducer` submits requests,
cancels them, polls new tokens (`TokenUpdate`) and releases slots; it writes only the producer's words.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocols import ring as R
from protocols.messages import TokenUpdate
from protocols.ring import ErrorCode, FinishReason, RequestSpec, TokenLogprob
from protocols.shm import RingFull, ShmRing, SqLock


_FINISH_REASONS = {int(f): f for f in FinishReason}
_NO_ERROR = ErrorCode.NONE
# u32 word offsets within a slot's response, for `ShmProducer.poll`
_W_FINISH, _W_PRODUCED, _W_CONSUMED = R.RESP_FINISH_REASON // 4, R.RESP_PRODUCED // 4, R.RESP_CONSUMED // 4
_W_PROMPT_LEN, _W_ERROR_CODE, _W_TOKENS = R.RESP_PROMPT_LEN // 4, R.RESP_ERROR_CODE // 4, R.RESP_TOKENS // 4
_W_CACHED = R.RESP_CACHED_TOKENS // 4


@dataclass(slots=True)
class _Outstanding:
    seq: int
    consumed: int = 0
    finished: bool = False
    num_logprobs: int | None = None


def pop_finished(active: dict, slot: int):
    """A producer's release: the outstanding slot's state, removed from `active`; a slot that is not
    outstanding or still running is the caller's bug (KeyError, RuntimeError)."""
    state = active.get(slot)
    if state is None:
        raise KeyError(f"slot {slot} is not outstanding")
    if not state.finished:
        raise RuntimeError(f"slot {slot} is still running: cancel it and poll until it finishes")
    del active[slot]
    return state


class ShmProducer:
    masks_from_any_thread = True  # put_mask writes the slot's own mask area, nothing shared (producer.py)
    """The gateway's end of a ring. Not thread-safe: use it from one thread (the event loop).

    With `defer_consumed`, `poll` does not advance the ring's consumed counter; `set_consumed` does,
    when the real reader says so (the tcp agent forwards tokens and waits for the gateway's count).
    """

    def __init__(self, ring: ShmRing, defer_consumed: bool = False, slots: Sequence[int] | None = None,
                 sq_lock: SqLock | None = None):
        """`slots`: the slots this producer owns (default all); several producers on one ring (gateway
        workers) own disjoint sets and share `sq_lock`, which serializes writes of the submission queue."""
        self.ring = ring
        self.defer_consumed = defer_consumed
        self.geometry = ring.geometry
        self._sq_lock = sq_lock
        self._tail = ring.hdr_u64(R.HDR_SQ_TAIL)
        self._active: dict[int, _Outstanding] = {}
        self._free: deque[int] = deque()
        # Word indices of each slot's response counters, for `ready_slots`' one vectorized read.
        words = self.geometry.responses_offset // 4 + np.arange(self.geometry.num_slots) * (self.geometry.response_bytes // 4)
        self._produced_w = words + R.RESP_PRODUCED // 4  # [num_slots] int64
        self._finish_w = words + R.RESP_FINISH_REASON // 4
        self._consumed_w = words + R.RESP_CONSUMED // 4
        self._resp_w0, self._resp_words = self.geometry.responses_offset // 4, self.geometry.response_bytes // 4
        self._ready_of: Sequence[int] | None = None  # the last `ready_slots` list, and its slots as an array
        self._ready_idx = np.zeros(0, dtype=np.int64)
        self._ready_w = (self._ready_idx,) * 3  # and their produced, consumed and finish words
        self._u32, self._u64, self._i32 = memoryview(ring.u32), memoryview(ring.u64), memoryview(ring.i32)
        self._bytes = memoryview(ring.buf)
        for slot in (range(self.geometry.num_slots) if slots is None else slots):
            self._adopt(slot)

    def _adopt(self, slot: int) -> None:
        """On attach, a slot an earlier producer left unfinished is cancelled and reclaimed later."""
        req = self.ring.request_fields(slot)
        seq = int(req["seq"])
        if seq == 0 or self._finished_seq(slot) == seq:
            self._free.append(slot)
            return
        self._active[slot] = _Outstanding(seq=seq, consumed=0)
        req["cancel_seq"] = seq

    def _finished_seq(self, slot: int) -> int:
        resp = self.ring.response_fields(slot)
        return 0 if resp["finish_reason"] == FinishReason.NONE else int(resp["seq"])

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def connected(self) -> bool:
        """Always: shared memory does not disconnect (the tcp producer's counterpart can)."""
        return True

    @property
    def heartbeat(self) -> int:
        return self.ring.heartbeat

    @property
    def engine_state(self) -> R.EngineState:
        return self.ring.engine_state

    def engine_stats(self) -> dict[str, int]:
        """The engine's header words: KV blocks, running and waiting sequences, tokens."""
        return self.ring.stats()

    def submit(self, spec: RequestSpec, slot: int | None = None) -> int:
        """Write a request into a free slot (or the given free one) and queue it.

        Raises RingFull, or ValueError for a bad spec or a `slot` that is not free."""
        spec.validate(self.geometry)
        if not self._free:
            raise RingFull(f"all {self.geometry.num_slots} ring slots are in use")
        if slot is None:
            slot = self._free.popleft()
        elif slot in self._free:
            self._free.remove(slot)
        else:
            raise ValueError(f"slot {slot} is not free")
        if self._sq_lock is None:
            seq = self._queue(slot, spec)
        else:
            with self._sq_lock:  # another producer may have moved the tail: read it afresh
                self._tail = self.ring.hdr_u64(R.HDR_SQ_TAIL)
                seq = self._queue(slot, spec)
        self._active[slot] = _Outstanding(seq=seq, num_logprobs=spec.num_logprobs)
        return slot

    def _queue(self, slot: int, spec: RequestSpec) -> int:
        # Words through memoryviews (a numpy scalar write costs several times as much), in this order:
        # the payload, then its seq (which validates it), then the queue entry, then the tail (publishes it).
        seq = self._tail + 1
        self._write_request(slot, spec)
        self._u32[(self.ring.resp(slot) + R.RESP_CONSUMED) // 4] = 0
        self._u64[self.ring.req(slot) // 8] = seq  # validates the payload
        self._u32[(self.geometry.sq_offset + 4 * (self._tail % self.geometry.num_slots)) // 4] = slot
        self._tail += 1
        self._u64[R.HDR_SQ_TAIL // 8] = self._tail  # publishes the queue entry
        return seq

    def _write_request(self, slot: int, spec: RequestSpec) -> None:
        ring, base = self.ring, self.ring.req(slot)
        R.REQUEST_HEAD.pack_into(self._bytes, base + R.REQ_REQUEST_ID, *R.request_head(spec))  # one write
        if spec.logit_bias:
            ids0, n = ring.bias(slot) // 4, len(spec.logit_bias)
            vals0 = (ring.bias(slot) + self.geometry.logit_bias_bytes // 2) // 4  # ids, then biases
            ring.i32[ids0 : ids0 + n] = [t for t, _ in spec.logit_bias]
            ring.f32[vals0 : vals0 + n] = [b for _, b in spec.logit_bias]
        if spec.block_hashes:
            h0 = ring.hashes(slot) // 8
            ring.u64[h0 : h0 + len(spec.block_hashes)] = np.asarray(spec.block_hashes, dtype=np.uint64)
        stop0 = (base + R.REQ_STOP_IDS) // 4
        ring.i32[stop0 : stop0 + len(spec.stop_ids)] = spec.stop_ids
        p0 = (base + self.geometry.prompt_offset) // 4
        ring.i32[p0 : p0 + len(spec.prompt_ids)] = np.asarray(spec.prompt_ids, dtype=np.int32)
        if spec.token_mask is not None:
            self._write_mask(slot, 0, spec.token_mask)  # before the request's seq

    def _write_mask(self, slot: int, token_index: int, words: bytes) -> None:
        """The words, then mask_seq = token_index + 1 (the word that validates them, stored last)."""
        base = self.ring.mask(slot)
        self._bytes[base : base + len(words)] = words
        self._u32[(base + self.geometry.mask_seq_offset) // 4] = token_index + 1

    def put_mask(self, slot: int, token_index: int, words: np.ndarray | bytes) -> None:
        """The allowed tokens of the slot's generated token `token_index` (u32 words as RequestSpec.token_mask).
        Write mask i + 1 only after reading token i: the slot holds one mask, which the engine may be reading
        until it publishes token i. Ignored once the request finished; ValueError for a bad mask or index."""
        out = self._active.get(slot)
        if out is None:
            raise KeyError(f"slot {slot} is not outstanding")
        words = R.put_mask_words(words, token_index, self.geometry)
        if not out.finished:
            self._write_mask(slot, token_index, words)

    def wants_logprobs(self, slot: int) -> bool:
        out = self._active.get(slot)
        return out is not None and out.num_logprobs is not None

    def cancel(self, slot: int) -> None:
        """Ask the engine to stop this request; it still reports a finish, after which `release`."""
        out = self._active.get(slot)
        if out is not None and not out.finished:
            self.ring.request_fields(slot)["cancel_seq"] = out.seq

    def poll(self, slot: int) -> TokenUpdate:
        """Tokens the engine produced since the last poll; frees their room in the output buffer."""
        out = self._active[slot]
        # Python-int reads through memoryviews at precomputed word offsets: a poll per token per stream is
        # the gateway's hot path, and a numpy scalar read costs several times a memoryview's.
        u32, w = self._u32, self._resp_w0 + slot * self._resp_words  # w: the response's first u32 word
        if self._u64[w >> 1] != out.seq:
            return TokenUpdate()  # not taken by the engine yet
        value = u32[w + _W_FINISH]  # before `produced`
        finish = _FINISH_REASONS.get(value)
        if finish is None:
            finish = FinishReason(value)  # raises for a word no FinishReason names
        produced = u32[w + _W_PRODUCED]
        consumed = out.consumed
        if produced > consumed:
            cap = self.geometry.max_output_len
            first = consumed % cap
            if first + produced - consumed <= cap:  # no wrap: one slice
                tokens = self._i32[w + _W_TOKENS + first : w + _W_TOKENS + first + produced - consumed].tolist()
            else:
                tokens = self._tokens(w + _W_TOKENS, consumed, produced)
            # positional: half the cost of keywords, once per update
            update = TokenUpdate(tokens, [], finish, "", _NO_ERROR, u32[w + _W_PROMPT_LEN], True, u32[w + _W_CACHED])
            if out.num_logprobs is not None:
                update.logprobs = [self._logprob(slot, i, out.num_logprobs) for i in range(consumed, produced)]
            out.consumed = produced
            if not self.defer_consumed:
                u32[w + _W_CONSUMED] = produced
        else:
            update = TokenUpdate(finish=finish, started=True, prompt_len=u32[w + _W_PROMPT_LEN],
                                 cached_tokens=u32[w + _W_CACHED])
        if finish:  # FinishReason.NONE is 0
            out.finished = True
            if finish == FinishReason.ERROR:
                update.error_code = ErrorCode(u32[w + _W_ERROR_CODE])
                update.error = update.error_code.message
        else:
            out.finished = False
        return update

    def peek_tokens(self, slot: int, seq: int, start: int) -> list[int] | None:
        """Read-only, from any thread: request `seq`'s generated tokens from index `start` up to what the engine
        has produced ([] if none yet), without consuming them (`poll` stays the one reader that advances the
        ring's consumed counter); None while the slot holds another request, or `start` is no longer in the
        buffer. The response's seq is read before and after the tokens: a slot reused meanwhile reads as None.
        A constrained request's mask thread reads its tokens here (gateway/structured/mask_watch.py)."""
        u32, u64, w = self._u32, self._u64, self._resp_w0 + slot * self._resp_words
        if u64[w >> 1] != seq:
            return None
        produced, cap = u32[w + _W_PRODUCED], self.geometry.max_output_len
        if produced <= start:
            return []
        if produced - start > cap:
            return None
        first, t0 = start % cap, w + _W_TOKENS
        if first + produced - start <= cap:
            tokens = self._i32[t0 + first : t0 + first + produced - start].tolist()
        else:  # wraps: the end of the buffer, then its start
            tokens = self._i32[t0 + first : t0 + cap].tolist() + self._i32[t0 : t0 + (produced % cap)].tolist()
        return tokens if u64[w >> 1] == seq else None

    def response_view(self, slot: int) -> np.ndarray:
        """The slot's response area as a uint8 view, to be read only (its words are the engine's): for a reader
        in native code (the gateway's mask watcher); holding it keeps the ring mapped (ShmRing.close)."""
        base = self.ring.resp(slot)
        return self.ring.buf[base : base + self.geometry.response_bytes]

    def _tokens(self, t0: int, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of a response whose token words begin at word `t0` (a circular buffer)."""
        cap = self.geometry.max_output_len
        first, last = start % cap, (stop - 1) % cap
        if first <= last and stop - start <= cap:
            return self._i32[t0 + first : t0 + last + 1].tolist()
        return self.ring.i32[t0 + np.arange(start, stop) % cap].tolist()

    def _logprob(self, slot: int, index: int, num_top: int) -> TokenLogprob:
        chosen, ids0, lps0 = self.ring.logprob_words(slot, index, self.geometry.max_logprobs)
        ids = self.ring.i32[ids0 : ids0 + num_top].tolist()
        lps = self.ring.f32[lps0 : lps0 + num_top].tolist()
        return TokenLogprob(float(self.ring.f32[chosen]), tuple(zip(ids, lps)))

    def ready_slots(self, slots: Sequence[int]) -> list[int]:
        """Those of `slots` whose response may hold news (tokens not consumed yet, or a finish): the
        ones worth a `poll`. Three vectorized reads, so a poller's cost per round grows with the tokens
        that arrived rather than with the slots in flight. False positives (a slot the engine has not
        taken yet, or `defer_consumed`) cost one empty `poll`; nothing new is ever missed. A list passed
        again (the same object) is taken to hold the same slots: pass a new one when they change."""
        if slots is not self._ready_of:  # a poller passes the same list while its requests stay the same
            idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
            self._ready_of, self._ready_idx = slots, idx
            self._ready_w = (self._produced_w[idx], self._consumed_w[idx], self._finish_w[idx])
        (produced_w, consumed_w, finish_w), u32 = self._ready_w, self.ring.u32
        news = (u32[produced_w] != u32[consumed_w]) | (u32[finish_w] != 0)  # FinishReason.NONE is 0
        return self._ready_idx[news].tolist()

    def position(self, slot: int) -> tuple[int, int]:
        """(the outstanding request's seq, tokens `poll` has read of it): where another reader of the
        responses takes over (the gateway's native round, `gateway/streaming/stream_round.py`)."""
        out = self._active[slot]
        return out.seq, out.consumed

    def resume_at(self, slot: int, consumed: int) -> None:
        """That other reader read up to `consumed` (and advanced the ring's counter): `poll` goes on from there."""
        self._active[slot].consumed = consumed

    def set_consumed(self, slot: int, consumed: int) -> None:
        """Advance the slot's consumed counter (with `defer_consumed`) up to what `poll` has read."""
        out = self._active.get(slot)
        if out is not None and not out.finished:
            self.ring.u32[(self.ring.resp(slot) + R.RESP_CONSUMED) // 4] = min(consumed, out.consumed)

    def token_times_ns(self, slot: int) -> tuple[int, int]:
        """Engine timestamps (first token, last token) of the slot's current request."""
        resp = self.ring.response_fields(slot)
        return int(resp["first_token_ns"]), int(resp["last_token_ns"])

    def release(self, slot: int) -> None:
        """Return a finished slot to the free list. Releasing an unfinished slot is a bug.

        It goes to the front: the next submission takes it (last out, first in), so the slots in use stay
        few and together in the ring however many requests come and go, and the poller's reads of their
        words stay in memory it touched recently (taken first in, first out, the slots in use spread over
        the whole ring within seconds, and its reads cost more and more: bench/RESULTS.md)."""
        pop_finished(self._active, slot)
        self._free.appendleft(slot)

    def reclaim(self) -> list[int]:
        """Release adopted or abandoned slots whose finish has arrived; returns them."""
        if self._active:  # one vectorized read finds the slots with a finish (a scalar read each took 10 us)
            idx = np.fromiter(self._active, dtype=np.int64, count=len(self._active))
            for slot in idx[self.ring.u32[self._finish_w[idx]] != FinishReason.NONE].tolist():
                out = self._active[slot]
                if not out.finished and self._finished_seq(slot) == out.seq:
                    out.finished = True
        return [slot for slot, out in self._active.items() if out.finished]

    def unfinished_slots(self) -> list[int]:
        """Outstanding slots whose finish has not been seen yet."""
        return [slot for slot, out in self._active.items() if not out.finished]

    def give_up(self, slot: int) -> None:
        """Treat an unfinished slot as finished (its transport is gone); it can then be released."""
        if slot in self._active:
            self._active[slot].finished = True

    def close(self) -> None:
        for view in (self._u32, self._u64, self._i32, self._bytes):
            view.release()  # views of the mapping: the ring can only unmap without them
        self.ring.close()
