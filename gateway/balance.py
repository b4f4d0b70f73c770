"""`--workers N` with `--worker-balance connections` (the default): the supervisor accepts the HTTP port's
connections and passes each to the worker with the fewest open ones.

Why: with SO_REUSEPORT (`--worker-balance kernel`) the kernel hashes each connection to a worker, and clients keep
their connections: 64 streams over 8 workers landed 3, 5, 7, 7, 8, 9, 10 and 15 a worker on an H200 host
(bench/NOTES.md, structured outputs). A worker's event loop and grammar threads serve its own streams, so the
15-stream worker computed most of the late token masks. Here each new connection goes where the fewest are open.

How: the supervisor listens; each worker holds one end of an AF_UNIX SOCK_SEQPACKET pair (`--accept-fd`). A
connection travels as one message carrying its descriptor (SCM_RIGHTS); the worker adopts it into its aiohttp
server (`loop.connect_accepted_socket`, TLS handshake there). Each worker reports (connections received, connections
open) whenever they change, at most every REPORT_S; the supervisor's estimate of a worker is its open connections
plus those sent since its last report. The port is bound at once (a taken port fails the start) but listens only
from the first worker's first report: until a worker serves, a connection is refused, as with SO_REUSEPORT. Only
the HTTP port: gRPC and a separate admin port keep SO_REUSEPORT. The supervisor's part runs per connection, not per
request or token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import struct
from collections.abc import Callable

log = logging.getLogger("blink.gateway.balance")

REPORT_S = 0.05  # a worker's report period while its numbers change
_REPORT = struct.Struct("<QQ")  # (connections received, connections open), worker -> supervisor


class Listener:
    """The supervisor's side: the HTTP port's sockets and one pair per worker."""

    def __init__(self, host: str, port: int, backlog: int, num_workers: int):
        self.sockets = _bind(host, port)
        self.backlog = backlog
        self.listening = False
        self.pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(num_workers)]
        for ours, _ in self.pairs:
            ours.setblocking(False)
        self.sent = [0] * num_workers
        self.reported = [(0, 0)] * num_workers  # (received, open) as each worker last said
        self.alive = [True] * num_workers  # False once a worker's end is closed (it exited)
        self.ready = [False] * num_workers  # True from a worker's first report (its server is up)
        self._next = 0  # ties go round the workers

    def worker_fd(self, index: int) -> int:
        """The descriptor worker `index` inherits (subprocess pass_fds) and reads connections from."""
        return self.pairs[index][1].fileno()

    def after_start(self) -> None:
        """The workers hold their ends now: the supervisor's copies go."""
        for _, theirs in self.pairs:
            theirs.close()

    def estimate(self, index: int) -> int:
        received, open_now = self.reported[index]
        return open_now + self.sent[index] - received

    def pick(self) -> int | None:
        """The live worker with the fewest connections (estimated); ties go round. None: no worker is alive."""
        n = len(self.pairs)
        order = [i for i in ((self._next + k) % n for k in range(n)) if self.alive[i] and self.ready[i]]
        if not order:
            return None
        best = min(order, key=self.estimate)
        self._next = (best + 1) % n
        return best

    def poll(self, timeout_s: float) -> None:
        """Wait up to timeout_s; pass on every connection that is waiting, take every report."""
        watched = [ours for i, (ours, _) in enumerate(self.pairs) if self.alive[i]]
        ready, _, _ = select.select([*(self.sockets if self.listening else ()), *watched], [], [], timeout_s)
        for sock in ready:
            if sock in self.sockets:
                self._accept(sock)
            else:
                self._take_reports(next(i for i, (ours, _) in enumerate(self.pairs) if ours is sock))

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):  # a burst at most a pass: reports are read between bursts
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the connection waits in the backlog
                log.warning("accepting an HTTP connection failed: %s", exc)
                return
            with conn:
                self._hand(conn)

    def _hand(self, conn: socket.socket) -> None:
        first = self.pick()
        n = len(self.pairs)
        for k in range(n if first is not None else 0):  # a worker whose queue is full (stalled) is skipped
            index = (first + k) % n
            if not (self.alive[index] and self.ready[index]):
                continue
            try:
                socket.send_fds(self.pairs[index][0], [b"c"], [conn.fileno()])
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # the worker is gone: the supervisor stops them all soon
                log.warning("passing a connection to worker %d failed: %s", index, exc)
                self.alive[index] = False
                continue
            self.sent[index] += 1
            return
        log.error("no gateway worker could take a connection: closed")

    def _take_reports(self, index: int) -> None:
        ours = self.pairs[index][0]
        while True:
            try:
                data = ours.recv(_REPORT.size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # the worker closed its end (it exited)
                self.alive[index] = False
                return
            if len(data) == _REPORT.size:
                self.reported[index] = _REPORT.unpack(data)
                self.ready[index] = True
                if not self.listening:
                    for sock in self.sockets:
                        sock.listen(self.backlog)
                    self.listening = True

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []
        for ours, theirs in self.pairs:
            ours.close()
            theirs.close()


def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of host (as asyncio's create_server binds them), not yet listening;
    OSError if any fails."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Adopter:
    """A worker's side: connections from the supervisor, adopted into `protocol_factory` (aiohttp's server)."""

    def __init__(self, fd: int, protocol_factory: Callable[[], asyncio.Protocol],
                 open_connections: Callable[[], int], ssl_context: ssl.SSLContext | None):
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.factory = protocol_factory
        self.open_connections = open_connections
        self.ssl_context = ssl_context
        self.received = 0
        self._said = (-1, -1)
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task] = set()
        self._loop.add_reader(self.sock, self._take)
        self._say()  # the first report: this worker serves (the supervisor listens from the first one)
        self._reporter = self._loop.create_task(self._report_loop(), name="connection reports")

    def _take(self) -> None:
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self.sock, 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("the supervisor's connection pipe failed: %s", exc)
                self._stop_reading()
                return
            if not fds:  # the supervisor is gone
                self._stop_reading()
                return
            for fd in fds:
                self.received += 1
                conn = socket.socket(fileno=fd)
                conn.setblocking(False)
                task = self._loop.create_task(self._adopt(conn))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._say()

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self.factory, sock=conn, ssl=self.ssl_context)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:  # a handshake that failed, a peer gone
            log.debug("an adopted connection failed to start: %s", exc)
            conn.close()

    def _say(self) -> None:
        now = (self.received, self.open_connections())
        if now != self._said:
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                self.sock.send(_REPORT.pack(*now))
                self._said = now

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            self._say()

    def _stop_reading(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.sock)

    def close(self) -> None:
        self._stop_reading()
        self._reporter.cancel()
        self.sock.close()
