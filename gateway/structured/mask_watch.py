"""The gateway process's mask watcher: one thread that reads the constrained requests' new tokens straight from
the ring (shm) and hands them to their mask loops (`MaskLoop.advance`), so that token i reaches the grammar,
and mask i + 1 the ring, without waiting for the event loop: a loop busy with other streams' writes (measured:
P50 15-22 ms at 64 streams on one worker, bench/mask_latency.py) no longer delays the engine.

It only reads (`ShmProducer.peek_tokens`: the tokens after the ones the matcher has, validated by the
response's sequence number, read before and after them); the poller stays the one reader that advances the
ring's consumed counter and delivers tokens to clients. The mask work itself runs on the mask loops' pool, so
a slow grammar holds up only its own request. The thread runs while constrained requests are in flight and
sleeps when there are none. It waits for news in C with the GIL released (`csrc/mask_wait.c`, built with the C
compiler on first use like the native stream round; checks every NATIVE_PERIOD_S): Python wakes only when a
token came. Without a compiler it polls in Python every WATCH_PERIOD_S (each poll takes the GIL from the event
loop: measured, about 0.3 of a core at 10,000 polls a second on the development VM).

The event loop thread holds the GIL most of the time under load, and a thread that waits for it gets it only
when the holder drops it: on a blocking call, or after `sys.getswitchinterval()` (5 ms by default, most of a
decode step). While the watcher runs, the process's switch interval is SWITCH_INTERVAL_S, so that the watcher
and the pool threads (mask i + 1 after token i: three short holds of the GIL) wait for it a fraction of a step.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocols import ring as R
from protocols.native_build import cached_build

from ..streaming.stream_round import FLAGS, c_compiler, cache_dir
from .mask_loop import MaskLoop

log = logging.getLogger("blink.gateway.structured")

# How often the C wait looks at the watched responses (no GIL, no Python): each look is a timer wake, and on the
# development VM wakes every 50 us cost about a quarter of a core; 0.2 ms adds 0.1 ms to a mask on average.
NATIVE_PERIOD_S = 0.0002
NATIVE_TIMEOUT_S = 0.001  # the longest C wait: then requests that came meanwhile are watched too
WATCH_PERIOD_S = 0.0003  # between Python scans where the C wait is not built
SWITCH_INTERVAL_S = 0.0002  # the GIL's switch interval while constrained requests are watched
SOURCE = Path(__file__).parent / "csrc" / "mask_wait.c"

# (first index) -> the request's generated tokens from there on ([] if none yet), or None while its slot does not
# hold it (not taken by the engine yet, or reused)
Peek = Callable[[int], "list[int] | None"]


@dataclass(frozen=True, slots=True)
class TokenSource:
    """Where a watched request's tokens are: `peek`, and for the C wait its response in the ring (`response`, a
    uint8 view that also keeps the mapping alive) and its seq; None where only `peek` exists."""

    peek: Peek
    response: np.ndarray | None = None
    seq: int = 0


@functools.cache
def native_wait():
    """`blink_mask_wait` (csrc/mask_wait.c), built now unless cached; None (logged) when it cannot be."""
    cc = c_compiler()
    if cc is None:
        log.warning("no C compiler: the mask watcher polls the ring from Python")
        return None
    try:
        lib = ctypes.CDLL(str(cached_build("mask_wait", (SOURCE,), [cc, *FLAGS, str(SOURCE)], cache_dir())))
    except (RuntimeError, OSError) as exc:
        log.warning("the mask watcher's wait did not build (%s): it polls the ring from Python", exc)
        return None
    fn = lib.blink_mask_wait
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32,
                   ctypes.c_int64, ctypes.c_int64]
    return fn


class MaskWatch:
    """One per process (`mask_watch()`): the watched mask loops and the thread that feeds them."""

    def __init__(self, period_s: float = WATCH_PERIOD_S, switch_interval_s: float = SWITCH_INTERVAL_S,
                 native: bool = True):
        self.period_s, self.switch_interval_s, self.native = period_s, switch_interval_s, native
        self._loops: dict[int, tuple[MaskLoop, TokenSource]] = {}  # id(loop) -> watched; written under _lock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._default_interval_s = sys.getswitchinterval()
        self._version = 0  # bumped when the watched set changes: the C wait's arrays are rebuilt
        self._arrays: tuple | None = None  # (version, loops, response addresses, seqs) for the C wait

    def watch(self, loop: MaskLoop, source: TokenSource | Peek) -> None:
        """Feed `loop` from `source` until the loop closes (the request ended)."""
        source = source if isinstance(source, TokenSource) else TokenSource(source)
        with self._lock:
            self._loops[id(loop)] = (loop, source)
            self._version += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-watch", daemon=True)
                self._thread.start()
        self._wake.set()

    @property
    def num_watched(self) -> int:
        return len(self._loops)

    def _run(self) -> None:
        wait = native_wait() if self.native else None
        while True:
            if not self._loops:
                sys.setswitchinterval(self._default_interval_s)
                self._wake.wait()
                self._wake.clear()
                sys.setswitchinterval(self.switch_interval_s)
                continue
            news = self._wait_native(wait) if wait is not None else None
            if news is None:
                time.sleep(self.period_s)
            if not self.scan() and news:  # news no loop could take (a slot past its buffer): no busy loop
                time.sleep(self.period_s)

    def _wait_native(self, wait) -> bool | None:
        """Until a watched response has news (True) or NATIVE_TIMEOUT_S passed (False), in C; None where a
        source has no response to watch (then the caller polls)."""
        if self._arrays is None or self._arrays[0] != self._version:
            with self._lock:
                watched = list(self._loops.values())
                version = self._version
            if any(source.response is None for _, source in watched):
                return None
            addresses = np.array([source.response.ctypes.data for _, source in watched], dtype=np.uintp)
            seqs = np.array([source.seq for _, source in watched], dtype=np.uint64)
            self._arrays = (version, [loop for loop, _ in watched], addresses, seqs)
        _, loops, addresses, seqs = self._arrays
        seen = np.fromiter((loop.num_seen for loop in loops), dtype=np.uint32, count=len(loops))
        return wait(addresses.ctypes.data, seqs.ctypes.data, seen.ctypes.data, len(loops), R.RESP_PRODUCED,
                    int(NATIVE_PERIOD_S * 1e9), int(NATIVE_TIMEOUT_S * 1e9)) >= 0

    def scan(self) -> int:
        """One pass over the watched loops: their new tokens to each; closed ones dropped. Returns how many
        loops got tokens."""
        num_fed = 0
        for key, (loop, source) in list(self._loops.items()):
            if loop.closed:
                self._drop(key)
                continue
            start = loop.num_seen
            try:
                tokens = source.peek(start)  # None: the engine has not taken the request yet
            except Exception:  # the ring is gone (shutdown): the poller ends the request
                log.debug("mask watch: a ring read failed", exc_info=True)
                self._drop(key)
                continue
            if tokens:
                loop.advance(tokens, start)
                num_fed += 1
        return num_fed

    def _drop(self, key: int) -> None:
        with self._lock:
            self._loops.pop(key, None)
            self._version += 1


_watch: MaskWatch | None = None


def mask_watch() -> MaskWatch:
    """The process's watcher (started with its first watched request)."""
    global _watch
    if _watch is None:
        _watch = MaskWatch()
    return _watch
