"""A streamed response's body: each choice's pieces as server-sent events on the client's connection.

One body, two ways in. The handler's task writes the first piece, then gives each choice's request a
`sink`: from then on the backend's poller hands every update to it, and the sink detokenizes it and
writes its chunk to the socket right there, with no task woken and no coroutine resumed per token. The
sink declines an update (it goes into the request's queue and the task takes it, as every other reader
does) whenever writing it there would change what the client sees or would have to wait:
- the stream's end: finish chunks, usage and [DONE] go out in the task's one final write (a last piece
  the sink made, a stop string or a key's budget reached, is `hold`-en for the task);
- an engine's finish or failure (errors as an event; failover);
- a slow client: its connection buffers over HIGH_WATER_BYTES in the gateway, so the task writes and
  waits for it to drain while the poller and the other streams go on; its updates wait in its queue;
- anything of the stream still waiting for the task (so chunks stay in order), and with n > 1 a piece of
  another choice that the task has not written yet.
Both ways write through `_write`, one transport write per piece, framed as aiohttp frames a chunked body.

A third way for a plain stream (one choice, no stop strings, no logprobs): once nothing of it waits for the
task and its connection holds no unsent bytes, the body hands it to its backend's native round
(`gateway/streaming/stream_round.py`), which sends the same frames on the socket itself; whatever the round hands back
(the finish, a slow client, anything unusual) comes through the sink as above, after `_take_back_fn` has
put what the round did into the stream's state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from json.encoder import encode_basestring

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from protocols.messages import TokenUpdate

from ..errors import ApiError
from ..metrics import Metrics
from ..request.choices import Choices
from ..request.generate import Generation, Piece
from ..streaming.poller import poll_checkpoint
from ..streaming.stream_round import Taken
from .formats import OutputFormat

log = logging.getLogger("blink.gateway.http")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A connection holding more unsent bytes than this in the gateway has a client that reads too slowly: its
# stream leaves the poller for its task, which waits for the socket to drain (asyncio's default high water).
HIGH_WATER_BYTES = 64 * 1024
DONE = b"data: [DONE]\n\n"


class SseBody:
    """The body of one streamed response, after `prepare` (`writer` is what `prepare` returned)."""

    def __init__(self, resp: web.StreamResponse, writer: AbstractStreamWriter, choices: Choices,
                 fmt: OutputFormat, metrics: Metrics | None = None):
        self.resp, self.writer, self.choices, self.fmt, self.metrics = resp, writer, choices, fmt, metrics
        self.transport = writer.transport
        self.chunked = writer.chunked  # HTTP/1.1: chunked encoding; 1.0: the body runs to the close
        self._attached = False
        self._native_target: tuple[int, bytes, bytes] | bool | None = None  # see `_go_native`
        send_headers = getattr(writer, "send_headers", None)  # aiohttp >= 3.12 holds them for the first write
        if send_headers is not None:
            send_headers()

    async def run(self, first: tuple[int, Piece], include_usage: bool) -> None:
        """Writes every piece (from `first` on) and the end; returns once the body is complete."""
        try:
            last = await self._pieces(first, include_usage)
            self._detach()
            poll_checkpoint()  # the response's head and first piece, or its last piece, took this pass so far
            await _write_end(self, last + DONE)
        except ConnectionResetError:
            log.info("client went away during request %d: cancelling it", self.choices.request_id,
                     extra={"request_id": self.choices.request_id})
        finally:
            self._detach()

    async def _pieces(self, item: tuple[int, Piece] | None, include_usage: bool) -> bytes:
        """The task's way: writes each piece's events as it comes (one write each); returns the events of
        the last piece and the usage (or the error event), which go out with [DONE] in the final write."""
        last = b""
        try:
            while item is not None:
                index, piece = item
                events = piece_events(self.fmt, index, piece)
                if self.choices.finished:
                    last = events
                    break
                if events:
                    _write(self, events)
                    if self.transport.get_write_buffer_size() > HIGH_WATER_BYTES:
                        await self.writer.drain()  # a slow client: wait here, not in the poller
                self._attach()
                item = await self.choices.next_piece()
        except ApiError as err:  # headers are gone: the error travels as an event
            log.warning("request %d failed mid-stream: %s", self.choices.request_id, err,
                        extra={"request_id": self.choices.request_id})
            if self.metrics is not None:
                self.metrics.rejected(err)
            return event(err.body().model_dump_json().encode())
        if include_usage:
            usage = self.fmt.usage_chunk(self.choices.prompt_len, self.choices.completion_tokens,
                                         self.choices.cached_tokens)
            last += event(usage.model_dump_json().encode())
        return last

    # ---------------------------------------------------------------- the poller's way
    def _attach(self) -> None:
        if not self._attached and not getattr(self.fmt, "streams_in_task", False):
            self._attached = True
            for index, gen in enumerate(self.choices.gens):
                gen.handle.sink = self._sink(index, gen)
            if self._may_go_native():
                self._go_native(self.choices.gens[0])

    def _detach(self) -> None:
        if self._attached:
            self._attached = False
            for gen in self.choices.gens:
                gen.handle.take_back()
                gen.handle.sink = None

    # ---------------------------------------------------------------- the native round's way
    def _may_go_native(self) -> bool:
        """One choice whose text another reader could go on with (no stop strings or logprobs), on a
        connection the round can write to: what does not change while the body runs."""
        gens = self.choices.gens
        return len(gens) == 1 and gens[0].stream.can_hand_over and self.fmt.text_parts(0) is not False \
            and self.transport is not None and self.transport.get_extra_info("sslcontext") is None  # TLS: never

    def _go_native(self, gen: Generation) -> None:
        """Hand the stream to its backend's native round when nothing of it waits for the task and its
        connection holds no unsent bytes (the round writes to the socket itself)."""
        transport = self.transport
        if not gen.in_order or transport.is_closing() or transport.get_write_buffer_size():
            return
        if self._native_target is None:  # the socket and the chunk's template, found once
            parts, sock = _frame_parts(self.fmt.text_parts(0)), transport.get_extra_info("socket")
            if parts is None:
                return  # the choice's first chunk is not made yet
            self._native_target = (sock.fileno(), parts[0], parts[1]) if parts and sock is not None else False
        if self._native_target:
            fd, head, tail = self._native_target
            gen.handle.go_native(fd, self.chunked, head, tail, gen.budget_tokens, gen.stream.num_tokens,
                                 gen.stream.hand_over, self._take_back_fn(gen))

    def _take_back_fn(self, gen: Generation):
        def take_back(taken: Taken) -> None:
            """What the native round did with the stream goes where the Python path keeps it."""
            gen.stream.take_over(taken.num_tokens, taken.pending)
            if taken.last_token_ns:
                gen.last_token_s = taken.last_token_ns / 1e9  # perf_counter_ns: the same clock as perf_counter
            self.writer.output_size += taken.bytes_sent + len(taken.unsent)
            if taken.unsent:  # the rest of a chunk the socket took in part: before anything else
                self.transport.write(taken.unsent)
        return take_back

    def _sink(self, index: int, gen: Generation) -> Callable[[TokenUpdate], bool]:
        # The poller's hot path (once per token per stream): everything it reads is bound here once, and a
        # plain text piece goes out as one formatted frame (event and chunked framing in one step).
        transport, writer, chunked, fmt, choices = self.transport, self.writer, self.chunked, self.fmt, self.choices
        if transport is None:
            return lambda update: False  # no connection to write to: the task takes every update
        is_closing, buffered, take, chunk_json = (transport.is_closing, transport.get_write_buffer_size,
                                                  gen.take, fmt.chunk_json)
        write, several = transport.write, len(choices.gens) > 1
        go_native = functools.partial(self._go_native, gen) if self._may_go_native() else None
        frame_parts = None  # see `_frame_parts`: None until the format has this choice's text template

        def sink(update: TokenUpdate) -> bool:
            """Runs in the poller: True once the update's events (if any) are written, False to queue it."""
            nonlocal frame_parts
            # Not writable now: a finish (FinishReason.NONE is 0) is the task's; so is
            # anything after a piece still waiting for the task (this choice's, or with n > 1 another's),
            # a closing connection and a slow client's.
            if (update.finish or gen._held is not None or gen.handle.queue or (several and not choices.in_order)
                    or is_closing() or buffered() > HIGH_WATER_BYTES):
                return False
            try:
                piece = take(update)
                if piece is not None:
                    if piece.finish_reason:
                        gen.hold(piece)  # the end is the task's
                    elif piece.logprobs:
                        _write(self, piece_events(fmt, index, piece))
                    elif piece.text:  # `piece_events` of a plain text piece, framed as `_write` frames it
                        if frame_parts is None:
                            frame_parts = _frame_parts(fmt.text_parts(index))
                        if frame_parts:  # the chunk from its template, event and chunked framing in one step
                            head, tail, fixed_len = frame_parts
                            text = encode_basestring(piece.text).encode()
                            frame = (b"%x\r\n%s%s%s\r\n" % (len(text) + fixed_len, head, text, tail) if chunked
                                     else head + text + tail)
                        else:
                            chunk = chunk_json(index, piece.text)
                            frame = b"%x\r\ndata: %s\n\n\r\n" % (len(chunk) + 8, chunk) if chunked else b"data: %s\n\n" % chunk
                        writer.output_size += len(frame)
                        write(frame)
                        if go_native is not None and not buffered():
                            go_native()
            except Exception as exc:  # never into the poller (it would fail every request): to the reader
                log.exception("request %d: streaming a piece failed", self.choices.request_id)
                gen.hold(exc)
            return True
        return sink


def _frame_parts(parts: tuple[bytes, bytes] | bool | None) -> tuple[bytes, bytes, int] | bool | None:
    """`OutputFormat.text_parts` as a plain text event's: (before the JSON string, after it, the event's
    length without it). None and False as there (not yet; never)."""
    if not parts:
        return parts
    before, after = parts
    return b"data: " + before, after + b"\n\n", len(before) + len(after) + 8


def piece_events(fmt: OutputFormat, index: int, piece: Piece) -> bytes:
    """The SSE events of one piece: its text (and logprobs) chunk, then its finish chunk (or what a format
    of its own makes of the piece: tool calls)."""
    own = getattr(fmt, "piece_events", None)
    if own is not None:
        return own(index, piece)
    events = b""
    if piece.text or piece.logprobs:
        logprobs = list(zip(piece.token_ids, piece.logprobs)) if piece.logprobs else ()
        events = event(fmt.chunk_json(index, piece.text, logprobs=logprobs))
    if piece.finish_reason:
        events += event(fmt.chunk_json(index, finish_reason=piece.finish_reason))
    return events


def event(chunk_json: bytes) -> bytes:
    return b"data: %s\n\n" % chunk_json


def _write(body: SseBody, data: bytes) -> None:
    """Every byte of a stream's body before its end goes out here: one transport write per call, framed as
    aiohttp frames a chunked body (its writer counts the bytes)."""
    if body.transport is None or body.transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
    frame = b"%x\r\n%s\r\n" % (len(data), data) if body.chunked else data
    body.writer.output_size += len(frame)
    body.transport.write(frame)


async def _write_end(body: SseBody, data: bytes) -> None:
    """The end of a stream's body: its last events with the chunked-encoding terminator, one write."""
    await body.resp.write_eof(data)
