"""The per-request mask loop: generated token i arrives, the request's matcher takes it and computes the mask of
token i + 1 on a small thread pool (llguidance releases the GIL there), and the mask goes into the ring
(`put_mask`). The engine waits for that mask before it samples token i + 1, so nothing slow may sit between
token i and mask i + 1.

Where the transport allows it (shm: `put_mask` writes the slot's own mask area, `masks_from_any_thread`), the
event loop is out of that path: the process's mask watcher (`mask_watch.py`) reads the request's new tokens
straight from the ring and calls `advance` from its thread, the pool thread writes the mask itself and starts
the request's next step itself (measured before: one gateway worker's loop at 64 constrained streams doubled
their TPOT). The poller still calls `advance` with each update's tokens (whichever of the two comes first
feeds the matcher; `advance` takes each token index once). Elsewhere (tcp, rdma: their connections are the
event loop's) the poller feeds the matcher and the mask is written back on the event loop.

One request's steps run one at a time, in order (its matcher is not shared); requests run side by side on the
pool's threads, and a request whose grammar masks slowly moves to a slow lane of its own (SLOW_MASK_THREADS below),
so one slow grammar holds up only its own request's masks. When the watcher finds few requests with news
(a lone stream, a quiet moment), or always where the pool has one turn (`Turns`: a worker with two cores or
fewer, where the turn serializes the masks anyway), it runs the steps of those whose steps have proved fast on the
pool (INLINE_AFTER_STEPS in a row under INLINE_STEP_S) itself (`take_inline`, then `step`): no hop to a pool thread
and its GIL wait. Measured (bench/mask_latency.py): batching a whole step's masks on the watcher (llguidance's
parallel fill) was 2x slower at 16 and 64 streams than the pool: one thread serializes them, and the library's
worker threads spin on shared cores.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import llguidance
import numpy as np

from ..env import MASK_STATS_S, MASK_STEP_LIMIT_S as _MASK_STEP_LIMIT_VAR
from .grammar import Compiled, Grammars

log = logging.getLogger("blink.gateway.structured")

# Threads computing masks: llguidance's mask takes tens to hundreds of microseconds of a core per token, and
# releases the GIL meanwhile. Two pools, so that slow grammars wait for each other and never for the rest: a
# request's steps run on the main pool (MASK_THREADS, started at first use) until one takes over SLOW_STEP_S, then
# on the slow lane (SLOW_MASK_THREADS). The main pool is then blocked only by MASK_THREADS grammars turning slow
# at once, each for one step (bench/mask_latency.py, tests/gateway/test_structured_gateway.py). Of its threads,
# at most `masks_at_once` compute at once (the worker's cores less one: more cost every mask); a step that waits
# SLOW_STEP_S for a turn goes on without one (the turns are then held by steps turning slow).
MASK_THREADS = 8
SLOW_MASK_THREADS = 2
SLOW_STEP_S = 0.02
# A step under INLINE_STEP_S is fast; after INLINE_AFTER_STEPS fast pool steps in a row the watcher may run the
# request's steps itself (a step over SLOW_STEP_S there sends it back to the pool, slow lane). A new request
# starts on the pool: a slow grammar never holds up the watcher unproved.
INLINE_STEP_S = 0.002
INLINE_AFTER_STEPS = 2
# One token's mask step may take this long ($BLINK_MASK_STEP_LIMIT_S, gateway/env.py); a request whose step takes longer
# ends with an error instead of leaving its row waiting (the poller checks every heartbeat_check_s; llguidance's fuel
# limits make it rare).
MASK_STEP_LIMIT_S = _MASK_STEP_LIMIT_VAR.value()
_pools: dict[bool, "MaskPool"] = {}
# MaskStats' thresholds: a step (queued -> mask put) over these may miss the engine's next step (a decode step is
# 5-10 ms on a GPU host), so they are counted apart
STATS_OVER_S = (0.002, 0.005)
_at_once_setting = (0, 1)  # (GatewayConfig.grammar_concurrency, workers): `configure`
_turns: "Turns | None" = None  # the main pool's steps computing at once (`compute_turns`)

PutMask = Callable[[int, np.ndarray], None]  # (token index, [mask_words] uint32)
OnError = Callable[[str], None]  # the request must end with this message


def name_os_thread(name: str) -> None:
    """Name the calling OS thread (/proc's comm, 15 bytes; Python's thread names stay in Python): `blink bench`
    counts a gateway's CPU by thread name, so the grammar threads' work (`grammar-*`) is measured apart."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def configure(grammar_concurrency: int, workers: int) -> None:
    """The gateway's setting (GatewayConfig.grammar_concurrency, 0: automatic) and its number of workers, read at
    the first constrained request's first step (after any pinning of the process to its cores)."""
    global _at_once_setting
    _at_once_setting = (grammar_concurrency, workers)


def masks_at_once(grammar_concurrency: int, workers: int, cores: int) -> int:
    """How many main-pool steps compute at once: the setting, or the worker's share of the `cores` this process
    may use less one (its event loop's), between 1 and MASK_THREADS. More than that cost every mask: with 2
    workers on 2 cores, 8 at once each took 20-25% more gateway CPU a token than 2, and 2 took 9-12% more than 1
    and skipped twice the engine steps; one worker on 2 cores, 2 at once against 1 likewise (bench/RESULTS.md)."""
    if grammar_concurrency:
        return grammar_concurrency
    return min(MASK_THREADS, max(1, cores // max(workers, 1) - 1))


class Turns:
    """`n` turns to compute at once, as a semaphore's acquire(timeout=) / release(): a C-level queue of n tokens.
    threading.Semaphore waits in a Python-level Condition (a new lock, a deque, bytecode under the GIL for every
    contended turn): with one turn on the VM it cost 10-25 us of gateway CPU a constrained token and twice the
    engine steps skipped for a late mask (bench/NOTES.md)."""

    __slots__ = ("_tokens", "n")

    def __init__(self, n: int):
        self.n = n
        self._tokens = queue.SimpleQueue()
        for _ in range(n):
            self._tokens.put(None)

    def acquire(self, timeout: float) -> bool:
        try:
            self._tokens.get(timeout=timeout)
        except queue.Empty:
            return False
        return True

    def release(self) -> None:
        self._tokens.put(None)


def compute_turns() -> Turns:
    global _turns
    if _turns is None:
        _turns = Turns(masks_at_once(*_at_once_setting, _cores()))
    return _turns


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class MaskPool:
    """`threads` threads running calls from a C-level queue, named `name` to the OS too (`blink bench` counts their
    CPU by it). concurrent.futures' pool makes a Future and takes its idle semaphore, Python-level Conditions, for
    every call: a mask step needs neither, and the turns measured what such hand-offs cost (`Turns`)."""

    __slots__ = ("_calls",)

    def __init__(self, threads: int, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._run, args=(name,), name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> None:
        self._calls.put((fn, args))

    def _run(self, name: str) -> None:
        name_os_thread(name)
        while True:
            fn, args = self._calls.get()
            try:
                fn(*args)
            except Exception:  # a step ends its request on its own failures; nothing may end a pool thread
                log.exception("a grammar pool call failed")


_pools_lock = threading.Lock()


def mask_pool(slow: bool = False) -> MaskPool:
    """The main pool, or the slow lane's (started at first use)."""
    pool = _pools.get(slow)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(slow)
            if pool is None:
                name = "grammar-slow" if slow else "grammar-mask"
                pool = _pools[slow] = MaskPool(SLOW_MASK_THREADS if slow else MASK_THREADS, name)
    return pool


class MaskLoop:
    """One constrained request's matcher, advanced by the tokens it generates; see the module's docstring."""

    __slots__ = ("grammars", "matcher", "put_mask", "on_error", "num_consumed", "num_seen", "_pending", "_running",
                 "closed", "_loop", "put_from_pool", "_lock", "_step_started_s", "slow", "fast_steps", "watched")

    def __init__(self, grammars: Grammars, compiled: Compiled, put_mask: PutMask, on_error: OnError,
                 put_from_pool: bool = False):
        """`put_from_pool`: `put_mask` may run on the pool thread (the producer says so: shm)."""
        self.grammars = grammars
        self.matcher: llguidance.LLMatcher = compiled.new_matcher()
        self.put_mask, self.on_error, self.put_from_pool = put_mask, on_error, put_from_pool
        # Guards the state below against the threads that touch it: the mask watcher's `advance`, the pool's end
        # of a step, `close` (a mask being written from the pool finishes before close returns).
        self._lock = threading.Lock()
        self.num_consumed = 0  # tokens the matcher has taken: the next mask is this token's
        self.num_seen = 0  # tokens handed to `advance` so far (taken, or pending)
        self._pending: list[int] = []  # tokens arrived while a step ran
        self._running = False
        self._step_started_s = 0.0  # when the running step was queued (time.monotonic)
        self.slow = False  # a step took over SLOW_STEP_S: the next ones run on the slow lane
        self.fast_steps = 0  # pool steps in a row under INLINE_STEP_S (from INLINE_AFTER_STEPS the watcher may step it)
        self.closed = False
        # The mask watcher feeds it (mask_watch.py): its poller need not spin for its tokens (poller._poll_once)
        self.watched = False
        self._loop = asyncio.get_running_loop()

    def advance(self, token_ids: list[int], first_index: int | None = None) -> None:
        """Generated tokens arrived (from any thread): their mask step is queued; it never blocks. With
        `first_index` (the index of `token_ids[0]` among the generated tokens), those already handed over are
        skipped: two readers (the poller, the mask watcher) may hand over the same tokens."""
        with self._lock:
            if self._take_locked(token_ids, first_index) and not self._running:
                self._start()

    def take_inline(self, token_ids: list[int], first_index: int, inline: bool = True) -> list[int] | None:
        """`advance` for the watcher: when `inline`, this request's steps have proved fast and none is running,
        its tokens, for the caller to run their step now on its thread (`step`); else None (queued on the pool
        as `advance` does, or nothing new)."""
        with self._lock:
            if not self._take_locked(token_ids, first_index) or self._running:
                return None
            if not inline or not self.put_from_pool or self.slow or self.fast_steps < INLINE_AFTER_STEPS:
                self._start()
                return None
            tokens, self._pending, self._running = self._pending, [], True
            self._step_started_s = time.monotonic()
            return tokens

    def _take_locked(self, token_ids: list[int], first_index: int | None) -> bool:
        """The tokens not handed over yet into `_pending`; whether there were any (never once closed)."""
        if self.closed:
            return False
        if first_index is not None and first_index != self.num_seen:
            if first_index > self.num_seen:  # a gap: never, both readers read every token in order
                return False
            token_ids = token_ids[self.num_seen - first_index:]
        if not token_ids:
            return False
        self.num_seen += len(token_ids)
        self._pending += token_ids
        return True

    def close(self) -> None:
        """The request ended: steps still running deliver nothing. A mask a pool thread is writing is written
        before this returns, and none after (the slot may then be released and reused)."""
        with self._lock:
            self.closed = True

    def fail_if_overdue(self, now_s: float, limit_s: float | None = None) -> bool:
        """End the request if its running step was queued over `limit_s` (MASK_STEP_LIMIT_S) before `now_s`
        (time.monotonic): the engine must not wait for its mask without bound. From any thread."""
        limit_s = MASK_STEP_LIMIT_S if limit_s is None else limit_s
        with self._lock:
            if self.closed or not self._running or now_s - self._step_started_s <= limit_s:
                return False
            self.closed = True
        self._fail_threadsafe(f"computing the grammar's token mask took over {limit_s:g} s (this server's limit "
                              f"per token)")
        return True

    def _start(self) -> None:
        tokens, self._pending, self._running = self._pending, [], True
        self._step_started_s = time.monotonic()
        mask_pool(self.slow).submit(self.step if self.slow else self._step_in_turn, tokens)

    def _step_in_turn(self, token_ids: list[int]) -> None:
        """A main-pool step, within `compute_turns` (or without a turn after waiting SLOW_STEP_S for one)."""
        turns = compute_turns()
        turn = turns.acquire(timeout=SLOW_STEP_S)
        try:
            self.step(token_ids)
        finally:
            if turn:
                turns.release()

    def step(self, token_ids: list[int]) -> None:
        """In a pool thread (or the watcher's, `take_inline`): consume the tokens, compute the next mask, put it
        (or hand it to the event loop)."""
        started_s = time.monotonic()
        try:
            result: np.ndarray | str | None = self.consume_and_mask(token_ids)
        except Exception as exc:  # a library failure ends this request, never the pool
            result = f"the grammar engine failed: {exc}"
        took_s = time.monotonic() - started_s
        self.slow = self.slow or took_s > SLOW_STEP_S
        self.fast_steps = self.fast_steps + 1 if took_s < INLINE_STEP_S else 0
        if self.put_from_pool:
            self._end_step(result)
            if STATS.on:
                STATS.record(started_s - self._step_started_s, took_s, time.monotonic() - started_s - took_s)
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, result)
        except RuntimeError:  # the event loop closed (shutdown)
            pass

    def _end_step(self, result: np.ndarray | str) -> None:
        """On the pool thread (put_from_pool): the mask into the ring and the next step started, with no hop
        through the event loop; only a failure goes there (the request ends with it)."""
        with self._lock:
            self._running = False
            if self.closed:
                return
            error = result if isinstance(result, str) else self._put_locked(result)
            if error is None:
                if self._pending:
                    self._start()
                return
            self.closed = True
        self._fail_threadsafe(error)

    def _fail_threadsafe(self, message: str) -> None:
        """The request ends with `message` (on the event loop, which owns the request's end)."""
        try:
            self._loop.call_soon_threadsafe(self.on_error, message)
        except RuntimeError:  # the event loop closed (shutdown)
            pass

    def consume_and_mask(self, token_ids: list[int]) -> np.ndarray | str:
        """The mask after `token_ids`, or why the grammar refused one of them. Blocking."""
        for token_id in token_ids:
            if not self.matcher.consume_token(token_id):
                return (f"generated token {token_id} (position {self.num_consumed}) is outside the requested "
                        f"grammar: {self.matcher.get_error() or 'rejected'}")
            self.num_consumed += 1
        return self.grammars.mask_of(self.matcher)

    def _put_locked(self, words: np.ndarray) -> str | None:
        """On the pool thread, holding the lock: the mask into the ring; None, or why it could not."""
        try:
            self.put_mask(self.num_consumed, words)
        except Exception as exc:  # a transport that cannot carry it: the request ends, never hangs waiting
            return f"the token mask could not be sent to the engine: {exc!r}"
        return None

    def _deliver(self, result: np.ndarray | str) -> None:
        """On the event loop (transports whose producer is the loop's): the mask into the ring, or the end."""
        with self._lock:
            self._running = False
            if self.closed:
                return
            if isinstance(result, str):
                self.closed = True
            else:
                try:
                    self.put_mask(self.num_consumed, result)
                except Exception as exc:  # a transport that cannot carry it: the request ends, never hangs waiting
                    self.closed, result = True, f"the token mask could not be sent to the engine: {exc!r}"
            if not self.closed:
                if self._pending:
                    self._start()
                return
        self.on_error(result)


class MaskStats:
    """This process's mask steps, for a diagnostic log line (BLINK_MASK_STATS_S; the mask watcher calls
    `maybe_log`): how long steps waited to start (for a pool thread and a turn), computed (llguidance) and took to
    put (the ring write), and how many took over STATS_OVER_S in all. Off by default: recording takes a lock a
    step. With the GPU loop's own count of rows that waited for a mask (its loop stats line), it tells a late
    mask's cause: the queue, the grammar or the watcher (which sees the tokens before any of this)."""

    def __init__(self, period_s: float = 0.0):
        self.period_s = period_s
        self.on = period_s > 0
        self._lock = threading.Lock()
        self._next_log_s = time.monotonic() + period_s
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.queued_s = self.computed_s = self.put_s = 0.0
        self.max_queued_s = self.max_computed_s = self.max_total_s = 0.0
        self.over = [0] * len(STATS_OVER_S)

    def record(self, queued_s: float, computed_s: float, put_s: float) -> None:
        total = queued_s + computed_s + put_s
        with self._lock:
            self.steps += 1
            self.queued_s += queued_s
            self.computed_s += computed_s
            self.put_s += put_s
            self.max_queued_s = max(self.max_queued_s, queued_s)
            self.max_computed_s = max(self.max_computed_s, computed_s)
            self.max_total_s = max(self.max_total_s, total)
            for i, limit in enumerate(STATS_OVER_S):
                self.over[i] += total > limit

    def take(self) -> dict:
        """The figures since the last take, and a fresh start."""
        with self._lock:
            n = self.steps or 1
            out = {"steps": self.steps, "queued_ms_mean": 1e3 * self.queued_s / n,
                   "queued_ms_max": 1e3 * self.max_queued_s, "computed_ms_mean": 1e3 * self.computed_s / n,
                   "computed_ms_max": 1e3 * self.max_computed_s, "put_ms_mean": 1e3 * self.put_s / n,
                   "total_ms_max": 1e3 * self.max_total_s,
                   **{f"over_{int(limit * 1e3)}ms": count for limit, count in zip(STATS_OVER_S, self.over)}}
            self._reset()
        return out

    def maybe_log(self, extra: str = "") -> None:
        if not self.on or time.monotonic() < self._next_log_s:
            return
        self._next_log_s = time.monotonic() + self.period_s
        x = self.take()
        if not x["steps"]:
            return
        log.info("mask stats (pid %d): %d steps, queued mean %.2f max %.2f ms, computed mean %.2f max %.2f ms, put "
                 "mean %.3f ms, longest %.2f ms, over 2 ms %d, over 5 ms %d%s", os.getpid(), x["steps"],
                 x["queued_ms_mean"], x["queued_ms_max"], x["computed_ms_mean"], x["computed_ms_max"],
                 x["put_ms_mean"], x["total_ms_max"], x["over_2ms"], x["over_5ms"], extra)


def _stats_period() -> float:
    try:
        return MASK_STATS_S.value() or 0.0
    except ValueError as exc:
        log.warning("%s: no mask statistics", exc)
        return 0.0


STATS = MaskStats(_stats_period())
