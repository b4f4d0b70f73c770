"""The per-request mask loop: generated token i arrives (the poller calls `advance`), the request's matcher
takes it and computes the mask of token i + 1 on a small thread pool (llguidance releases the GIL there), and
the mask goes into the ring (`put_mask`): from the pool thread itself where the transport allows it (shm: a
write of the slot's own mask area), else back on the event loop. The engine waits for that mask before it
samples token i + 1, so a busy event loop must not sit between the mask and the ring (measured: one gateway
worker's loop at 64 constrained streams doubled their TPOT). The other streams never wait for it: nothing here
blocks the event loop.

One request's steps run one at a time, in order (its matcher is not shared); requests run side by side.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np

from .grammar import Compiled, Grammars

# Threads computing masks: llguidance's mask takes tens to hundreds of microseconds of a core per token.
MASK_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))
_pool: ThreadPoolExecutor | None = None

PutMask = Callable[[int, np.ndarray], None]  # (token index, [mask_words] uint32)
OnError = Callable[[str], None]  # the request must end with this message


def mask_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=MASK_THREADS, thread_name_prefix="grammar-mask")
    return _pool


class MaskLoop:
    """One constrained request's matcher, advanced by the tokens it generates; see the module's docstring."""

    __slots__ = ("grammars", "matcher", "put_mask", "on_error", "num_consumed", "_pending", "_running", "closed",
                 "_loop", "put_from_pool", "_lock")

    def __init__(self, grammars: Grammars, compiled: Compiled, put_mask: PutMask, on_error: OnError,
                 put_from_pool: bool = False):
        """`put_from_pool`: `put_mask` may run on the pool thread (the producer says so: shm)."""
        self.grammars = grammars
        self.matcher: llguidance.LLMatcher = compiled.new_matcher()
        self.put_mask, self.on_error, self.put_from_pool = put_mask, on_error, put_from_pool
        self._lock = threading.Lock()  # a mask being written from the pool, against `close`
        self.num_consumed = 0  # tokens the matcher has taken: the next mask is this token's
        self._pending: list[int] = []  # tokens arrived while a step ran
        self._running = False
        self.closed = False
        self._loop = asyncio.get_running_loop()

    def advance(self, token_ids: list[int]) -> None:
        """Tokens arrived (on the event loop): their mask step is queued; it never blocks here."""
        if self.closed:
            return
        self._pending += token_ids
        if not self._running:
            self._start()

    def close(self) -> None:
        """The request ended: steps still running deliver nothing. A mask a pool thread is writing is written
        before this returns, and none after (the slot may then be released and reused)."""
        with self._lock:
            self.closed = True

    def _start(self) -> None:
        tokens, self._pending, self._running = self._pending, [], True
        mask_pool().submit(self._step, tokens)

    def _step(self, token_ids: list[int]) -> None:
        """In a pool thread: consume the tokens, compute the next mask, hand it to the event loop."""
        try:
            result: np.ndarray | str | None = self.consume_and_mask(token_ids)
        except Exception as exc:  # a library failure ends this request, never the pool
            result = f"the grammar engine failed: {exc}"
        if self.put_from_pool and not isinstance(result, str):
            result = self._put_now(result)
        try:
            self._loop.call_soon_threadsafe(self._deliver, result)
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

    def _put_now(self, words: np.ndarray) -> str | None:
        """On the pool thread: the mask into the ring unless the request ended; None, or why it could not."""
        with self._lock:
            if self.closed:
                return None
            try:
                self.put_mask(self.num_consumed, words)
            except Exception as exc:  # a transport that cannot carry it: the request ends, never hangs waiting
                return f"the token mask could not be sent to the engine: {exc!r}"
        return None

    def _deliver(self, result: np.ndarray | str | None) -> None:
        """On the event loop: the mask into the ring (None: the pool thread put it), or the request's end."""
        self._running = False
        if self.closed:
            return
        if isinstance(result, str):
            self.closed = True
            self.on_error(result)
            return
        if result is not None:
            try:
                self.put_mask(self.num_consumed, result)
            except Exception as exc:  # a transport that cannot carry it: the request ends, never hangs waiting
                self.closed = True
                self.on_error(f"the token mask could not be sent to the engine: {exc!r}")
                return
        if self._pending:
            self._start()
