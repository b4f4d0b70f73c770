"""The gateway's side of one request in flight on a backend: its handle (`RequestHandle`), the queue its
updates wait in for its reader (`UpdateQueue`), and the two ways a reader can take updates in the poller
itself (a `Sink`; the native round, told through `OnTakeBack` when it hands a stream back)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Protocol

from protocols.messages import TokenUpdate
from protocols.ring import FinishReason, RequestSpec

from .stream_round import Taken


class UpdateQueue(collections.deque):
    """One request's updates: the poller puts, the request's one reader awaits. What asyncio.Queue does
    for this case with less work per token (no getter list, no size limit, no loop check per call). A
    deque itself, so that "updates are waiting" (its truth, read per token by the poller's sink) is C's."""

    __slots__ = ("_waiter", "_loop")

    def __init__(self):
        super().__init__()
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the reader's, found once (a getpid() per call)

    def put_nowait(self, update: TokenUpdate) -> None:
        self.append(update)
        self.wake()

    def wake(self) -> None:
        """Wake the reader: `get` returns the next update, or None if there is none."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> TokenUpdate | None:
        """The next update; None when `wake` woke the reader with none queued (it checks what else it waits for)."""
        if not self:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if not self:
                return None
        return self.popleft()

    def qsize(self) -> int:
        return len(self)


# Takes an update from the poller, in the poller (no task switch): True when it dealt with it, False when
# the update should go into the request's queue for its reader instead. It must not raise or block.
Sink = Callable[[TokenUpdate], bool]
# Told what the native round did with a stream it hands back (`Backend.take_back`). It must not raise.
OnTakeBack = Callable[[Taken], None]


class Owner(Protocol):
    """Where a handle's request runs (`gateway/backends/backend.py`'s `Backend`): what a handle asks of it."""

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel the request in the engine; the poller releases its slot once the engine has finished."""

    def go_native(self, handle: RequestHandle, *args) -> bool:
        """Let the native round deliver this stream (`NativeStreams.go`); False: it stays on the Python path."""

    def take_back(self, handle: RequestHandle) -> None:
        """The stream is the Python path's again (`NativeStreams.take_back`)."""


class RequestHandle:
    """The gateway's side of one submitted request: updates arrive in `queue`, or go to `sink` first."""

    __slots__ = ("backend", "slot", "spec", "queue", "finished", "abandoned", "submitted_s", "num_produced", "sink",
                 "native", "native_base", "mask_loop")

    def __init__(self, backend: Owner, slot: int, spec: RequestSpec):
        self.backend = backend
        self.slot = slot
        self.spec = spec
        self.queue = UpdateQueue()
        self.finished = False  # the engine reported a finish (or the gateway gave up on the engine)
        self.abandoned = False  # nobody reads `queue` any more
        self.submitted_s = time.perf_counter()
        self.num_produced = 0  # tokens pushed into `queue` (or taken by `sink`) so far
        self.sink: Sink | None = None  # set by a reader that can take updates in the poller
        self.native: OnTakeBack | None = None  # set while the native round delivers this stream (`Backend.go_native`)
        self.native_base = 0  # the stream's token count when it went native
        # A constrained request's grammar (gateway/structured/mask_loop.py): the poller advances it per token.
        self.mask_loop = None

    @property
    def outstanding_tokens(self) -> int:
        """Work still ahead: the prompt until the first token arrives, then what max_tokens leaves."""
        prompt_len = len(self.spec.prompt_ids) if self.num_produced == 0 else 0
        return prompt_len + max(self.spec.max_tokens - self.num_produced, 0)

    def produced(self, num_tokens: int) -> int:
        """`num_tokens` more arrived; returns by how much `outstanding_tokens` fell."""
        # `outstanding_tokens` before and after, inlined: once per update of every request
        produced, max_tokens = self.num_produced, self.spec.max_tokens
        before = (len(self.spec.prompt_ids) if produced == 0 else 0) + (max_tokens - produced if max_tokens > produced else 0)
        self.num_produced = produced = produced + num_tokens
        return before - (len(self.spec.prompt_ids) if produced == 0 else 0) - (max_tokens - produced if max_tokens > produced else 0)

    async def next(self) -> TokenUpdate | None:
        """The next update; None when the reader was woken without one (`UpdateQueue.wake`)."""
        update = await self.queue.get()
        if update is not None and update.finish != FinishReason.NONE:
            self.finished = True
        return update

    def go_native(self, *args) -> bool:
        """`Backend.go_native` for this stream."""
        return self.backend.go_native(self, *args)

    def take_back(self) -> None:
        """The stream is the Python path's again (`Backend.take_back`); a no-op if it is."""
        if self.native is not None:
            self.backend.take_back(self)

    def close(self) -> None:
        """Done reading. If the engine has not finished, cancel it there; the poller releases the slot."""
        if self.mask_loop is not None:
            self.mask_loop.close()
        if not self.abandoned:
            self.take_back()
            self.abandoned = True
            if not self.finished:
                self.backend.cancel(self)
