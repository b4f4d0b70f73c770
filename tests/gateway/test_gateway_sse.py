"""Streamed bodies written by the poller (`gateway.api.sse`), over a real HTTP connection to the in-process
gateway and echo engine: the poller writes the chunks, a slow reader stalls nobody and loses nothing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
import urllib.parse

import pytest

import gateway.api.sse as sse
from gateway.config import GatewayConfig


def _request(harness, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {harness.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


def _connect(harness, rcvbuf: int | None = None) -> socket.socket:
    url = urllib.parse.urlsplit(harness.url)
    sock = socket.socket()
    if rcvbuf:  # before connect: a small receive window makes the gateway buffer what this client leaves unread
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((url.hostname, url.port))
    return sock


def _read_body(sock: socket.socket) -> bytes:
    """The whole response, until the chunked body's terminator after [DONE]."""
    data = b""
    while not data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {data[-200:]!r}"
        data += chunk
    return data


def _texts(response: bytes) -> list[str]:
    """Each text event's text, in order (chunk framing removed)."""
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    payload = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        payload, body = payload + rest[:n], rest[n + 2:]
    events = [e.removeprefix(b"data: ") for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [c["text"] for e in events[:-1] for c in json.loads(e)["choices"]]


def _stream(harness, body: dict, rcvbuf: int | None = None) -> socket.socket:
    sock = _connect(harness, rcvbuf)
    sock.sendall(_request(harness, body))
    return sock


class _Watched:
    """A body's transport with its writes (the task that made each) and its buffer checks on record: both of a
    body's ways of writing (its task's `_write` and the poller's sink) go through `body.transport`."""

    def __init__(self, transport):
        self._transport, self.writers, self.most_buffered = transport, [], 0

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        self.writers.append(asyncio.current_task().get_name())
        self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        size = self._transport.get_write_buffer_size()
        self.most_buffered = max(self.most_buffered, size)
        return size


def _watch_bodies(monkeypatch, bodies: list, first_sndbuf: int | None = None) -> None:
    """Every SseBody made from now on gets a `_Watched` transport and goes into `bodies`."""
    init = sse.SseBody.__init__

    def watched_init(self, *args):
        init(self, *args)
        if first_sndbuf and not bodies:
            self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, first_sndbuf)
        self.transport = _Watched(self.transport)
        bodies.append(self)
    monkeypatch.setattr(sse.SseBody, "__init__", watched_init)


@pytest.fixture(scope="module")
def python_harness(start_harness, pick_free_port):
    """A gateway whose streams all take the Python path (`native_stream` off)."""
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({"k"}),
                           slot_wait_s=2.0, native_stream=False)
    return start_harness(config, "k")


def test_the_poller_writes_the_chunks(python_harness, monkeypatch):
    """After the first piece, a stream's chunks leave from the poller's task, not the stream's own."""
    harness, bodies = python_harness, []
    _watch_bodies(monkeypatch, bodies)
    prompt = harness.tokenizer.encode("hello world", add_special_tokens=False).ids
    sock = _stream(harness, {"model": harness.model, "prompt": prompt, "max_tokens": 40, "stream": True})
    texts = _texts(_read_body(sock))
    sock.close()
    assert "".join(texts) == harness.tokenizer.decode((prompt * 40)[:40])
    writers = bodies[0].transport.writers
    assert len(writers) >= 10 and sum(name.startswith("poller") for name in writers) >= len(writers) - 2, writers
    assert harness.backend.native_stream == "off (native_stream: false)"  # what /admin/status shows


def test_the_native_round_sends_a_plain_streams_chunks(harness, monkeypatch):
    """With the native round (the default), a plain stream's chunks after the first leave neither through
    the task nor through the transport: the round sends them on the socket, the client gets every one of
    them in order, and the body's byte count includes them."""
    bodies = []
    _watch_bodies(monkeypatch, bodies)
    prompt = harness.tokenizer.encode("héllo wörld 🙂", add_special_tokens=False).ids
    sock = _stream(harness, {"model": harness.model, "prompt": prompt, "max_tokens": 60, "stream": True})
    response = _read_body(sock)
    sock.close()
    texts = _texts(response)
    assert "".join(texts) == harness.tokenizer.decode((prompt * 60)[:60]) and len(texts) >= 20
    assert len(bodies[0].transport.writers) <= 3, bodies[0].transport.writers  # the first piece and the end
    assert bodies[0].writer.output_size == len(response)  # aiohttp counts the head too
    assert harness.backend.native_stream == "on" and harness.backend.num_native_streams == 0  # none left


def test_a_slow_reader_does_not_stall_other_streams_and_loses_nothing(harness, monkeypatch):
    """The first stream's client reads nothing until the others are done: the gateway buffers its chunks
    over the high-water mark (its kernel buffers made small, the mark low: the echo engine's streams are
    short), its task takes over and waits; the other streams go on, and the slow one gets every token."""
    monkeypatch.setattr(sse, "HIGH_WATER_BYTES", 512)
    bodies = []
    _watch_bodies(monkeypatch, bodies, first_sndbuf=4096)
    prompt = harness.tokenizer.encode("the quick brown fox", add_special_tokens=False).ids
    body = {"model": harness.model, "prompt": prompt, "max_tokens": 200, "stream": True}
    expected = harness.tokenizer.decode((prompt * 200)[:200])
    slow = _stream(harness, body, rcvbuf=1024)
    time.sleep(0.5)  # its 200 tokens are out of the engine, most of them waiting in the gateway
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        t0 = time.monotonic()
        others = list(pool.map(lambda _: _texts(_read_body(_stream(harness, body))), range(3)))
        others_s = time.monotonic() - t0
    assert all("".join(texts) == expected for texts in others)
    assert others_s < 3.0
    assert bodies[0].transport.most_buffered > sse.HIGH_WATER_BYTES  # the slow stream did leave the poller
    texts = _texts(_read_body(slow))
    slow.close()
    assert "".join(texts) == expected  # every token, once, in order
    harness.wait_idle()


@pytest.mark.parametrize("n", [2, 3])
def test_n_choices_stream_whole_and_in_order(harness, n):
    prompt = harness.tokenizer.encode("hello there", add_special_tokens=False).ids
    body = {"model": harness.model, "prompt": prompt, "max_tokens": 30, "stream": True, "n": n}
    sock = _stream(harness, body)
    head, _, payload = _read_body(sock).partition(b"\r\n\r\n")
    sock.close()
    texts = {i: "" for i in range(n)}
    for event in payload.split(b"\n\n"):
        if b"data: {" in event:
            for choice in json.loads(event.split(b"data: ", 1)[1])["choices"]:
                texts[choice["index"]] += choice["text"]
    assert all(text == harness.tokenizer.decode((prompt * 30)[:30]) for text in texts.values())
