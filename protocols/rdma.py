"""The `rdma` transport's producer: the gateway's end of a ring that lives in another host's memory.

`RdmaProducer` keeps a local mirror of the remote ring (same layout, same offsets) and runs the ordinary
`ShmProducer` logic on it; every word the producer writes goes out as an RDMA WRITE of the mirror's
bytes, and what it reads comes in by RDMA READ first. The ring's rules carry over (DESIGN.md,
"Transports"): the request payload is written, then the sequence word, on the same RC queue pair (so
in order); responses are read with one-sided READs; no WRITE_WITH_IMM and no receive queue, so the
backend host's CPU never sees a request. A READ that finds a finish reason reads the line again: the
engine wrote `produced` before `finish`, so the second READ sees the final count.

The verbs themselves are behind `RingLink` (`protocols/rdma_verbs.py` has the pyverbs one), which
lets the tests run this logic against a shared-memory ring where no RDMA device exists.

Status: the verbs path is written against the pyverbs API but has not run on hardware (no RDMA device
on the machines this was developed on); the mirror logic is tested with an in-memory link.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from . import ring as R
from .ring import ErrorCode, FinishReason, RequestSpec, RingGeometry
from .shm import ShmRing
from .messages import TokenUpdate
from .shm_producer import ShmProducer

RESP_LINE_BYTES = 64  # line 0 of a response slot: seq, produced, finish, times, prompt_len, error_code
HDR_ENGINE_LINE = (R.HDR_HEARTBEAT, 64)  # header line 2: heartbeat, state, stats


class RdmaLinkError(RuntimeError):
    """A work request failed (the remote side is gone or refused the access)."""


class RingLink(Protocol):
    """One-sided access to a remote ring through a registered local mirror of the same size."""

    geometry: RingGeometry
    mirror: ShmRing  # local memory the operations copy from and into, at the same offsets

    def write(self, offset: int, nbytes: int) -> None:
        """Post an RDMA WRITE of mirror[offset:offset+nbytes] to the remote ring (in posting order)."""

    def read(self, offset: int, nbytes: int) -> None:
        """RDMA READ remote[offset:offset+nbytes] into the mirror; returns once it has landed."""

    def flush(self) -> None:
        """Wait until every posted WRITE has completed; raises RdmaLinkError on a failed one."""

    def close(self) -> None: ...


class RdmaProducer:
    masks_from_any_thread = False  # its queue pair is the event loop's
    """Ring producer over one-sided RDMA; the interface `gateway.backends.backend.Backend` uses."""

    def __init__(self, link: RingLink):
        self.link = link
        self.geometry = link.geometry
        self.ring = link.mirror
        link.read(0, self.geometry.total_bytes)  # the whole ring once: adopt what an earlier producer left
        self._local = ShmProducer(self.ring)
        self.error = ""
        for slot in self._local.unfinished_slots():  # adopted: their cancel words are set in the mirror
            link.write(self.ring.req(slot) + R.REQ_CANCEL_SEQ, 8)
        link.flush()

    # ---------------------------------------------------------------- state
    @property
    def connected(self) -> bool:
        return not self.error

    @property
    def free_slots(self) -> int:
        return self._local.free_slots if self.connected else 0

    @property
    def in_flight(self) -> int:
        return self._local.in_flight

    @property
    def heartbeat(self) -> int:
        self._io(self.link.read, *HDR_ENGINE_LINE)  # a lost link leaves the last value: the stall check fires
        return self.ring.heartbeat

    @property
    def engine_state(self) -> R.EngineState:
        return self.ring.engine_state   # header line 2, refreshed by the heartbeat read

    def engine_stats(self) -> dict[str, int]:
        return self.ring.stats()

    # ---------------------------------------------------------------- producer interface
    def submit(self, spec: RequestSpec) -> int:
        """Payload, consumed counter, then the sequence word, the queue entry and the tail: in that order."""
        slot = self._local.submit(spec)
        base, g = self.ring.req(slot), self.geometry
        tail = self.ring.hdr_u64(R.HDR_SQ_TAIL)
        writes = [(base + 8, g.prompt_offset + 4 * len(spec.prompt_ids) - 8)]
        if spec.logit_bias:  # the slot's logit-bias area: ids, then biases
            n, bias = len(spec.logit_bias), self.ring.bias(slot)
            writes += [(bias, 4 * n), (bias + g.logit_bias_bytes // 2, 4 * n)]
        if spec.block_hashes:  # the slot's block-hash area (ring version 3)
            writes.append((self.ring.hashes(slot), 8 * len(spec.block_hashes)))
        if spec.token_mask is not None:  # mask 0, its words then mask_seq
            writes += self._mask_writes(slot)
        writes += [(self.ring.resp(slot) + R.RESP_CONSUMED, 4), (base + R.REQ_SEQ, 8),
                  (g.sq_offset + 4 * ((tail - 1) % g.num_slots), 4), (R.HDR_SQ_TAIL, 8)]
        self._io(self._write_all, writes)
        return slot

    def cancel(self, slot: int) -> None:
        self._local.cancel(slot)
        self._io(self._write_all, [(self.ring.req(slot) + R.REQ_CANCEL_SEQ, 8)])

    def put_mask(self, slot: int, token_index: int, words) -> None:
        """The words, then mask_seq, as two WRITEs on the one queue pair (delivered in that order)."""
        self._local.put_mask(slot, token_index, words)
        self._io(self._write_all, self._mask_writes(slot))

    def _mask_writes(self, slot: int) -> list[tuple[int, int]]:
        base, g = self.ring.mask(slot), self.geometry
        return [(base, 4 * g.mask_words), (base + g.mask_seq_offset, 4)]

    def ready_slots(self, slots: Sequence[int]) -> list[int]:
        """All of them: finding news takes an RDMA READ per slot, which `poll` does anyway."""
        return list(slots)

    def poll(self, slot: int) -> TokenUpdate:
        if not self.connected:
            return self._failed(slot)
        if not self._io(self._fetch, slot):
            return self._failed(slot)
        update = self._local.poll(slot)
        if update.tokens:
            self._io(self._write_all, [(self.ring.resp(slot) + R.RESP_CONSUMED, 4)])
        return update

    def release(self, slot: int) -> None:
        self._local.release(slot)

    def reclaim(self) -> list[int]:
        if self.connected:
            for slot in self._local.unfinished_slots():
                self._io(self.link.read, self.ring.resp(slot), RESP_LINE_BYTES)
        return self._local.reclaim()

    def close(self) -> None:
        self.link.close()

    # ---------------------------------------------------------------- internals
    def _fetch(self, slot: int) -> None:
        """Response line 0, again if it shows a finish, then the tokens not consumed yet."""
        resp = self.ring.resp(slot)
        self.link.read(resp, RESP_LINE_BYTES)
        if self.ring.u32[(resp + R.RESP_FINISH_REASON) // 4] != FinishReason.NONE:
            self.link.read(resp, RESP_LINE_BYTES)
        produced = int(self.ring.u32[(resp + R.RESP_PRODUCED) // 4])
        consumed = int(self.ring.u32[(resp + R.RESP_CONSUMED) // 4])
        cap, tokens = self.geometry.max_output_len, resp + R.RESP_TOKENS
        if produced > consumed:
            first, count = consumed % cap, produced - consumed
            head = min(count, cap - first)
            self.link.read(tokens + 4 * first, 4 * head)
            if count > head:  # wrapped around the output buffer
                self.link.read(tokens, 4 * (count - head))
            if self._local.wants_logprobs(slot):  # the whole area: a few KB, less bookkeeping than ranges
                self.link.read(self.ring.logprobs(slot), self.geometry.logprob_bytes)

    def _write_all(self, writes: list[tuple[int, int]]) -> None:
        for offset, nbytes in writes:
            self.link.write(offset, nbytes)
        self.link.flush()

    def _io(self, fn, *args) -> bool:
        """Run one link operation; a failure marks the link lost and fails every request on it."""
        if not self.connected:
            return False
        try:
            fn(*args)
            return True
        except RdmaLinkError as exc:
            self.error = f"lost the rdma link to the backend ({exc})"
            return False

    def _failed(self, slot: int) -> TokenUpdate:
        self._local.give_up(slot)
        return TokenUpdate(finish=FinishReason.ERROR, error=self.error, error_code=ErrorCode.INTERNAL)
