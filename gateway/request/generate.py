"""One request in flight: ring updates in, final text pieces out (detokenized, cut at stop strings)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from protocols.ring import ErrorCode, FinishReason, TokenLogprob
from protocols.messages import TokenUpdate

from ..errors import ApiError, bad_request, server_error, unavailable
from ..metrics import Metrics
from ..streaming.poller import poll_checkpoint
from ..streaming.request_handle import RequestHandle
from .detokenize import TextStream

log = logging.getLogger("blink.gateway.requests")

_FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# The client's own doing: another backend of the same model would answer the same.
_CLIENT_ERRORS = (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_PARAMS, ErrorCode.NO_KV_CAPACITY)


class Failover(Protocol):
    """Where a request goes next (`gateway/request/pipeline.py`'s `Failover`)."""

    async def __call__(self, failed: RequestHandle, reason: str) -> RequestHandle | None:
        """Given the failed handle and the error, a handle on another backend, or None when none is left."""

    def cached(self, handle: RequestHandle, cached_tokens: int) -> None:
        """The engine reused `cached_tokens` of the prompt where `handle` ran."""


@dataclass(slots=True)
class Piece:
    text: str
    finish_reason: str | None = None  # "stop" or "length" on the last piece
    token_ids: list[int] = field(default_factory=list)  # the tokens this text came from
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asked


class _MayFailOver(Exception):
    """`take` met a failure that `next_piece` may move to another backend (an await `take` cannot do)."""


def engine_error(code: ErrorCode, message: str) -> ApiError:
    """A finish of ERROR as the client should see it: their fault (400), overload (503) or ours (500)."""
    text = f"the engine failed this request: {message or code.name}"
    if code in _CLIENT_ERRORS:
        return bad_request(text, code=code.name.lower())
    if code == ErrorCode.ENGINE_STOPPING:
        return unavailable(text)
    return server_error(text)


class Generation:
    """Reads one request's updates; `next_piece` until a piece carries a finish reason, then `close`.

    `close` must run whatever happens (client gone, error, stop string): an unfinished request is
    cancelled in the engine and its slot is released by the poller once the engine confirms.
    """

    # The poller reads and writes these per token of every stream (`take`): slots keep each object's
    # fields in one place (hundreds of streams' state do not stay in the caches between two tokens).
    __slots__ = ("handle", "budget_tokens", "on_close", "failover", "stream", "prompt_len", "model", "metrics",
                 "arrival_s", "finish_reason", "first_token_s", "last_token_s", "cached_tokens", "_held", "_ids", "_lps",
                 "_closed")

    def __init__(self, handle: RequestHandle, stream: TextStream, prompt_len: int, model: str = "",
                 metrics: Metrics | None = None, arrival_s: float | None = None, budget_tokens: int | None = None,
                 on_close: Callable[[int], None] | None = None, failover: Failover | None = None):
        self.handle = handle
        # A key's completion budget: reaching it ends the stream with "length" and cancels the engine's request.
        self.budget_tokens = budget_tokens
        self.on_close = on_close  # called once with the completion token count (quota accounting)
        self.failover = failover  # retries a request that failed before its first token
        self.stream = stream
        self.prompt_len = prompt_len
        self.model = model
        self.metrics = metrics
        self.arrival_s = handle.submitted_s if arrival_s is None else arrival_s  # perf_counter s
        self.finish_reason: str | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.cached_tokens = 0  # prompt tokens the engine reused from its prefix cache (TokenUpdate.cached_tokens)
        self._held: Piece | BaseException | None = None  # see `hold`
        self._ids: list[int] = []  # tokens taken since the last piece (no text yet: half a character)
        self._lps: list[TokenLogprob] = []  # and their logprobs
        self._closed = False

    @property
    def request_id(self) -> int:
        return self.handle.spec.request_id

    @property
    def completion_tokens(self) -> int:
        return self.stream.num_tokens

    async def next_piece(self) -> Piece:
        """The next non-empty piece of text, or the last one (finish_reason set). Raises ApiError."""
        while True:
            if self._held is not None:
                held, self._held = self._held, None
                if isinstance(held, BaseException):
                    raise held
                return held
            update = await self.handle.next()
            if update is None:  # woken for a held piece
                continue
            try:
                piece = self.take(update)
            except _MayFailOver:
                if await self._failed_over(update):
                    continue
                raise self._failure(update.finish, update.error_code, update.error) from None
            if piece is not None:
                return piece

    def take(self, update: TokenUpdate) -> Piece | None:
        """One update in: the piece it completes (the last one with finish_reason set), or None while its
        tokens make no text yet. Synchronous, so that the poller can run it (see `hold`). Raises ApiError
        for an engine failure, `_MayFailOver` when another backend may still take the request."""
        tokens, stream = update.tokens, self.stream
        if tokens:
            self.last_token_s = now_s = time.perf_counter()
            if not self.first_token_s:
                self.first_token_s = now_s
                self.cached_tokens = update.cached_tokens  # known once the prefill is done
        num_before = stream.num_tokens
        if self.budget_tokens is not None:
            tokens = tokens[:max(0, self.budget_tokens - num_before)]
        text = stream.add(tokens)
        num_used = stream.num_tokens - num_before  # none after a stop string
        if num_used:
            self._ids += tokens if num_used == len(tokens) else tokens[:num_used]
            if update.logprobs:
                self._lps += update.logprobs[:num_used]
        if stream.stopped:
            return self._finish(text, "stop")
        budget = self.budget_tokens  # once per update: the key's budget reached ends the stream
        if len(tokens) < len(update.tokens) or (not update.finish and budget is not None and stream.num_tokens >= budget):
            return self._finish(text + stream.finish(), "length")
        if not update.finish:  # FinishReason.NONE is 0
            if not text:
                return None
            piece = Piece(text, None, self._ids, self._lps)  # `_piece`, inlined: once per token streamed
            self._ids, self._lps = [], []
            return piece
        self.cached_tokens = max(self.cached_tokens, update.cached_tokens)
        if update.finish not in _FINISH_NAMES:
            if self._may_fail_over(update):
                raise _MayFailOver
            raise self._failure(update.finish, update.error_code, update.error)
        text += self.stream.finish()
        return self._finish(text, "stop" if self.stream.stopped else _FINISH_NAMES[update.finish])

    def _piece(self, text: str, finish_reason: str | None = None) -> Piece:
        """The text with the tokens (and logprobs) taken since the last piece."""
        piece = Piece(text, finish_reason, self._ids, self._lps)
        self._ids, self._lps = [], []
        return piece

    def hold(self, item: Piece | BaseException) -> None:
        """A piece (or error) that `take` made outside `next_piece`, for its reader: `next_piece` returns
        (or raises) it next, and a reader waiting there is woken."""
        self._held = item
        self.handle.queue.wake()

    @property
    def in_order(self) -> bool:
        """Nothing of this request waits for its reader: an update taken now would be the next one out."""
        return self._held is None and not self.handle.queue

    def _may_fail_over(self, update: TokenUpdate) -> bool:
        """Before the first token, a backend's failure (not the client's) may move the request to another."""
        return self.failover is not None and self.first_token_s is None and update.error_code not in _CLIENT_ERRORS

    async def _failed_over(self, update: TokenUpdate) -> bool:
        handle = await self.failover(self.handle, update.error or update.error_code.name)
        if handle is None:
            return False
        handle.sink = self.handle.sink
        self.handle.close()
        self.handle = handle
        return True

    def _finish(self, text: str, reason: str) -> Piece:
        self.finish_reason = reason
        self.handle.close()  # a stop string ends the request here: the engine is cancelled
        return self._piece(text, reason)

    def _failure(self, finish: FinishReason, code: ErrorCode, message: str) -> ApiError:
        self.finish_reason = "error"
        if finish == FinishReason.CANCELLED:
            return unavailable("the engine cancelled this request (is it shutting down?)")
        return engine_error(code, message)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.handle.close()
            poll_checkpoint()  # the stream's end was written in this pass; its accounting follows
            end_s = time.perf_counter()
            reason = self.finish_reason or "abort"
            if self.on_close is not None:
                self.on_close(self.completion_tokens)
            if self.metrics is not None and reason != "error":  # errors count as rejections
                self.metrics.request_finished(self.model, self.prompt_len, self.completion_tokens, reason,
                                              self.arrival_s, self.first_token_s, self.last_token_s, end_s)
            if self.first_token_s is not None:  # prefilled: what the engine reused is known
                self._prefix_cache_report()
            self._log(reason, end_s)

    def _prefix_cache_report(self) -> None:
        """Hits and queries (vLLM's meaning, in tokens) for the metrics; the engine's answer for routing's check."""
        if self.metrics is not None and self.handle.backend.info.prefix_caching:  # vLLM counts cached engines only
            self.metrics.prefix_cache_used(self.model, self.prompt_len, self.cached_tokens)
        if self.failover is not None:
            self.failover.cached(self.handle, self.cached_tokens)

    def _log(self, reason: str, end_s: float) -> None:
        if not log.isEnabledFor(logging.INFO):  # its fields are built per request: not for nothing
            return
        ttft_ms = round((self.first_token_s - self.arrival_s) * 1e3, 1) if self.first_token_s else None
        fields = {"request_id": self.request_id, "slot": self.handle.slot, "model": self.model,
                  "prompt_tokens": self.prompt_len, "completion_tokens": self.completion_tokens,
                  "cached_tokens": self.cached_tokens, "finish_reason": reason, "ttft_ms": ttft_ms,
                  "queue_ms": round((self.handle.submitted_s - self.arrival_s) * 1e3, 1),
                  "e2e_ms": round((end_s - self.arrival_s) * 1e3, 1)}
        ttft = "no token" if ttft_ms is None else f"ttft {ttft_ms} ms"  # None: it ended before a first token
        log.info("request %d slot %d: prompt %d, completion %d, finish %s, %s, e2e %.1f ms",
                 self.request_id, self.handle.slot, self.prompt_len, self.completion_tokens, reason,
                 ttft, fields["e2e_ms"], extra=fields)
