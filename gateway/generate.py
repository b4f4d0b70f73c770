"""One request in flight: ring updates in, final text pieces out (detokenized, cut at stop strings)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from protocols.ring import ErrorCode, FinishReason, TokenLogprob

from .backends import RequestHandle
from .detokenize import TextStream
from .errors import ApiError, bad_request, server_error, unavailable
from .metrics import Metrics

log = logging.getLogger("blink.gateway.requests")

_FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# The client's own doing: another backend of the same model would answer the same.
_CLIENT_ERRORS = (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_PARAMS, ErrorCode.NO_KV_CAPACITY)
# Given the failed handle and the error, a handle on another backend, or None when none is left.
Failover = Callable[[RequestHandle, str], Awaitable[RequestHandle | None]]


@dataclass
class Piece:
    text: str
    finish_reason: str | None = None  # "stop" or "length" on the last piece
    token_ids: list[int] = field(default_factory=list)  # the tokens this text came from
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asked


def engine_error(code: ErrorCode, message: str) -> ApiError:
    """A finish of ERROR as the client should see it: their fault (400), overload (503) or ours (500)."""
    text = f"the engine failed this request: {message or code.name}"
    if code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_PARAMS, ErrorCode.NO_KV_CAPACITY):
        return bad_request(text, code=code.name.lower())
    if code == ErrorCode.ENGINE_STOPPING:
        return unavailable(text)
    return server_error(text)


class Generation:
    """Reads one request's updates; `next_piece` until a piece carries a finish reason, then `close`.

    `close` must run whatever happens (client gone, error, stop string): an unfinished request is
    cancelled in the engine and its slot is released by the poller once the engine confirms.
    """

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
        self._closed = False

    @property
    def request_id(self) -> int:
        return self.handle.spec.request_id

    @property
    def completion_tokens(self) -> int:
        return self.stream.num_tokens

    async def next_piece(self) -> Piece:
        """The next non-empty piece of text, or the last one (finish_reason set). Raises ApiError."""
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        while True:
            update = await self.handle.next()
            if update.tokens:
                self.last_token_s = time.perf_counter()
                self.first_token_s = self.first_token_s or self.last_token_s
            num_before = self.stream.num_tokens
            tokens = self._within_budget(update.tokens)
            text = self.stream.add(tokens)
            num_used = self.stream.num_tokens - num_before  # none after a stop string
            ids += tokens[:num_used]
            lps += update.logprobs[:num_used]
            if self.stream.stopped:
                return self._finish(text, "stop", ids, lps)
            if len(tokens) < len(update.tokens) or (update.finish == FinishReason.NONE and self._budget_spent):
                return self._finish(text + self.stream.finish(), "length", ids, lps)
            if update.finish == FinishReason.NONE:
                if text:
                    return Piece(text, None, ids, lps)
                continue
            if update.finish not in _FINISH_NAMES:
                if await self._failed_over(update):
                    continue
                raise self._failure(update.finish, update.error_code, update.error)
            text += self.stream.finish()
            return self._finish(text, "stop" if self.stream.stopped else _FINISH_NAMES[update.finish], ids, lps)

    def _within_budget(self, tokens: list[int]) -> list[int]:
        if self.budget_tokens is None:
            return tokens
        return tokens[:max(0, self.budget_tokens - self.stream.num_tokens)]

    @property
    def _budget_spent(self) -> bool:
        return self.budget_tokens is not None and self.stream.num_tokens >= self.budget_tokens

    async def _failed_over(self, update) -> bool:
        """Before the first token, a backend's failure (not the client's) moves the request to another."""
        if self.failover is None or self.first_token_s is not None or update.error_code in _CLIENT_ERRORS:
            return False
        handle = await self.failover(self.handle, update.error or update.error_code.name)
        if handle is None:
            return False
        self.handle.close()
        self.handle = handle
        return True

    def _finish(self, text: str, reason: str, ids: list[int], lps: list[TokenLogprob]) -> Piece:
        self.finish_reason = reason
        self.handle.close()  # a stop string ends the request here: the engine is cancelled
        return Piece(text, reason, ids, lps)

    def _failure(self, finish: FinishReason, code: ErrorCode, message: str) -> ApiError:
        self.finish_reason = "error"
        if finish == FinishReason.CANCELLED:
            return unavailable("the engine cancelled this request (is it shutting down?)")
        return engine_error(code, message)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.handle.close()
            end_s = time.perf_counter()
            reason = self.finish_reason or "abort"
            if self.on_close is not None:
                self.on_close(self.completion_tokens)
            if self.metrics is not None and reason != "error":  # errors count as rejections
                self.metrics.request_finished(self.model, self.prompt_len, self.completion_tokens, reason,
                                              self.arrival_s, self.first_token_s, self.last_token_s, end_s)
            self._log(reason, end_s)

    def _log(self, reason: str, end_s: float) -> None:
        ttft_ms = round((self.first_token_s - self.arrival_s) * 1e3, 1) if self.first_token_s else None
        fields = {"request_id": self.request_id, "slot": self.handle.slot, "model": self.model,
                  "prompt_tokens": self.prompt_len, "completion_tokens": self.completion_tokens,
                  "finish_reason": reason, "ttft_ms": ttft_ms,
                  "queue_ms": round((self.handle.submitted_s - self.arrival_s) * 1e3, 1),
                  "e2e_ms": round((end_s - self.arrival_s) * 1e3, 1)}
        log.info("request %d slot %d: prompt %d, completion %d, finish %s, ttft %s ms, e2e %.1f ms",
                 self.request_id, self.handle.slot, self.prompt_len, self.completion_tokens, reason,
                 ttft_ms, fields["e2e_ms"], extra=fields)
