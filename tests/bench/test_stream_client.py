"""bench/stream_client.py: every token of a streamed body is counted once, however the reads split it,
and a body is complete only at the chunked terminator after [DONE]."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from stream_client import SseCounter, StreamStats  # noqa: E402

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _body(token_ids: list[int]) -> bytes:
    events = [b'data: {"id":"cmpl-0af","choices":[{"index":0,"text":" w%d","finish_reason":null}]}\n\n' % t
              for t in token_ids]
    end = b'data: {"id":"cmpl-0af","choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    return HEAD + b"".join(_chunk(e) for e in events[:-1]) + b"%x\r\n%s\r\n0\r\n\r\n" % (
        len(events[-1] + end), events[-1] + end)


def test_every_split_of_the_body_counts_each_token_once():
    body, rng = _body(list(range(100, 160))), random.Random(0)
    for _ in range(50):
        stats = StreamStats(1)
        counter, pos, done = SseCounter(stats), 0, False
        while pos < len(body):
            step = rng.randint(1, 40)
            assert not done
            done = counter.feed(body[pos:pos + step], pos)
            pos += step
        assert done and counter.ok and counter.num_tokens == 60 and list(stats.tokens) == list(range(100, 160))
        assert counter.num_events == 62 and len(stats.first_ns) == 1


def test_an_error_reply_ends_the_stream_not_ok():
    counter = SseCounter(StreamStats(1))
    assert counter.feed(b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n{}', 0)
    assert not counter.ok and counter.num_tokens == 0
