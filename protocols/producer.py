"""The producer end of a ring, whatever the transport: the interface the gateway's backends use.

Three implement it: `shm_producer.ShmProducer` (the ring in this host's shared memory), `rdma.RdmaProducer`
(in another host's memory, by one-sided RDMA) and the gateway's `TcpProducer` (through a `blink agent` on the
backend host). Nothing above a producer depends on which one it has."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from protocols.messages import TokenUpdate
from protocols.ring import EngineState, RequestSpec


@runtime_checkable
class RingProducer(Protocol):
    """Submits requests into ring slots and reads their responses. Not thread-safe: one event loop uses it."""

    # put_mask may also be called from another thread (only for a slot whose request this thread's caller
    # keeps from finishing meanwhile): true where it is a plain write of the slot's own mask area (shm)
    masks_from_any_thread: bool

    @property
    def connected(self) -> bool:
        """False while the transport is down (submissions then raise `RingFull`)."""

    @property
    def free_slots(self) -> int:
        """Slots a `submit` can take now."""

    @property
    def heartbeat(self) -> int:
        """The engine's heartbeat (moves with every loop iteration)."""

    @property
    def engine_state(self) -> EngineState: ...

    def engine_stats(self) -> dict[str, int]:
        """What the engine last wrote into the ring header: KV blocks, running and waiting sequences."""

    def submit(self, spec: RequestSpec) -> int:
        """Write `spec` into a free slot and queue it; returns the slot. Raises `shm.RingFull` when none is free."""

    def cancel(self, slot: int) -> None:
        """Ask the engine to stop the slot's request; it reports a finish like any other."""

    def put_mask(self, slot: int, token_index: int, words) -> None:
        """The allowed tokens of generated token `token_index` of the slot's constrained request: `words`, u32
        (np.ndarray or little-endian bytes), geometry.mask_words of them, bit t % 32 of word t // 32 = token t.
        Mask 0 comes with `submit` (RequestSpec.token_mask); mask i + 1 is put after token i was read (the
        engine's row waits for it, never samples under a stale one). Ignored for a finished request."""

    def ready_slots(self, slots: Sequence[int]) -> list[int]:
        """Those of `slots` that may have news: the ones worth a `poll` (false positives allowed, no misses)."""

    def poll(self, slot: int) -> TokenUpdate:
        """What arrived for the slot since its last poll."""

    def release(self, slot: int) -> None:
        """Return a finished slot to the free list."""

    def reclaim(self) -> list[int]:
        """Finished slots nobody released (left by an earlier gateway or a lost connection)."""

    def close(self) -> None: ...
