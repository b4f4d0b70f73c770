"""One request in flight: ring updates in, final text pieces out (detokenized, cut at stop strings)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from protocols.ring import ErrorCode, FinishReason

from .backends import RequestHandle
from .detokenize import TextStream
from .errors import ApiError, bad_request, server_error, unavailable

log = logging.getLogger("blink.gateway.requests")

_FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass
class Piece:
    text: str
    finish_reason: str | None = None  # "stop" or "length" on the last piece


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

    def __init__(self, handle: RequestHandle, stream: TextStream, prompt_len: int):
        self.handle = handle
        self.stream = stream
        self.prompt_len = prompt_len
        self.finish_reason: str | None = None
        self.first_token_s: float | None = None
        self._closed = False

    @property
    def completion_tokens(self) -> int:
        return self.stream.num_tokens

    async def next_piece(self) -> Piece:
        """The next non-empty piece of text, or the last one (finish_reason set). Raises ApiError."""
        while True:
            update = await self.handle.next()
            if update.tokens and self.first_token_s is None:
                self.first_token_s = time.perf_counter()
            text = self.stream.add(update.tokens)
            if self.stream.stopped:
                return self._finish(text, "stop")
            if update.finish == FinishReason.NONE:
                if text:
                    return Piece(text)
                continue
            if update.finish not in _FINISH_NAMES:
                raise self._failure(update.finish, update.error_code, update.error)
            text += self.stream.finish()
            return self._finish(text, "stop" if self.stream.stopped else _FINISH_NAMES[update.finish])

    def _finish(self, text: str, reason: str) -> Piece:
        self.finish_reason = reason
        self.handle.close()  # a stop string ends the request here: the engine is cancelled
        return Piece(text, reason)

    def _failure(self, finish: FinishReason, code: ErrorCode, message: str) -> ApiError:
        self.finish_reason = "error"
        if finish == FinishReason.CANCELLED:
            return unavailable("the engine cancelled this request (is it shutting down?)")
        return engine_error(code, message)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.handle.close()
            self._log()

    def _log(self) -> None:
        h = self.handle
        now = time.perf_counter()
        ttft_ms = (self.first_token_s - h.submitted_s) * 1e3 if self.first_token_s else float("nan")
        log.info("request %d slot %d: prompt %d, completion %d, finish %s, ttft %.1f ms, e2e %.1f ms",
                 h.spec.request_id, h.slot, self.prompt_len, self.completion_tokens,
                 self.finish_reason or "aborted", ttft_ms, (now - h.submitted_s) * 1e3)
