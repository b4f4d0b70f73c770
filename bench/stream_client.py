"""BENCHMARK-ONLY streaming client for `bench/ring_traffic.py stream`: N concurrent streamed completions,
one TCP connection each, read with one epoll loop, as cheap as a client can be while it keeps every byte.

It shares a core with the traffic generator, so it must not hold it up: no HTTP library, no event loop,
no JSON and no parsing while streams run. Each read goes straight into its stream's own buffer
(`recv_into`), and the client notes where the read ended and when; until a stream's first token it also
looks for the response head and the first token word (`w123`, the ring-traffic vocabulary), after that
only whether the body now ends with [DONE] and the chunked terminator. Everything else waits for the end
of the run (`StreamBody.parse`): the chunked framing, every event as JSON, the tokens in the event texts
and each one's receipt time (the read that completed its event).

`refill_s` > 0: for that long from the start, a stream that ends is replaced by a new one on a new connection
(`keep_alive`: on the same connection, as a client with a connection pool sends its next request), so the
streams stay open in number while requests start and end at the workload's own pace (with `max_tokens`
varied per stream, `lengths`, the ends spread out after the first generation). `StreamStats.refill_end_ns` is
the first end that was not replaced: until then every stream slot was open.

`tick_s` > 0: the client sleeps `tick_s` between rounds and then reads whatever arrived (never blocked in
epoll): a gateway's write then finds no reader to wake on another core, as with a client on another host;
0: it blocks in epoll and each write wakes it (on loopback the sender pays for that wake-up).

`ssl_context`: HTTPS. Each connection's TLS handshake is stepped in the same epoll loop (never blocking
another stream); then reads go through the SSL object (`recv_into` as before), and a read that leaves
decrypted bytes buffered (a record larger than the buffer's room) is followed by another at once, since
epoll cannot see those.
"""
from __future__ import annotations

import array
import bisect
import json
import re
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

WORD = re.compile(rb"w(\d+)")
TEXT = re.compile(r'w(\d+)')
HEAD_END = b"\r\n\r\n"
DONE = b"data: [DONE]\n\n"
LAST_CHUNK = b"\r\n0\r\n\r\n"  # after [DONE]: the end of its chunk, then the terminating chunk
END = DONE + LAST_CHUNK
BODY_BYTES_PER_TOKEN = 320  # a buffer's first size per token asked for (a chunk is about 200 bytes); it grows if short


class StreamStats:
    """What every stream's reads add up to: (receipt ns, token id) per token (filled by `parse`), first-token
    and end times (as the reads happen)."""

    def __init__(self, num_streams: int, on_all_started: Callable[[StreamStats], None] | None = None,
                 on_first_end: Callable[[StreamStats], None] | None = None):
        self.times_ns, self.tokens = array.array("q"), array.array("q")
        self.first_ns: list[int] = []
        self.end_ns: list[int] = []  # when each stream's body was complete
        self.t0_ns = 0  # when the first stream was opened
        self.num_streams = num_streams
        self.on_all_started = on_all_started  # called once, when the last stream gets its first token
        self.on_first_end = on_first_end  # called once, when the first stream is complete and not replaced
        self.refill_end_ns = 0  # when the first stream ended that was not replaced

    def ended(self, now_ns: int, replaced: bool = False) -> None:
        self.end_ns.append(now_ns)
        if not replaced and not self.refill_end_ns:
            self.refill_end_ns = now_ns
            if self.on_first_end is not None:
                self.on_first_end(self)

    def first_token(self, now_ns: int) -> None:
        self.first_ns.append(now_ns)
        if len(self.first_ns) == self.num_streams and self.on_all_started is not None:
            self.on_all_started(self)


class StreamBody:
    """One streamed completion's response, every byte kept: `add` after each read (True once the body is
    complete, the reply is an error or the peer closed), `parse` once the run is over."""

    __slots__ = ("stats", "buf", "view", "size", "reads", "head_end", "started", "num_tokens", "num_events", "ok",
                 "max_tokens")

    def __init__(self, stats: StreamStats, capacity: int = 65536, max_tokens: int = 0):
        self.stats = stats
        self.max_tokens = max_tokens  # what its request asked for
        self.buf = bytearray(capacity)
        self.view = memoryview(self.buf)
        self.size = 0  # bytes read so far
        self.reads = array.array("q")  # per read: the buffer's size after it, monotonic ns
        self.head_end = -1  # where the body starts, once the head is complete
        self.started = False  # its first token was read
        self.num_tokens = self.num_events = 0  # by `parse`
        self.ok = False  # by `parse`: a 200, framing and every event sound, [DONE] and the terminator last

    def recv(self, sock: socket.socket, clock: Callable[[], int]) -> bool:
        """Reads what the socket holds into the buffer (the hot path: one syscall, no bytes object)."""
        if self.size == len(self.buf):
            self._grow()
        try:
            n = sock.recv_into(self.view[self.size:])
        except ssl.SSLWantReadError:  # TLS: only part of a record has arrived
            return False
        return self.add(n, clock()) if n else True

    def feed(self, data: bytes, now_ns: int) -> bool:
        """`recv` from bytes in hand (tests)."""
        while self.size + len(data) > len(self.buf):
            self._grow()
        self.buf[self.size:self.size + len(data)] = data
        return self.add(len(data), now_ns)

    def add(self, n: int, now_ns: int) -> bool:
        self.size += n
        self.reads.append(self.size)
        self.reads.append(now_ns)
        if self.started:
            return self.buf.endswith(END, 0, self.size)
        return self._start(now_ns)

    def _start(self, now_ns: int) -> bool:
        """Until the first token: the head (an error reply ends the stream) and the first token word."""
        if self.head_end < 0:
            head_end = self.buf.find(HEAD_END, 0, self.size)
            if head_end < 0:
                return False
            self.head_end = head_end + len(HEAD_END)
            if not self.buf.startswith(b"HTTP/1.1 200"):
                return True
        if WORD.search(self.buf, self.head_end, self.size) is None:
            return False
        self.started = True
        self.stats.first_token(now_ns)
        return self.buf.endswith(END, 0, self.size)

    def _grow(self) -> None:
        self.view.release()  # a bytearray with a view cannot be resized
        self.buf.extend(bytes(len(self.buf)))
        self.view = memoryview(self.buf)

    def parse(self) -> list[tuple[int, int]]:
        """After the run: checks the body and returns (receipt ns, token id) for each token. The receipt
        of a token is the read that completed its event; its id is its word in the event's text."""
        self.view.release()
        if self.head_end < 0 or not self.buf.startswith(b"HTTP/1.1 200"):
            return []
        try:
            events, ends = _dechunk(bytes(self.buf[self.head_end:self.size]), self.head_end)
            texts = [json.loads(event[6:])["choices"][0]["text"] for event in events if event != DONE]
        except (ValueError, LookupError, TypeError):  # bad framing or an event that is not a completion chunk
            return []
        reads, out = self.reads[0::2], []
        for text, end in zip(texts, ends):  # [DONE] is last
            read_ns = self.reads[2 * bisect.bisect_left(reads, end) + 1]
            out += [(read_ns, int(word)) for word in TEXT.findall(text)]
        self.num_events, self.num_tokens = len(events), len(out)
        self.ok = bool(events) and events[-1] == DONE and self.buf.endswith(END, 0, self.size)
        return out


def _dechunk(body: bytes, offset: int) -> tuple[list[bytes], list[int]]:
    """A chunked body's SSE events and where each ends in the stream's bytes (`offset`: the body's start);
    raises ValueError on bad framing or an event that is not `data: ...`."""
    data, ends, pos = bytearray(), [], 0  # ends[i]: the raw offset at which data's byte i ends
    while True:
        line_end = body.index(b"\r\n", pos)
        size = int(body[pos:line_end], 16)
        start = line_end + 2
        if size == 0:
            if body[start:] != b"\r\n":
                raise ValueError("bytes after the chunked terminator")
            break
        if body[start + size:start + size + 2] != b"\r\n":
            raise ValueError(f"bad chunk framing at byte {pos}")
        data += body[start:start + size]
        ends.append((len(data), offset + start + size))
        pos = start + size + 2
    events, event_ends, pos = [], [], 0
    chunk_ends = [e for e, _ in ends]
    while pos < len(data):
        end = data.index(b"\n\n", pos) + 2
        event = bytes(data[pos:end])
        if not event.startswith(b"data: "):
            raise ValueError(f"not an SSE data event: {event[:40]!r}")
        events.append(event)
        data_end, raw_end = ends[bisect.bisect_left(chunk_ends, end)]  # the chunk holding the event's last byte
        event_ends.append(raw_end - (data_end - end))
        pos = end
    return events, event_ends


def completion_request(url: str, key: str, body: dict) -> bytes:
    """A POST to `url`/completions as one buffer (HTTP/1.1; the client closes the connection at the end)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    return (f"POST {parts.path}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


def run_streams(url: str, key: str, body: dict, num_streams: int, tick_s: float = 0.0,
                on_all_started: Callable[[StreamStats], None] | None = None,
                on_first_end: Callable[[StreamStats], None] | None = None, connect_batch: int = 0,
                connect_gap_s: float = 0.005, on_done: Callable[[], None] | None = None,
                refill_s: float = 0.0, lengths: Iterator[int] | None = None, keep_alive: bool = False,
                ssl_context: ssl.SSLContext | None = None) -> tuple[list[StreamBody], StreamStats, float]:
    """All streams, `connect_batch` connections every `connect_gap_s` (0: all at once), read as they go;
    returns each stream's body (parsed), the token samples and the wall time (s) of the streaming, which
    ends with `on_done()` (before the parse, whose CPU time is not the run's). Connections are opened
    without blocking: one whose SYN a full listen backlog dropped (`listen_overflows` in the results counts
    them; it waits a second or more for the retransmit) holds up no other stream. `lengths`: each new
    stream's `max_tokens` (else `body`'s); `refill_s`: see the module's doc; `keep_alive`: a replacement is
    sent on the connection of the stream it replaces when that one ended whole (HTTP/1.1 keep-alive, as
    the `openai` client's connection pool does), else on a new connection. `ssl_context`: HTTPS."""
    connect_batch = connect_batch or num_streams
    addr = (urlsplit(url).hostname, urlsplit(url).port)
    stats = StreamStats(num_streams, on_all_started, on_first_end)
    requests: dict[int, bytes] = {}  # per max_tokens asked for

    def new_stream(sock: socket.socket | None = None) -> StreamBody:
        max_tokens = next(lengths) if lengths is not None else body.get("max_tokens", 16)
        if max_tokens not in requests:
            requests[max_tokens] = completion_request(url, key, {**body, "max_tokens": max_tokens})
        stream = StreamBody(stats, 4096 + BODY_BYTES_PER_TOKEN * max_tokens, max_tokens)
        if sock is None:
            return _connect(addr, stream, requests[max_tokens], poller, open_socks, unsent)
        open_socks[sock.fileno()] = (sock, stream, requests[max_tokens])
        sock.send(requests[max_tokens])  # the connection's previous response is complete: its send buffer is empty
        return stream
    poller, open_socks, bodies = select.epoll(), {}, []
    unsent: set[int] = set()  # connections still connecting (TCP, then TLS): their request is not sent yet
    t0, t0_ns, monotonic_ns = time.perf_counter(), time.monotonic_ns(), time.monotonic_ns
    next_connect_s = t0
    while open_socks or len(bodies) < num_streams:
        connecting = len(bodies) < num_streams
        if connecting and time.perf_counter() >= next_connect_s:
            for _ in range(min(connect_batch, num_streams - len(bodies))):
                bodies.append(new_stream())
            next_connect_s += connect_gap_s
        if tick_s:
            time.sleep(tick_s)
            timeout = 0
        else:
            timeout = max(0.0, next_connect_s - time.perf_counter()) if connecting else -1
        for fd, events in poller.poll(timeout):
            sock, stream, request = open_socks[fd]
            if fd in unsent:  # connecting: TCP, then (HTTPS) TLS, then the request into the empty send buffer
                if ssl_context is not None:
                    if not isinstance(sock, ssl.SSLSocket):
                        sock = ssl_context.wrap_socket(sock, server_hostname=addr[0], do_handshake_on_connect=False)
                        open_socks[fd] = (sock, stream, request)
                    if not _handshake_step(sock, poller, fd):
                        continue
                sock.send(request)
                unsent.discard(fd)
                poller.modify(fd, select.EPOLLIN)
            elif _read(stream, sock, monotonic_ns):
                replaced = not connecting and time.perf_counter() - t0 < refill_s
                stats.ended(monotonic_ns(), replaced)
                if replaced and keep_alive and stream.buf.endswith(END, 0, stream.size):
                    bodies.append(new_stream(sock))
                    continue
                poller.unregister(fd)
                sock.close()
                del open_socks[fd]
                if replaced:
                    bodies.append(new_stream())
    wall_s = time.perf_counter() - t0
    if on_done is not None:
        on_done()
    poller.close()
    stats.t0_ns = t0_ns
    samples = sorted(sample for stream in bodies for sample in stream.parse())
    stats.times_ns.extend(t for t, _ in samples)
    stats.tokens.extend(token for _, token in samples)
    return bodies, stats, wall_s


def _read(stream: StreamBody, sock: socket.socket, clock: Callable[[], int]) -> bool:
    """`stream.recv`, again while TLS holds decrypted bytes that epoll cannot see."""
    done = stream.recv(sock, clock)
    while not done and isinstance(sock, ssl.SSLSocket) and sock.pending():
        done = stream.recv(sock, clock)
    return done


def _handshake_step(sock: ssl.SSLSocket, poller: select.epoll, fd: int) -> bool:
    """One step of a non-blocking TLS handshake; True once done, else waits for what it wants."""
    try:
        sock.do_handshake()
    except ssl.SSLWantReadError:
        poller.modify(fd, select.EPOLLIN)
        return False
    except ssl.SSLWantWriteError:
        poller.modify(fd, select.EPOLLOUT)
        return False
    return True


def _connect(addr: tuple[str, int], stream: StreamBody, request: bytes, poller: select.epoll,
             open_socks: dict, unsent: set[int]) -> StreamBody:
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(addr)  # EINPROGRESS: writable once connected
    open_socks[sock.fileno()] = (sock, stream, request)
    unsent.add(sock.fileno())
    poller.register(sock.fileno(), select.EPOLLOUT)
    return stream
