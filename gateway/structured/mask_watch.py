"""The gateway process's mask watcher: one thread that reads the constrained requests' new tokens straight from
the ring (shm) and hands them to their mask loops, so that token i reaches the grammar, and mask i + 1 the ring,
without waiting for the event loop: a loop busy with other streams' writes (measured: P50 15-22 ms at 64 streams
on one worker, bench/mask_latency.py) no longer delays the engine.

It only reads (`ShmProducer.peek_tokens`: the tokens after the ones the matcher has, validated by the
response's sequence number, read before and after them); the poller stays the one reader that advances the
ring's consumed counter and delivers tokens to clients. The mask work runs on the mask loops' pool, so a slow
grammar holds up only its own request; a lone request whose steps proved fast is stepped right here
(INLINE_MAX_READY, INLINE_MAX_WATCHED). The thread runs while constrained requests are in flight and sleeps when
there are none.

It waits for news in C with the GIL released (`csrc/mask_wait.c`, built with the C compiler on first use like
the native stream round): Python wakes only when tokens came, or the watched set changed. Nothing can wake it
from the ring (the engine only stores words), so the C wait naps between looks, and each nap is a timer wake
(tens of microseconds of a core on a VM). The naps follow the engine's steps (`StepClock`): the engine steps
all rows at once, so news comes in bursts one step apart; the wait naps finely (FINE_NAP_S) just after news
and from just before the next step's tokens are due, coarsely (COARSE_NAP_S) in between. Without a compiler
it polls in Python every WATCH_PERIOD_S (each poll takes the GIL from the event loop).

The event loop thread holds the GIL most of the time under load, and a thread that waits for it gets it only
when the holder drops it: on a blocking call, or after `sys.getswitchinterval()` (5 ms by default, most of a
decode step). While the watcher runs, the process's switch interval is SWITCH_INTERVAL_S, so that the watcher
and the pool threads (mask i + 1 after token i: three short holds of the GIL) wait for it a fraction of a step.
"""

from __future__ import annotations

import collections
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
from .mask_loop import STATS, MaskLoop, compute_turns, name_os_thread

log = logging.getLogger("blink.gateway.structured")

# The C wait's naps: fine ones where tokens may come any moment (just after news, the rest of a step's tokens
# for TAIL_S; from LEAD_S before the next step's are due to LEAD_S after), coarse ones in between and while
# no step period is known. On the development VM each wake costs ~35 us of a core: 5,000 a second (a fixed
# 0.2 ms nap) took 11% of a core with nothing to do. FINE_NAP_S is that old nap: where the period is no help
# (several engines' steps interleaved) the wait costs what it did.
FINE_NAP_S = 0.0002
COARSE_NAP_S = 0.001
TAIL_S = 0.0005
LEAD_S = 0.0005
MIN_PERIOD_S = 0.001  # bursts closer than this are one step's (a slow publish) and make no period
# The period is the median of the last few intervals between bursts: robust to a skipped step (an interval of
# two) and to a burst seen late (the watcher was busy), either of which would bias a minimum or a mean.
PERIODS_KEPT = 9
MISSED_STEPS = 4  # after this many steps with no news the period is forgotten (coarse naps until news)
NATIVE_TIMEOUT_S = 0.05  # the longest C wait (a change to the watched set ends it at once)
WATCH_PERIOD_S = 0.0003  # between Python scans where the C wait is not built
SWITCH_INTERVAL_S = 0.0002  # the GIL's switch interval while constrained requests are watched
# News for at most this many requests at once: the watcher runs their mask steps itself (MaskLoop.take_inline);
# more go to the pool, whose threads compute side by side (one thread would serialize them: measured 2x slower)
INLINE_MAX_READY = 1
# ... and only while it watches at most this many: a step proved fast may still take milliseconds (llguidance's
# first mask in a new lexer state, e.g. a bounded string near its maxLength: 2-4 ms on a 128k vocabulary), and
# meanwhile the watcher notices no other request's tokens: their masks would be late by that much.
INLINE_MAX_WATCHED = 1
# Where the pool computes one step at a time (mask_loop.masks_at_once is 1: a worker with two cores or fewer), it
# serializes them too: the watcher steps every proved-fast request itself, without the hand-off. Measured on the
# VM (32 streams, one worker): gateway CPU a token 130, 139 -> 121, 131 us, steps skipped 2.3, 2.9 -> 1.3, 1.8%.
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
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, *[ctypes.c_int64] * 5]
    return fn


class StepClock:
    """When the engine's next tokens are due, learnt from when news came (monotonic ns): the engine steps all
    its rows at once, so news comes in bursts one step apart (a burst is news within TAIL_S of the last)."""

    def __init__(self):
        self.burst_ns = self.last_news_ns = -(1 << 62)
        self.intervals: collections.deque[int] = collections.deque(maxlen=PERIODS_KEPT)

    def news(self, now_ns: int) -> None:
        if now_ns - self.last_news_ns > TAIL_S * 1e9 and now_ns - self.burst_ns >= MIN_PERIOD_S * 1e9:
            if self.burst_ns > 0:  # not the first news
                self.intervals.append(now_ns - self.burst_ns)
            self.burst_ns = now_ns
        self.last_news_ns = now_ns

    @property
    def period_ns(self) -> int | None:
        return sorted(self.intervals)[len(self.intervals) // 2] if len(self.intervals) >= 3 else None

    def plan(self, now_ns: int) -> tuple[int, int, int]:
        """(fine_from_ns, fine_until_ns, deadline_ns) for the next wait from `now_ns` (csrc/mask_wait.c)."""
        fine_until = self.last_news_ns + int(TAIL_S * 1e9)
        deadline = now_ns + int(NATIVE_TIMEOUT_S * 1e9)
        period = self.period_ns
        if period is None:
            return deadline, fine_until, deadline
        lead = int(LEAD_S * 1e9)
        steps = max(1, -(-(now_ns - self.burst_ns - lead) // period))  # the first step due after now - lead
        if steps > MISSED_STEPS:
            self.intervals.clear()
            return deadline, fine_until, deadline
        due = self.burst_ns + steps * period
        return due - lead, fine_until, min(deadline, due + lead)


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
        self._version_word = np.zeros(1, dtype=np.uint64)  # _version, where the C wait sees it
        # (version, watched, response addresses, seqs, seen, ready) for the C wait
        self._arrays: tuple | None = None
        self.clock = StepClock()

    def watch(self, loop: MaskLoop, source: TokenSource | Peek) -> None:
        """Feed `loop` from `source` until the loop closes (the request ended)."""
        source = source if isinstance(source, TokenSource) else TokenSource(source)
        loop.watched = True
        with self._lock:
            self._loops[id(loop)] = (loop, source)
            self._bump_locked()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-watch", daemon=True)
                self._thread.start()
        self._wake.set()

    @property
    def num_watched(self) -> int:
        return len(self._loops)

    def _run(self) -> None:
        name_os_thread("grammar-watch")
        wait = native_wait() if self.native else None
        while True:
            if not self._loops:
                sys.setswitchinterval(self._default_interval_s)
                self._wake.wait()
                self._wake.clear()
                sys.setswitchinterval(self.switch_interval_s)
                continue
            if STATS.on:
                period = self.clock.period_ns
                STATS.maybe_log(f", watching {len(self._loops)}, the engine's step as seen here "
                                f"{'-' if period is None else f'{period / 1e6:.2f} ms'}")
            ready = self._wait_native(wait) if wait is not None else None
            if ready is None:  # no C wait for these sources: a Python scan of all of them now and then
                time.sleep(self.period_s)
                self.scan()
                continue
            self._sweep()
            if ready and not self._feed(ready):  # news no loop could take (a slot past its buffer): no busy loop
                time.sleep(self.period_s)

    def _wait_native(self, wait) -> list[int] | None:
        """The watched requests whose responses have news (indices into the C wait's arrays), once some have
        ([] after a while with none, or when the watched set changed), waiting in C; None where a source has
        no response to watch (then the caller polls)."""
        if self._arrays is None or self._arrays[0] != self._version:
            with self._lock:
                watched = list(self._loops.values())
                version = self._version
            if any(source.response is None for _, source in watched):
                return None
            addresses = np.array([source.response.ctypes.data for _, source in watched], dtype=np.uintp)
            seqs = np.array([source.seq for _, source in watched], dtype=np.uint64)
            seen = np.array([loop.num_seen for loop, _ in watched], dtype=np.uint32)
            self._arrays = (version, watched, addresses, seqs, seen, np.zeros(len(watched), dtype=np.int32))
        version, watched, addresses, seqs, seen, ready = self._arrays
        fine_from, fine_until, deadline = self.clock.plan(time.monotonic_ns())
        count = wait(addresses.ctypes.data, seqs.ctypes.data, seen.ctypes.data, len(watched), R.RESP_PRODUCED,
                     ready.ctypes.data, self._version_word.ctypes.data, version, fine_from, fine_until,
                     int(FINE_NAP_S * 1e9), int(COARSE_NAP_S * 1e9), deadline)
        if count <= 0:
            return []
        self.clock.news(time.monotonic_ns())
        return ready[:count].tolist()

    def _feed(self, ready: list[int]) -> int:
        """`scan` of the C wait's ready requests (indices into its arrays), then what their loops have seen
        into its `seen`, so that tokens handed over are no news any more."""
        watched, seen = self._arrays[1], self._arrays[4]
        num_fed = self.scan([watched[i] for i in ready])
        for i in ready:
            seen[i] = watched[i][0].num_seen
        return num_fed

    def scan(self, watched: list[tuple[MaskLoop, TokenSource]] | None = None) -> int:
        """The new tokens of the `watched` requests (all of them by default) to their mask loops, queued on the
        pool, or, for at most INLINE_MAX_READY of them whose steps proved fast while no more than
        INLINE_MAX_WATCHED are watched (every one of them where the pool has one turn), stepped here (no pool hop);
        closed ones dropped. Returns how many loops got tokens."""
        news = []
        for loop, source in list(self._loops.values()) if watched is None else watched:
            if loop.closed:
                self._drop(id(loop))
                continue
            start = loop.num_seen
            try:
                tokens = source.peek(start)  # None: the engine has not taken the request yet
            except Exception:  # the ring is gone (shutdown): the poller ends the request
                log.debug("mask watch: a ring read failed", exc_info=True)
                self._drop(id(loop))
                continue
            if tokens:
                news.append((loop, tokens, start))
        inline = (len(news) <= INLINE_MAX_READY and len(self._loops) <= INLINE_MAX_WATCHED) or compute_turns().n == 1
        for loop, tokens, start in news:
            mine = loop.take_inline(tokens, start, inline)
            if mine:
                loop.step(mine)
        return len(news)

    def _sweep(self) -> None:
        """Closed loops out of the watched set (one look at each: cheap next to a wake)."""
        closed = [key for key, (loop, _) in self._loops.items() if loop.closed]
        for key in closed:
            self._drop(key)

    def _drop(self, key: int) -> None:
        with self._lock:
            if self._loops.pop(key, None) is not None:
                self._bump_locked()

    def _bump_locked(self) -> None:
        self._version += 1
        self._version_word[0] = self._version  # ends a C wait on the old set at its next look


_watch: MaskWatch | None = None


def mask_watch() -> MaskWatch:
    """The process's watcher (started with its first watched request)."""
    global _watch
    if _watch is None:
        _watch = MaskWatch()
    return _watch
