"""bench/stream_client.py: every token of a streamed body is counted once, at the read that completed its
event, however the reads split it; a body is complete only at the chunked terminator after [DONE], and
sound only if its framing and every event are."""
from __future__ import annotations

import itertools
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from stream_client import StreamBody, StreamStats, run_streams  # noqa: E402

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(text: bytes, finish: bytes = b"null") -> bytes:
    return b'data: {"id":"cmpl-0af","choices":[{"index":0,"text":"%s","finish_reason":%s}]}\n\n' % (text, finish)


def _body(token_ids: list[int]) -> bytes:
    events = [_event(b" w%d" % t) for t in token_ids]
    end = _event(b"", b'"length"') + b"data: [DONE]\n\n"
    return HEAD + b"".join(_chunk(e) for e in events[:-1]) + b"%x\r\n%s\r\n0\r\n\r\n" % (
        len(events[-1] + end), events[-1] + end)


def _read_in_pieces(body: bytes, rng: random.Random, capacity: int) -> tuple[StreamBody, StreamStats, list[int]]:
    """Feeds `body` in random pieces (each read's time is the offset it ends at); returns where it ended."""
    stats = StreamStats(1)
    stream, pos, done = StreamBody(stats, capacity), 0, False
    while pos < len(body):
        step = rng.randint(1, 40)
        assert not done
        done = stream.feed(body[pos:pos + step], min(pos + step, len(body)))
        pos += step
    assert done
    return stream, stats, stream.parse()


def test_every_split_of_the_body_counts_each_token_once_at_the_read_that_completed_its_event():
    body, rng = _body(list(range(100, 160))), random.Random(0)
    for capacity in (64, 65536):  # a buffer that grows as it goes, one that never has to
        for _ in range(25):
            stream, stats, samples = _read_in_pieces(body, rng, capacity)
            assert stream.ok and stream.num_tokens == 60 and [t for _, t in samples] == list(range(100, 160))
            assert stream.num_events == 62 and len(stats.first_ns) == 1
            for read_end, token in samples:  # the read that completed the token's event, not an earlier one
                event_end = body.index(b"\n\n", body.index(b" w%d" % token)) + 2
                assert read_end >= event_end and (read_end - event_end) < 40


def test_the_first_token_is_seen_at_the_read_that_brings_it():
    stats = StreamStats(1)
    stream = StreamBody(stats)
    body = _body([7, 8])
    first_word = body.index(b" w7") + 3
    assert not stream.feed(body[:first_word - 1], 1) and not stats.first_ns
    assert not stream.feed(body[first_word - 1:first_word], 2) and stats.first_ns == [2]
    assert stream.feed(body[first_word:], 3) and stream.parse() and stream.ok


def test_an_error_reply_ends_the_stream_not_ok():
    stream = StreamBody(StreamStats(1))
    assert stream.feed(b'HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n{}', 0)
    assert stream.parse() == [] and not stream.ok and stream.num_tokens == 0


def test_bad_framing_or_a_bad_event_is_not_ok():
    good = _body([1, 2, 3])
    bad_size = good.replace(b"\r\n%x\r\n" % len(_event(b" w2")), b"\r\n%x\r\n" % (len(_event(b" w2")) + 1), 1)
    bad_json = good.replace(b'"text":" w2"', b'"text": w2"')
    for body in (bad_size, bad_json):
        assert body != good
        stream = StreamBody(StreamStats(1))
        stream.feed(body, 0)
        assert stream.parse() == [] and not stream.ok


def _serve_bodies(listener, stop, accepted: list | None = None) -> None:
    """A server for run_streams: each request gets a streamed body of as many tokens as its max_tokens,
    after a short wait (so that streams overlap); a connection serves requests until its client closes it
    (HTTP/1.1 keep-alive). `accepted` gets one entry per connection."""
    def answer(conn) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                        data.split(b"Content-Length: ")[1].split(b"\r\n")[0]):
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, rest = data.split(b"\r\n\r\n", 1)
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                body, data = rest[:length], rest[length:]
                time.sleep(0.02)
                conn.sendall(_body(list(range(json.loads(body)["max_tokens"]))))
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        if accepted is not None:
            accepted.append(conn)
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def test_refilled_streams_replace_each_ended_one_until_refill_s_and_ask_for_their_own_lengths():
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    server = threading.Thread(target=_serve_bodies, args=(listener, stop), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        lengths = itertools.cycle([3, 5, 8])
        bodies, stats, _ = run_streams(url, "k", {"max_tokens": 4}, 4, refill_s=0.3, lengths=lengths)
    finally:
        stop.set()
        listener.close()
    assert len(bodies) > 4  # ended streams were replaced
    assert all(b.ok and b.num_tokens == b.max_tokens for b in bodies)
    assert [b.max_tokens for b in bodies[:6]] == [3, 5, 8, 3, 5, 8][:len(bodies[:6])]
    assert len(stats.end_ns) == len(bodies) and stats.refill_end_ns == sorted(stats.end_ns)[len(bodies) - 4]


@pytest.mark.parametrize("keep_alive", [True, False])
def test_refills_go_on_the_ended_streams_connection_with_keep_alive(keep_alive):
    listener = socket.create_server(("127.0.0.1", 0))
    stop, accepted = threading.Event(), []
    threading.Thread(target=_serve_bodies, args=(listener, stop, accepted), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        bodies, _, _ = run_streams(url, "k", {"max_tokens": 4}, 3, refill_s=0.3, keep_alive=keep_alive)
    finally:
        stop.set()
        listener.close()
    assert len(bodies) > 6 and all(b.ok and b.num_tokens == 4 for b in bodies)
    assert len(accepted) == (3 if keep_alive else len(bodies))


def test_streams_over_https(tmp_path):
    """`ssl_context`: the handshakes are stepped in the epoll loop, bodies read whole through TLS."""
    import ssl
    import subprocess

    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", "key.pem", "-out", "cert.pem", "-days", "1", "-subj", "/CN=bench",
                    "-addext", "subjectAltName=IP:127.0.0.1"], cwd=tmp_path, check=True, capture_output=True)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    listener = server_context.wrap_socket(socket.create_server(("127.0.0.1", 0)), server_side=True)
    stop = threading.Event()
    threading.Thread(target=_serve_bodies, args=(listener, stop), daemon=True).start()
    try:
        url = f"https://127.0.0.1:{listener.getsockname()[1]}/v1"
        client = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        bodies, stats, _ = run_streams(url, "k", {"max_tokens": 300}, 6, ssl_context=client)
    finally:
        stop.set()
        listener.close()
    assert len(bodies) == 6 and all(b.ok and b.num_tokens == 300 for b in bodies)
    assert len(stats.tokens) == 6 * 300
