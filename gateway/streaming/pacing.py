"""New requests take turns with streaming: at most one request's set-up starts per event-loop pass.

A request's set-up (limits, tokenize, route, submit) and its response head cost the event loop about half a
millisecond of CPU. When hundreds of requests arrive together, asyncio runs every handler that is ready in
one pass, back to back, and the backend pollers, which move every open stream's tokens, wait behind all of
them: with 512 arrivals, tokens waited up to ~100 ms (bench/RESULTS.md, stream4). With pacing, a set-up that
finds another one already started in this pass waits for a later pass, in arrival order, so between any two
set-ups the pollers get their round. A burst then takes about one loop pass longer per request (microseconds
when the loop has nothing else to do).

Only the submission is paced, not a streamed response's head (sent when its first token is there): that
stream's engine is already producing, so every pass its head waits makes tokens late, while a submission
that waits delays only its own first token.
"""

from __future__ import annotations

import asyncio
from collections import deque


class SetupPacer:
    """`await turn()` before a request's set-up work; returns when that work may run."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._granted = False  # a set-up has the turn of the current pass (or was handed the next one)
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        """Set-ups waiting for their turn (cancelled ones included until their turn comes round)."""
        return len(self._waiters)

    async def turn(self) -> None:
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        if not self._granted and not self._waiters:
            self._grant(loop)
            return
        fut = loop.create_future()
        self._waiters.append(fut)
        await fut  # a cancelled waiter's future is cancelled with it: `_next` passes over it

    def _grant(self, loop: asyncio.AbstractEventLoop) -> None:
        # `_next` is queued behind every callback ready now (the pollers' next rounds among them), so it
        # runs in the next pass, after them: that is where the next set-up's turn comes from
        self._granted = True
        loop.call_soon(self._next, loop)

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        self._granted = False
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._grant(loop)
                return
