"""The gateway process's mask watcher: one thread that reads the constrained requests' new tokens straight from
the ring (shm) and hands them to their mask loops (`MaskLoop.advance`), so that token i reaches the grammar,
and mask i + 1 the ring, without waiting for the event loop: a loop busy with other streams' writes (measured:
tens of milliseconds at 64 streams on one worker, bench/mask_latency.py) no longer delays the engine.

It only reads (`ShmProducer.peek_tokens`: the tokens after the ones the matcher has, validated by the
response's sequence number, read before and after them); the poller stays the one reader that advances the
ring's consumed counter and delivers tokens to clients. The mask work itself runs on the mask loops' pool, so
a slow grammar holds up only its own request. The thread runs while constrained requests are in flight; it
scans their slots every WATCH_PERIOD_S (a few microseconds each) and sleeps when there are none.

The event loop thread holds the GIL most of the time under load, and a thread that waits for it gets it only
when the holder drops it: on a blocking call, or after `sys.getswitchinterval()` (5 ms by default, most of a
decode step). While the watcher runs, the process's switch interval is SWITCH_INTERVAL_S, so that the watcher
and the pool threads (mask i + 1 after token i: three short holds of the GIL) wait for it a fraction of a step.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from .mask_loop import MaskLoop

log = logging.getLogger("blink.gateway.structured")

WATCH_PERIOD_S = 0.0001  # between scans of the watched slots (a decode step is milliseconds)
SWITCH_INTERVAL_S = 0.0002  # the GIL's switch interval while constrained requests are watched

# (first index) -> the request's generated tokens from there on ([] if none yet), or None while its slot does not
# hold it (not taken by the engine yet, or reused)
Peek = Callable[[int], "list[int] | None"]


class MaskWatch:
    """One per process (`mask_watch()`): the watched mask loops and the thread that feeds them."""

    def __init__(self, period_s: float = WATCH_PERIOD_S, switch_interval_s: float = SWITCH_INTERVAL_S):
        self.period_s, self.switch_interval_s = period_s, switch_interval_s
        self._loops: dict[int, tuple[MaskLoop, Peek]] = {}  # id(loop) -> (loop, peek); written under _lock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._default_interval_s = sys.getswitchinterval()

    def watch(self, loop: MaskLoop, peek: Peek) -> None:
        """Feed `loop` from `peek` until the loop closes (the request ended)."""
        with self._lock:
            self._loops[id(loop)] = (loop, peek)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-watch", daemon=True)
                self._thread.start()
        self._wake.set()

    @property
    def num_watched(self) -> int:
        return len(self._loops)

    def _run(self) -> None:
        while True:
            if not self._loops:
                sys.setswitchinterval(self._default_interval_s)
                self._wake.wait()
                self._wake.clear()
                sys.setswitchinterval(self.switch_interval_s)
                continue
            self.scan()
            time.sleep(self.period_s)

    def scan(self) -> None:
        """One pass over the watched loops: their new tokens to each; closed ones dropped."""
        for key, (loop, peek) in list(self._loops.items()):
            if loop.closed:
                self._drop(key)
                continue
            start = loop.num_seen
            try:
                tokens = peek(start)  # None: the engine has not taken the request yet
            except Exception:  # the ring is gone (shutdown): the poller ends the request
                log.debug("mask watch: a ring read failed", exc_info=True)
                self._drop(key)
                continue
            if tokens:
                loop.advance(tokens, start)

    def _drop(self, key: int) -> None:
        with self._lock:
            self._loops.pop(key, None)


_watch: MaskWatch | None = None


def mask_watch() -> MaskWatch:
    """The process's watcher (started with its first watched request)."""
    global _watch
    if _watch is None:
        _watch = MaskWatch()
    return _watch
