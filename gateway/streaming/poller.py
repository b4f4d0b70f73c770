"""The poller of one ring, and the one place where the request path and the pollers meet.

The poller (`Poller`) is the only code that reads a ring's response side. While requests are in flight it
finds the slots with news (`ready_slots`: one vectorized read of every slot's counters, or the native round's
scan, `native.py`), polls those, and hands each `TokenUpdate` to that request's `sink` if it has one (a
streamed response writes it to its client right there, `gateway/api/sse.py`), else (or when the sink declines)
pushes it into the request's `UpdateQueue`. It polls again right after the readers ran while news keeps coming
(up to `poll_spin_s` after the last), else every `poll_active_s`; with no request in flight it waits for a
submission. It releases a slot once the engine has reported a finish, also for requests whose client went
away (those are cancelled first, then drained). What it does not own (slot waiters, the heartbeat, failing
requests) it asks of its owner, the backend (`Owner`).

Where the request path meets the pollers: `poll_checkpoint()`, at the steps listed in `CHECKPOINTS` and
nowhere else (tests/gateway/test_gateway_poller.py holds the code to that list). The event loop runs a
callback to its end, and every callback that is ready in one pass; a request's set-up or end (HTTP parsing,
validation, tokenizing, the ring submission, the response head, the last chunks, metrics) is several hundred
microseconds of such work, and a pass can hold several requests'. Every open stream's tokens wait meanwhile.
At a checkpoint, each poller of this event loop whose last round began over `GatewayConfig.poll_checkpoint_s`
ago gets one, right there: tokens wait for one step of another request's work, not for a pass of it
(bench/RESULTS.md, "poll checkpoints": emit P99 under 1 ms in 5 of 10 runs against 0 of 10 without).
Why steps and not one hook around the whole request (an aiohttp middleware, or a wrapper of the request's
task that checks before every resumption): such a hook sees only where a request waits, and the stretches
that hold the loop longest wait nowhere: after tokenizing, the spec, the submission, the detokenizer and the
format run without an await; so do a stream's last chunks and its accounting. The steps are where those
stretches break. A checkpoint costs a clock read per poller when no round is due. Never one on the poller's
own path (sinks, `Generation.take`): a round inside a round is skipped anyway (`poll_round`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Protocol

from protocols.producer import RingProducer

from ..config import GatewayConfig
from .native import NativeStreams
from .request_handle import RequestHandle

log = logging.getLogger("blink.gateway.backends")

# The request path's steps that take a checkpoint, as (module, function): the only callers of `poll_checkpoint`.
CHECKPOINTS = (
    ("gateway.server", "error_middleware"),  # aiohttp has parsed a new request and built its object
    ("gateway.request.pipeline", "start_generation"),  # the set-up's turn came (pacing), maybe in a new pass
    ("gateway.request.pipeline", "_start"),  # after tokenizing
    ("gateway.request.pipeline", "_submit_choices"),  # after each choice's submission
    ("gateway.api.http", "_generate"),  # after the output format
    ("gateway.api.http", "_stream"),  # before the response head
    ("gateway.api.sse", "run"),  # before a stream's last write
    ("gateway.request.generate", "close"),  # the stream's end was written; its accounting follows
)

_started = threading.local()  # .pollers: the started pollers of this thread's event loop


def poll_checkpoint() -> None:
    """A step of a request's set-up or end (`CHECKPOINTS`): each poller of this event loop whose last round
    began more than `GatewayConfig.poll_checkpoint_s` ago gets one now, right here."""
    pollers = getattr(_started, "pollers", None)
    if pollers:
        now_ns = time.monotonic_ns()
        for poller in pollers:
            if now_ns - poller.round_ns > poller.checkpoint_ns:
                try:
                    poller.poll_round(now_ns)
                except Exception:  # not the caller's request's failure: the poller's own round meets it next
                    log.exception("poll round of backend %s failed at a checkpoint", poller.name)


class Owner(Protocol):
    """What a poller asks of the backend it polls for (`gateway/backends/backend.py`)."""

    def slot_freed(self) -> None:
        """A slot was released: a request waiting for one may go."""

    def check_heartbeat(self) -> None:
        """Requests are in flight: fail them if the engine's heartbeat stood still too long."""

    def tidy(self) -> None:
        """Release slots an earlier gateway left, wake waiters for slots freed elsewhere."""

    def reset_heartbeat(self) -> None:
        """Requests came after an idle spell: the heartbeat's clock starts now."""

    def fail_all(self, message: str) -> int:
        """Fail every request in flight with `message`."""


class Poller:
    """One ring's response side: the requests in flight on it and the task that delivers their news."""

    def __init__(self, name: str, producer: RingProducer, native: NativeStreams, config: GatewayConfig,
                 spin_s: float, owner: Owner):
        """`name`: the backend's address, for logs; `spin_s`: how long to keep polling after news."""
        self.name, self.config, self.native, self.spin_s = name, config, native, spin_s
        self._producer, self._owner, self._slot_freed = producer, owner, owner.slot_freed
        self.requests: dict[int, RequestHandle] = {}  # slot -> request in flight
        self._slots: list[int] | None = None  # its slots in ring order, for a round (None: changed since)
        # Sum of `outstanding_tokens` over `requests`, kept as they change: routing reads it per request,
        # and summing over hundreds of streams each time made routing quadratic in the streams in flight.
        self.outstanding = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._next_check_s = 0.0
        self._news_s = 0.0  # when a poll last found tokens or a finish (time.monotonic)
        self.round_ns = 0  # when the last poll round began (time.monotonic_ns)
        self.checkpoint_ns = int(config.poll_checkpoint_s * 1e9) if config.poll_checkpoint_s else 1 << 62
        self._in_round = False

    def add(self, handle: RequestHandle) -> None:
        """A request was submitted into `handle.slot`: its news is this poller's to deliver from now on."""
        self.requests[handle.slot] = handle
        self._slots = None
        self.outstanding += handle.outstanding_tokens
        self._wakeup.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_loop(), name=f"poller {self.name}")
        if not hasattr(_started, "pollers"):
            _started.pollers = []
        _started.pollers.append(self)

    async def stop(self) -> None:
        if self in getattr(_started, "pollers", ()):
            _started.pollers.remove(self)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _poll_loop(self) -> None:
        while True:
            try:
                if self.requests:
                    now_ns = time.monotonic_ns()
                    now_s = now_ns / 1e9
                    self.poll_round(now_ns)
                    self._housekeeping()
                    # Within spin_s of the last news, poll again as soon as the readers woken have run (one
                    # loop iteration): flowing tokens wait for no timer tick. After that, sleep
                    # poll_active_s per round, so requests that produce nothing cost no spinning core.
                    spinning = now_s - self._news_s < self.spin_s
                    await asyncio.sleep(0 if spinning else self.config.poll_active_s)
                else:
                    await self._idle()
            except asyncio.CancelledError:
                raise
            except Exception:  # a poller that dies would hang every request: fail them, keep going
                log.exception("poller of backend %s failed", self.name)
                self._owner.fail_all("the gateway lost track of this request (poller error)")
                await asyncio.sleep(self.config.heartbeat_check_s)

    def poll_round(self, now_ns: int) -> None:
        """One poll round, begun at `now_ns` (time.monotonic_ns): the poller's, or a `poll_checkpoint`'s."""
        if self._in_round or not self.requests:
            return
        self._in_round, self.round_ns = True, now_ns
        try:
            if self._poll_once():
                self._news_s = now_ns / 1e9
        finally:
            self._in_round = False

    def _poll_once(self) -> int:
        """Pass each request's news to its reader; returns how many requests had some that is worth spinning
        for: a constrained request whose grammar the mask watcher feeds (gateway/structured/mask_watch.py)
        needs no quick poll (its next token waits for its mask, not for this loop), and a spinning loop holds
        the GIL and a core the watcher and the mask threads need (bench/mask_latency.py: at one stream, a mask
        late for 3% of the steps with the spin, 0.1% without)."""
        num_updates = 0
        if self._slots is None:  # in ring order: a round then reads the ring's words in address order
            self._slots = sorted(self.requests)
        requests, poll, native = self.requests, self._producer.poll, self.native.round  # bound once a round
        if native is None:
            ready = self._producer.ready_slots(self._slots)
        else:  # the native streams' tokens go out now; the rest is this loop's
            ready, num_updates, fell = native.round(self._slots, time.perf_counter_ns())
            self.outstanding -= fell
        for slot in ready:
            handle = requests[slot]
            if handle.native is not None:  # handed back by the round: its news is this loop's
                self.native.take_back(handle)
            update = poll(slot)
            tokens = update.tokens
            if not tokens and not update.finish:  # FinishReason.NONE is 0
                continue
            if handle.mask_loop is None or not handle.mask_loop.watched:
                num_updates += 1
            if handle.mask_loop is not None:  # the next token's mask first: the engine waits for it
                if update.finish:
                    handle.mask_loop.close()
                elif tokens and not handle.abandoned:  # unless the mask watcher handed them over first
                    handle.mask_loop.advance(tokens, handle.num_produced)
            if not handle.abandoned:
                if tokens:
                    self.outstanding -= handle.produced(len(tokens))
                sink = handle.sink
                if sink is None or not sink(update):
                    handle.queue.put_nowait(update)
            if update.finish:
                del requests[slot]
                self._slots = None
                self.outstanding -= handle.outstanding_tokens
                self._producer.release(slot)
                self._slot_freed()
        return num_updates

    async def _idle(self) -> None:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), self.config.heartbeat_check_s)
        except TimeoutError:
            self._owner.tidy()
        self._owner.reset_heartbeat()

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._next_check_s:
            self._next_check_s = now + self.config.heartbeat_check_s
            self._owner.check_heartbeat()
            self._owner.tidy()
            for handle in self.requests.values():  # a grammar stuck on one token must not leave its row waiting
                if handle.mask_loop is not None:
                    handle.mask_loop.fail_if_overdue(now)
