"""The streamed body, event by event: pre-rendered chunk templates give the schema's bytes exactly, and
tokens that arrive several per poll give the same text and the same sequence of events as one per poll.
No server: a scripted request handle feeds a real Generation, the events go to a recording response."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from gateway.choices import Choices
from gateway.detokenize import TextStream
from gateway.formats import ChatFormat, CompletionFormat
from gateway.generate import Generation
from gateway.http import STATE, _stream_pieces
from protocols.ring import FinishReason, RequestSpec, TokenLogprob
from protocols.shm import TokenUpdate

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


def test_chunk_json_with_logprobs_takes_the_schema_path(byte_tokenizer):
    from gateway.token_text import TokenTexts

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

    async def next(self) -> TokenUpdate:
        return self._updates.pop(0)

    def close(self) -> None:
        self.cancelled = bool(self._updates)


class RecordingResponse:
    def __init__(self):
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


def _batched(ids: list[int], per_poll: int, finish: FinishReason) -> list[TokenUpdate]:
    updates = [TokenUpdate(tokens=ids[i:i + per_poll], started=True) for i in range(0, len(ids), per_poll)]
    updates[-1].finish = finish
    return updates


def _stream_events(tokenizer, updates, stops=(), fmt_cls=CompletionFormat, include_usage=True):
    """(writes, last): each body write before the end, and the final write's events (then [DONE])."""
    handle = ScriptedHandle(updates)
    gen = Generation(handle, TextStream(tokenizer, stops, [1, 2]), prompt_len=2)
    choices = Choices([gen], tokenizer=None)
    fmt = fmt_cls("id-1", "m")
    resp = RecordingResponse()

    async def run():
        first = await choices.next_piece()
        return await _stream_pieces(None, resp, choices, first, fmt, include_usage)
    last = asyncio.run(run())
    choices.close()
    return resp.writes, last, handle


def _events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n\n")
    return [json.loads(e.removeprefix(b"data: ")) for e in data[:-2].split(b"\n\n")]


def _text(writes, last) -> str:
    """The streamed text, completions (`text`) or chat (`delta.content`)."""
    choices = [c for w in [*writes, last] for e in _events(w) for c in e["choices"]]
    return "".join(c["text"] if "text" in c else c["delta"].get("content", "") for c in choices)


@pytest.mark.parametrize("per_poll", [2, 3, 5, 100])
def test_several_tokens_per_poll_give_the_same_text_and_event_sequence(byte_tokenizer, per_poll):
    ids = byte_tokenizer.encode("the quick brown fox jumps over the lazy dog é🙂世界").ids
    one_writes, one_last, _ = _stream_events(byte_tokenizer, _batched(ids, 1, FinishReason.LENGTH))
    many_writes, many_last, _ = _stream_events(byte_tokenizer, _batched(ids, per_poll, FinishReason.LENGTH))
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
        assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids)}
        assert all("usage" not in e for e in events[:-1])


def test_chat_stream_role_first_then_templates(byte_tokenizer):
    ids = byte_tokenizer.encode("hello world, hello there").ids
    writes, last, _ = _stream_events(byte_tokenizer, _batched(ids, 2, FinishReason.STOP), fmt_cls=ChatFormat,
                                     include_usage=False)
    events = [e for w in [*writes, last] for e in _events(w)]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["choices"][0]["delta"]["content"]
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert _text(writes, last) == "hello world, hello there"


@pytest.mark.parametrize("per_poll", [1, 2, 4, 100])
def test_stop_string_across_a_batch_cuts_at_the_same_place(byte_tokenizer, per_poll):
    ids = byte_tokenizer.encode("hello world, hello there").ids
    writes, last, handle = _stream_events(byte_tokenizer, _batched(ids, per_poll, FinishReason.LENGTH),
                                          stops=["o w", "zz"])
    assert _text(writes, last) == "hell"
    events = _events(last)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["usage"]["completion_tokens"] <= len(ids)
    assert handle.cancelled == (per_poll < len(ids))  # a stop before the engine's end cancels it there


def test_error_mid_stream_is_the_last_event(byte_tokenizer):
    ids = byte_tokenizer.encode("hello world").ids
    updates = [TokenUpdate(tokens=ids[:2], started=True),
               TokenUpdate(finish=FinishReason.ERROR, error="boom", started=True)]
    state = SimpleNamespace(metrics=SimpleNamespace(rejected=lambda err: None))
    request = SimpleNamespace(app={STATE: state})
    handle = ScriptedHandle(updates)
    choices = Choices([Generation(handle, TextStream(byte_tokenizer, (), [1, 2]), prompt_len=2)], tokenizer=None)
    resp = RecordingResponse()

    async def run():
        first = await choices.next_piece()
        return await _stream_pieces(request, resp, choices, first, CompletionFormat("id-1", "m"), True)
    last = asyncio.run(run())
    choices.close()
    assert [_events(w)[0]["choices"][0]["text"] for w in resp.writes] == [byte_tokenizer.decode(ids[:2])]
    [error] = _events(last)
    assert "boom" in error["error"]["message"]  # no usage after an error, as before
