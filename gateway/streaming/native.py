"""One backend's use of the native round (`stream_round.StreamRound`): which of its plain streams the round
delivers, and their hand-over both ways between the round and the Python path (`gateway/api/sse.py`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from protocols import ring as R
from protocols.shm_producer import ShmProducer

from .request_handle import RequestHandle
from .stream_round import StreamRound, Taken, load, table_for

log = logging.getLogger("blink.gateway.stream_round")


class NativeStreams:
    """One backend's use of the native round: which of its streams the round delivers, and their hand-over
    both ways. `round` stays None until the first stream goes native (its tokenizer's table comes with it)."""

    NOT_BUILT = "off (not built: no C compiler, or the build failed; see the log)"

    def __init__(self, producer: ShmProducer, geometry: R.RingGeometry, off: str | None):
        """`off`: why the round is not used here (None: it is)."""
        self._producer, self._geometry, self.off = producer, geometry, off
        self.round: StreamRound | None = None

    @property
    def state(self) -> str:
        """For operators (`/admin/status`): "on", or "off (why)"."""
        return "on" if self.round is not None else self.off or "on (from the first plain stream)"

    def prepare(self) -> None:
        """Build (or find) the library now; blocking: run it off the event loop."""
        if self.off is None and load() is None:
            self.off = self.NOT_BUILT

    def go(self, handle: RequestHandle, fd: int, chunked: bool, head: bytes, tail: bytes, budget: int | None,
           num_tokens: int, hand_over: Callable[[], tuple | None], on_take_back: Callable[[Taken], None]) -> bool:
        """Let the round deliver this stream's plain text chunks: each frame `head` + JSON string + `tail`
        (HTTP/1.1 chunked if `chunked`), sent on a dup of socket `fd`, until the stream holds `budget` tokens
        (None: no limit). `hand_over()` gives the stream's (TokenPieces, pending bytes), or None when it
        cannot go; `on_take_back` gets what the round did when the stream comes back. False (nothing
        changed) when the stream stays on the Python path."""
        if self.off is not None or handle.native is not None or handle.abandoned or handle.finished \
                or handle.mask_loop is not None:  # a constrained stream's tokens go through its grammar here
            return False
        given = hand_over()
        if given is None:
            return False
        pieces, pending = given
        if self.round is None:
            self._make_round(pieces)
        seq, consumed = self._producer.position(handle.slot)
        native, tokens_left = self.round, handle.spec.max_tokens - handle.num_produced
        if native is None or table_for(pieces) is not native.table or not native.enable(
                handle.slot, fd, seq, consumed, num_tokens, budget, tokens_left, chunked, pending, head, tail):
            on_take_back(Taken(consumed, num_tokens, pending, 0, 0, b"", "none"))  # as it was
            return False
        handle.native, handle.native_base = on_take_back, num_tokens
        return True

    def _make_round(self, pieces) -> None:
        lib = load()
        if lib is None:
            self.off = self.NOT_BUILT
            return
        self.round = StreamRound(lib, self._producer.ring.buf, self._geometry, table_for(pieces))

    def take_back(self, handle: RequestHandle) -> None:
        """The stream is the Python path's again (a no-op if it was not native): its ring position, token
        count and what the round sent go back where the Python path keeps them."""
        on_take_back = handle.native
        if on_take_back is None:
            return
        handle.native = None
        taken = self.round.take_back(handle.slot)
        if taken is None:
            return
        self._producer.resume_at(handle.slot, taken.consumed)
        handle.num_produced += taken.num_tokens - handle.native_base
        try:
            on_take_back(taken)
        except Exception:  # the poller must go on; the stream's reader meets the state as it is
            log.exception("request %d: taking its stream back from the native round failed", handle.spec.request_id)

    def close(self) -> None:
        """Before the ring it points into."""
        if self.round is not None:
            self.round.close()
