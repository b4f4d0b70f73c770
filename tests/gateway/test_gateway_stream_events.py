"""The streamed body, event by event: pre-rendered chunk templates give the schema's bytes exactly, and
tokens that arrive several per poll give the same text and the same sequence of events as one per poll.
No server: a scripted request handle feeds a real Generation, the events go to a recording response."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from json.encoder import encode_basestring
from types import SimpleNamespace

import pytest

from gateway.request.choices import Choices
from gateway.request.detokenize import TextStream
from gateway.api.formats import ChatFormat, CompletionFormat
from gateway.request.generate import Generation
from gateway.streaming.request_handle import RequestHandle
from gateway.api.sse import HIGH_WATER_BYTES, SseBody, _frame_parts
from protocols.ring import FinishReason, RequestSpec, TokenLogprob
from protocols.messages import TokenUpdate

TEXTS = ["a", " w12", "", '"', "\\", "\\u0041", "/", "\x00\x01\x1f\x7f", "\n\r\t\b\f", "é", "🙂", "世界",
         "\u2028\u2029", "</script>", "\ufffd", "blink-chunk-text-7d1e", '"blink-chunk-text-7d1e"',
         "".join(chr(c) for c in range(128))]
MODELS = ["m", 'odd "model" \\ name', "模型/é", 'has "blink-chunk-text-7d1e" inside']


def _pair(cls, model: str, **kw):
    """Two formats with identical state: one answers chunk_json, the other the schema's own JSON."""
    a, b = cls("id-1", model, **kw), cls("id-1", model, **kw)
    b.created = a.created
    return a, b


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cls", [ChatFormat, CompletionFormat])
def test_chunk_json_is_the_schema_json_byte_for_byte(cls, model):
    kw = {"echo": "echoed \"prompt\"\n"} if cls is CompletionFormat else {}
    fast, schema = _pair(cls, model, **kw)
    for index in (0, 1):  # n > 1: each choice its own first chunk (role or echo), then its template
        for text in TEXTS:
            assert fast.chunk_json(index, text) == schema.chunk(index, text).model_dump_json().encode()
        for reason in ("stop", "length"):
            got = fast.chunk_json(index, finish_reason=reason)
            assert got == schema.chunk(index, finish_reason=reason).model_dump_json().encode()
    if cls is CompletionFormat:
        assert fast._offsets == schema._offsets  # text_offset bookkeeping goes on under the template


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cls", [ChatFormat, CompletionFormat])
def test_the_sinks_text_event_is_the_schema_event_byte_for_byte(cls, model, byte_tokenizer):
    """The poller's sink frames a plain text event from `text_parts` (`sse._frame_parts`): not before the
    choice's first chunk, never with logprobs, else exactly the schema's event."""
    from gateway.request.token_text import TokenTexts

    fmt, schema = _pair(cls, model)
    assert fmt.text_parts(0) is None  # the first chunk (role or echo) is not made yet
    fmt.chunk_json(0, "first"), schema.chunk(0, "first")
    head, tail, fixed_len = _frame_parts(fmt.text_parts(0))
    for text in TEXTS[:2] + TEXTS[3:]:  # a text piece is never empty
        data = head + encode_basestring(text).encode() + tail
        assert data == b"data: %s\n\n" % schema.chunk(0, text).model_dump_json().encode()
        assert len(data) == fixed_len + len(encode_basestring(text).encode())
    assert cls("id-1", model, texts=TokenTexts(byte_tokenizer)).text_parts(0) is False


def test_chunk_json_with_logprobs_takes_the_schema_path(byte_tokenizer):
    from gateway.request.token_text import TokenTexts

    texts = TokenTexts(byte_tokenizer)
    for cls in (ChatFormat, CompletionFormat):
        fast, schema = _pair(cls, "m", texts=texts)
        items = [(70, TokenLogprob(-0.5, ((70, -0.5), (71, -1.5))))]
        for _ in range(2):
            assert fast.chunk_json(0, "x", logprobs=items) == \
                schema.chunk(0, "x", logprobs=items).model_dump_json().encode()


class ScriptedHandle:
    """A RequestHandle stand-in: `next` hands out scripted updates; `close` before the end is a cancel."""

    def __init__(self, updates: list[TokenUpdate]):
        self.spec = RequestSpec(7, [1, 2], 64, temperature=0.0)
        self.slot, self.submitted_s = 0, time.perf_counter()
        self._updates = list(updates)
        self.cancelled = False
        self.sink = None
        self.queue = ()  # nothing waits for the reader: `next` has it all

    async def next(self) -> TokenUpdate:
        return self._updates.pop(0)

    def close(self) -> None:
        self.cancelled = bool(self._updates)

    def go_native(self, *args) -> bool:  # stays on the Python path, which these tests are about
        return False

    def take_back(self) -> None:
        pass


class PolledHandle(RequestHandle):
    """A real RequestHandle fed as the poller feeds it (`feed`): through its sink first, then its queue."""

    def __init__(self, updates: list[TokenUpdate]):
        super().__init__(SimpleNamespace(cancel=self._cancel, go_native=lambda *args: False), 0, RequestSpec(7, [1, 2], 64, temperature=0.0))
        self._updates = list(updates)
        self.cancelled = False
        self.num_direct = 0  # updates the sink took

    def _cancel(self, handle) -> None:
        self.cancelled = True

    async def feed(self, gap: Callable[[], Awaitable[None]]) -> None:
        for update in self._updates:
            await gap()
            if self.abandoned:
                return
            if self.sink is not None and self.sink(update):
                self.num_direct += 1
            else:
                self.queue.put_nowait(update)


async def _rounds(num: int = 3) -> None:
    """The poller's next round comes after the readers it woke have run."""
    for _ in range(num):
        await asyncio.sleep(0)


class RecordingTransport:
    def __init__(self):
        self.frames: list[bytes] = []
        self.buffered = 0  # what a slow client leaves in the gateway's write buffer
        self.closing = False

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default=None):
        return default  # no socket: streams stay on the Python path


class RecordingWriter:
    """aiohttp's payload writer as SseBody uses it: chunked, its transport, drain, its byte count."""

    chunked = True

    def __init__(self):
        self.transport = RecordingTransport()
        self.output_size = 0
        self.num_drains = 0

    async def drain(self) -> None:
        self.num_drains += 1
        self.transport.buffered = 0


class RecordingResponse:
    def __init__(self):
        self.eof: bytes | None = None

    async def write_eof(self, data: bytes) -> None:
        self.eof = data


def _unframe(frame: bytes) -> bytes:
    """A chunked-encoding frame's payload (its length checked)."""
    size, rest = frame.split(b"\r\n", 1)
    assert rest.endswith(b"\r\n") and int(size, 16) == len(rest) - 2
    return rest[:-2]


def _batched(ids: list[int], per_poll: int, finish: FinishReason) -> list[TokenUpdate]:
    updates = [TokenUpdate(tokens=ids[i:i + per_poll], started=True) for i in range(0, len(ids), per_poll)]
    updates[-1].finish = finish
    return updates


def _run_body(choices: Choices, fmt, include_usage: bool, handles=(), writer=None, gap=_rounds):
    """Streams `choices` into recording fakes; `handles` (PolledHandle) are fed meanwhile.
    Returns (writes before the end, the final write without [DONE], writer)."""
    writer = writer or RecordingWriter()
    resp = RecordingResponse()

    async def run():
        feeders = [asyncio.create_task(h.feed(gap)) for h in handles]
        first = await choices.next_piece()
        await SseBody(resp, writer, choices, fmt, NO_METRICS).run(first, include_usage)
        await asyncio.gather(*feeders)
    asyncio.run(run())
    choices.close()
    assert resp.eof.endswith(b"data: [DONE]\n\n")
    writes = [_unframe(f) for f in writer.transport.frames]
    assert writer.output_size == sum(map(len, writer.transport.frames))
    return writes, resp.eof[:-len(b"data: [DONE]\n\n")], writer


NO_METRICS = SimpleNamespace(rejected=lambda err: None)


def _stream_events(tokenizer, updates, stops=(), fmt_cls=CompletionFormat, include_usage=True, direct=False):
    """(writes, last, handle): each body write before the end, the final write's events (then [DONE]).
    `direct`: fed as the poller feeds a real handle, so the sink writes what it can."""
    handle = PolledHandle(updates) if direct else ScriptedHandle(updates)
    gen = Generation(handle, TextStream(tokenizer, stops, [1, 2]), prompt_len=2)
    choices = Choices([gen], tokenizer=None)
    writes, last, _ = _run_body(choices, fmt_cls("id-1", "m"), include_usage, [handle] if direct else ())
    return writes, last, handle


def _events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n\n")
    return [json.loads(e.removeprefix(b"data: ")) for e in data[:-2].split(b"\n\n")]


def _text(writes, last) -> str:
    """The streamed text, completions (`text`) or chat (`delta.content`)."""
    choices = [c for w in [*writes, last] for e in _events(w) for c in e["choices"]]
    return "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)


@pytest.mark.parametrize("direct", [False, True], ids=["task", "direct"])
@pytest.mark.parametrize("per_poll", [2, 3, 5, 100])
def test_several_tokens_per_poll_give_the_same_text_and_event_sequence(byte_tokenizer, per_poll, direct):
    ids = byte_tokenizer.encode("the quick brown fox jumps over the lazy dog é🙂世界").ids
    one_writes, one_last, _ = _stream_events(byte_tokenizer, _batched(ids, 1, FinishReason.LENGTH), direct=direct)
    many_writes, many_last, _ = _stream_events(byte_tokenizer, _batched(ids, per_poll, FinishReason.LENGTH),
                                               direct=direct)
    assert _text(many_writes, many_last) == _text(one_writes, one_last) == \
        byte_tokenizer.decode(ids)  # whole characters, nothing lost or doubled
    for writes in (one_writes, many_writes):  # one write per poll's piece: one text event each
        assert all(len(_events(w)) == 1 and _events(w)[0]["choices"][0]["finish_reason"] is None for w in writes)
        assert all("\ufffd" not in _events(w)[0]["choices"][0]["text"] for w in writes)
    assert len(many_writes) <= -(-len(ids) // per_poll)
    for last in (one_last, many_last):  # the end as before: text, the finish chunk, then the usage chunk
        events = _events(last)
        assert [e["choices"][0]["finish_reason"] if e["choices"] else "usage" for e in events][-2:] == \
            ["length", "usage"]
        assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids),
                                      "prompt_tokens_details": {"cached_tokens": 0}}
        assert all("usage" not in e for e in events[:-1])


@pytest.mark.parametrize("stops", [(), ("o w",), ("there",)])
@pytest.mark.parametrize("per_poll", [1, 2, 5])
@pytest.mark.parametrize("cls", [ChatFormat, CompletionFormat])
def test_the_poller_writes_the_bytes_the_task_writes(byte_tokenizer, cls, per_poll, stops):
    """The sink's writes (in the poller) are the task's writes, byte for byte, and each event is the schema's
    own JSON of that chunk; the end (finish, usage, [DONE]) is the task's either way."""
    ids = byte_tokenizer.encode("hello world, hello there 🙂 the end").ids
    bodies, schema = [], cls("id-1", "m")
    schema.created = 0
    for direct in (False, True):
        handle = PolledHandle(_batched(ids, per_poll, FinishReason.LENGTH)) if direct else \
            ScriptedHandle(_batched(ids, per_poll, FinishReason.LENGTH))
        choices = Choices([Generation(handle, TextStream(byte_tokenizer, stops, [1, 2]), prompt_len=2)], tokenizer=None)
        fmt = cls("id-1", "m")
        fmt.created = 0
        writes, last, _ = _run_body(choices, fmt, True, [handle] if direct else ())
        bodies.append((writes, last))
        if direct:
            assert handle.num_direct >= len(writes) - 1  # all but the first piece came through the sink
    assert bodies[0] == bodies[1]
    for write in bodies[1][0]:
        [chunk] = _events(write)
        text = chunk["choices"][0].get("text", chunk["choices"][0].get("delta", {}).get("content"))
        assert write == b"data: %s\n\n" % schema.chunk(0, text).model_dump_json().encode()


def test_chat_stream_role_first_then_templates(byte_tokenizer):
    ids = byte_tokenizer.encode("hello world, hello there").ids
    writes, last, _ = _stream_events(byte_tokenizer, _batched(ids, 2, FinishReason.STOP), fmt_cls=ChatFormat,
                                     include_usage=False, direct=True)
    events = [e for w in [*writes, last] for e in _events(w)]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["choices"][0]["delta"]["content"]
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert _text(writes, last) == "hello world, hello there"


@pytest.mark.parametrize("direct", [False, True], ids=["task", "direct"])
@pytest.mark.parametrize("per_poll", [1, 2, 4, 100])
def test_stop_string_across_a_batch_cuts_at_the_same_place(byte_tokenizer, per_poll, direct):
    ids = byte_tokenizer.encode("hello world, hello there").ids
    writes, last, handle = _stream_events(byte_tokenizer, _batched(ids, per_poll, FinishReason.LENGTH),
                                          stops=["o w", "zz"], direct=direct)
    assert _text(writes, last) == "hell"
    events = _events(last)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["usage"]["completion_tokens"] <= len(ids)
    assert handle.cancelled == (per_poll < len(ids))  # a stop before the engine's end cancels it there


@pytest.mark.parametrize("direct", [False, True], ids=["task", "direct"])
def test_error_mid_stream_is_the_last_event(byte_tokenizer, direct):
    ids = byte_tokenizer.encode("hello world").ids
    updates = [TokenUpdate(tokens=ids[:1], started=True), TokenUpdate(tokens=ids[1:2], started=True),
               TokenUpdate(finish=FinishReason.ERROR, error="boom", started=True)]
    handle = PolledHandle(updates) if direct else ScriptedHandle(updates)
    choices = Choices([Generation(handle, TextStream(byte_tokenizer, (), [1, 2]), prompt_len=2)], tokenizer=None)
    writes, last, _ = _run_body(choices, CompletionFormat("id-1", "m"), True, [handle] if direct else ())
    assert "".join(_events(w)[0]["choices"][0]["text"] for w in writes) == byte_tokenizer.decode(ids[:2])
    [error] = _events(last)
    assert "boom" in error["error"]["message"]  # no usage after an error, as before


def test_a_slow_client_moves_its_stream_to_the_task_and_loses_nothing(byte_tokenizer):
    """Over the high-water mark the sink declines; the task writes, waits for the drain, and the sink takes
    over again: every token arrives once, in order."""
    ids = byte_tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3).ids
    handle = PolledHandle(_batched(ids, 1, FinishReason.LENGTH))
    choices = Choices([Generation(handle, TextStream(byte_tokenizer, (), [1, 2]), prompt_len=2)], tokenizer=None)
    writer, num_updates = RecordingWriter(), [0]

    async def gap():  # every 10th update finds the client's buffer full
        await _rounds()
        num_updates[0] += 1
        writer.transport.buffered = HIGH_WATER_BYTES + 1 if num_updates[0] % 10 == 0 else writer.transport.buffered
    writes, last, _ = _run_body(choices, CompletionFormat("id-1", "m"), True, [handle], writer, gap)
    assert _text(writes, last) == byte_tokenizer.decode(ids)
    assert writer.num_drains >= 2 and 0 < handle.num_direct < len(ids) - 2


def test_a_closed_connection_takes_nothing_in_the_poller(byte_tokenizer):
    ids = byte_tokenizer.encode("hello world").ids
    handle = PolledHandle([])
    gen = Generation(handle, TextStream(byte_tokenizer, (), [1, 2]), prompt_len=2)
    body = SseBody(RecordingResponse(), RecordingWriter(), Choices([gen], tokenizer=None), CompletionFormat("i", "m"))
    body._attach()
    body.transport.closing = True
    assert not handle.sink(TokenUpdate(tokens=ids[:1], started=True))
    body._detach()
    assert handle.sink is None
