"""BENCHMARK-ONLY streaming client for `bench/ring_traffic.py stream`: N concurrent streamed completions,
one TCP connection each, read with one epoll loop, as cheap as a client can be while it reads every byte.

It shares a core with the traffic generator, so it must not starve it: no HTTP library, no event loop,
no JSON. Each read is split at its last event boundary (`\\n\\n`); the complete events are searched once
for the token words (`w123`, the ring-traffic vocabulary) and counted; their receipt time is the read's.
A stream ends at the chunked-encoding terminator after `data: [DONE]`, where the client closes it.
Checked per stream: the status line, [DONE] and the terminator, and the token count (by the caller).

`tick_s` > 0: the client sleeps `tick_s` between rounds and then reads whatever arrived (never blocked in
epoll): a gateway's write then finds no reader to wake on another core, as with a client on another host;
0: it blocks in epoll and each write wakes it (on loopback the sender pays for that wake-up).
"""
from __future__ import annotations

import array
import json
import re
import select
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

WORD = re.compile(rb"w(\d+)")
HEAD_END = b"\r\n\r\n"
DONE = b"data: [DONE]\n\n"
LAST_CHUNK = b"\r\n0\r\n\r\n"  # after [DONE]: the end of its chunk, then the terminating chunk


class StreamStats:
    """What every stream's reads add up to: (receipt ns, token id) per token, first-token times."""

    def __init__(self, num_streams: int, on_all_started: Callable[[StreamStats], None] | None = None,
                 on_first_end: Callable[[StreamStats], None] | None = None):
        self.times_ns, self.tokens = array.array("q"), array.array("q")
        self.first_ns: list[int] = []
        self.end_ns: list[int] = []  # when each stream's body was complete
        self.t0_ns = 0  # when the first stream was opened
        self.num_streams = num_streams
        self.on_all_started = on_all_started  # called once, when the last stream gets its first token
        self.on_first_end = on_first_end  # called once, when the first stream is complete

    def ended(self, now_ns: int) -> None:
        self.end_ns.append(now_ns)
        if len(self.end_ns) == 1 and self.on_first_end is not None:
            self.on_first_end(self)

    def first_token(self, now_ns: int) -> None:
        self.first_ns.append(now_ns)
        if len(self.first_ns) == self.num_streams and self.on_all_started is not None:
            self.on_all_started(self)


class SseCounter:
    """One streamed completion's response: `feed` every byte read; True once the body is complete."""

    def __init__(self, stats: StreamStats):
        self.stats = stats
        self.head: bytes | None = None  # the response head, once complete
        self.pending = b""  # bytes after the last complete event
        self.num_tokens = self.num_events = 0
        self.saw_done = False  # the last complete event was [DONE]

    def feed(self, data: bytes, now_ns: int) -> bool:
        buf = self.pending + data
        if self.head is None:
            head, sep, buf = buf.partition(HEAD_END)
            if not sep:
                self.pending = head
                return False
            self.head = head
            if not head.startswith(b"HTTP/1.1 200"):
                return True  # an error reply: `ok` says so
        cut = buf.rfind(b"\n\n") + 2  # 1: no complete event yet
        if cut > 1:
            events, self.pending = buf[:cut], buf[cut:]
            self._events(events, now_ns)
            self.saw_done = events.endswith(DONE)
        else:
            self.pending = buf
        return self.saw_done and self.pending == LAST_CHUNK

    def _events(self, events: bytes, now_ns: int) -> None:
        self.num_events += events.count(b"data: ")
        ids = WORD.findall(events)
        if ids:
            if not self.num_tokens:
                self.stats.first_token(now_ns)
            self.num_tokens += len(ids)
            self.stats.tokens.extend(map(int, ids))
            self.stats.times_ns.extend([now_ns] * len(ids))

    @property
    def ok(self) -> bool:
        """A 200, and the body ended with [DONE] and the terminating chunk."""
        return bool(self.head and self.head.startswith(b"HTTP/1.1 200")) and self.saw_done and self.pending == LAST_CHUNK


def completion_request(url: str, key: str, body: dict) -> bytes:
    """A POST to `url`/completions as one buffer (HTTP/1.1; the client closes the connection at the end)."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    return (f"POST {parts.path}/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


def run_streams(url: str, key: str, body: dict, num_streams: int, tick_s: float = 0.0,
                on_all_started: Callable[[StreamStats], None] | None = None,
                on_first_end: Callable[[StreamStats], None] | None = None, connect_batch: int = 0,
                connect_gap_s: float = 0.005) -> tuple[list[SseCounter], StreamStats, float]:
    """All streams, `connect_batch` connections every `connect_gap_s` (0: all at once), read as they go;
    returns each stream's counter, the token samples and the wall time (s). Connections are opened without
    blocking: one whose SYN a full listen backlog dropped (`listen_overflows` in the results counts them;
    it waits a second or more for the retransmit) holds up no other stream."""
    connect_batch = connect_batch or num_streams
    addr = (urlsplit(url).hostname, urlsplit(url).port)
    request, stats = completion_request(url, key, body), StreamStats(num_streams, on_all_started, on_first_end)
    poller, open_socks, counters = select.epoll(), {}, []
    t0, t0_ns = time.perf_counter(), time.monotonic_ns()
    next_connect_s = t0
    while open_socks or len(counters) < num_streams:
        connecting = len(counters) < num_streams
        if connecting and time.perf_counter() >= next_connect_s:
            for _ in range(min(connect_batch, num_streams - len(counters))):
                counters.append(_connect(addr, SseCounter(stats), poller, open_socks))
            next_connect_s += connect_gap_s
        if tick_s:
            time.sleep(tick_s)
            timeout = 0
        else:
            timeout = max(0.0, next_connect_s - time.perf_counter()) if connecting else -1
        for fd, events in poller.poll(timeout):
            sock, counter = open_socks[fd]
            if events & select.EPOLLOUT:  # connected: the request fits the empty send buffer
                sock.send(request)
                poller.modify(fd, select.EPOLLIN)
                continue
            data = sock.recv(65536)  # under malloc's mmap threshold
            now_ns = time.monotonic_ns()
            if not data or counter.feed(data, now_ns):
                stats.ended(now_ns)
                poller.unregister(fd)
                sock.close()
                del open_socks[fd]
    poller.close()
    stats.t0_ns = t0_ns
    return counters, stats, time.perf_counter() - t0


def _connect(addr: tuple[str, int], counter: SseCounter, poller: select.epoll, open_socks: dict) -> SseCounter:
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(addr)  # EINPROGRESS: writable once connected
    open_socks[sock.fileno()] = (sock, counter)
    poller.register(sock.fileno(), select.EPOLLOUT)
    return counter
