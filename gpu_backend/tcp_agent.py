"""`blink agent`: the backend host's end of the `tcp` transport (protocols/tcp_wire.py).

It attaches to the backend's shm ring as its producer and serves one gateway session at a time: it
applies the gateway's writes (Submit, Cancel, Consumed) to the ring and forwards what the engine
writes (Tokens, State). The engine (GPU loop or CPU engine) is unchanged and does not know. This puts
the host's CPU on the I/O path: one asyncio loop polling the slots of requests in flight.

Failure handling, so that nothing is lost silently:
- a session that ends (EOF, error, no frame for `idle_timeout_s`, or a newer session replacing it) has
  its running slots cancelled in the ring; once the engine confirms, they are announced in `Freed`;
- the gateway fails the requests a lost session carried (it sees the connection drop);
- the agent exits when its ring is gone or replaced (the backend restarted) or its parent died, so a
  supervisor (systemd, the backend that spawned it) starts a fresh one on the new ring.

With TLS (`--control-ssl-*`, the backend's control-plane files: protocols/mtls.py) every connection is
TLS-handshaken before it may touch the session: a gateway without a certificate signed by the CA, or one
speaking plaintext, is logged and closed, and the session in progress goes on. SIGHUP re-reads the files.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
from dataclasses import dataclass, field

from protocols import tcp_wire as W
from protocols.mtls import ServerTls
from protocols.ring import ErrorCode, FinishReason
from protocols.shm import SHM_DIR, RingAttachError, RingFull, attach_ring
from protocols.shm_producer import ShmProducer

from gpu_backend.control_tls import add_control_tls_args, agent_tls_config, control_tls

log = logging.getLogger("blink.agent")
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not finished its TLS handshake by then is closed


@dataclass
class Session:
    """One gateway connection and the slots it submitted that have not finished yet."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: str
    slots: set[int] = field(default_factory=set)
    outbox: W.Outbox = field(default_factory=W.Outbox)
    closed: bool = False


class TcpAgent:
    """Producer of one shm ring on behalf of a remote gateway."""

    def __init__(self, producer: ShmProducer, poll_s: float = 0.001, state_s: float = 0.05,
                 idle_timeout_s: float = 5.0, parent_pid: int = 0, tls: ServerTls | None = None):
        self.producer = producer
        self.ring = producer.ring
        self.poll_s, self.state_s, self.idle_timeout_s = poll_s, state_s, idle_timeout_s
        self.parent_pid = parent_pid
        self.tls = tls
        self.num_refused = 0  # connections whose TLS handshake failed
        self.session: Session | None = None
        self._ring_inode = _inode(self.ring.name)
        self._stop = asyncio.Event()
        self.port = 0

    async def serve(self, host: str, port: int) -> None:
        """Listen and pump until the ring goes away, the parent dies, or `stop()`."""
        server = await asyncio.start_server(self._on_connect, host, port)
        self.port = server.sockets[0].getsockname()[1]
        log.info("agent for ring %s listening on %s:%d", self.ring.name, host, self.port)
        try:
            await self._pump()
        finally:
            server.close()
            if self.session is not None:
                self._drop(self.session, "the agent is stopping")

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- sessions
    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "%s:%s" % writer.get_extra_info("peername")[:2]
        if self.tls is not None:
            if not await self._handshake(writer, peer):
                return
            peer += f" ({_subject(writer)})"
        if self.session is not None:
            self._drop(self.session, f"replaced by a new session from {peer}")
        session = self.session = Session(reader, writer, peer)
        log.info("gateway %s connected", peer)
        g = self.producer.geometry
        session.outbox.put(W.Hello(g, self.ring.fingerprint, tuple(self.producer.free_slot_ids)))
        session.outbox.put(self._state())
        session.outbox.flush(writer)
        try:
            while not session.closed:
                msg = await asyncio.wait_for(W.read_message(reader), self.idle_timeout_s)
                self._apply(session, msg)
            return
        except asyncio.TimeoutError:
            why = f"no frame for {self.idle_timeout_s:g} s"
        except (asyncio.IncompleteReadError, ConnectionError):
            why = "connection closed"
        except W.WireError as exc:
            why = f"protocol error: {exc}"
        if self.session is session:
            self._drop(session, why)

    async def _handshake(self, writer: asyncio.StreamWriter, peer: str) -> bool:
        """TLS on the new connection before anything else (a refused one never disturbs the session)."""
        try:
            await writer.start_tls(self.tls.context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
            return True
        except (ssl.SSLError, OSError, asyncio.TimeoutError) as exc:
            why = getattr(exc, "verify_message", None) or getattr(exc, "reason", None) or type(exc).__name__
            self.num_refused += 1
            log.warning("refused a connection from %s: TLS handshake failed (%s)", peer, why)
            writer.close()
            return False

    def _apply(self, session: Session, msg: W.Message) -> None:
        if isinstance(msg, W.Submit):
            self._submit(session, msg)
        elif isinstance(msg, W.Cancel):
            if msg.slot in session.slots:
                self.producer.cancel(msg.slot)
        elif isinstance(msg, W.Consumed):
            for slot, count in msg.counts:
                if slot in session.slots:
                    self.producer.set_consumed(slot, count)
        elif not isinstance(msg, W.Ping):
            raise W.WireError(f"unexpected {type(msg).__name__} from a gateway")

    def _submit(self, session: Session, msg: W.Submit) -> None:
        try:
            self.producer.submit(msg.spec, slot=msg.slot)
        except (RingFull, ValueError) as exc:  # a gateway out of step with us: fail that request, loudly
            log.error("gateway %s: submit to slot %d refused: %s", session.peer, msg.slot, exc)
            session.outbox.put(W.Tokens(msg.slot, finish=FinishReason.ERROR, error_code=ErrorCode.INVALID_PARAMS))
            return
        session.slots.add(msg.slot)

    def _drop(self, session: Session, why: str) -> None:
        """End a session: its running requests are cancelled in the engine, reclaimed later."""
        session.closed = True
        for slot in session.slots:
            self.producer.cancel(slot)
        log.warning("gateway %s: session ended (%s); cancelled %d running requests", session.peer, why,
                    len(session.slots))
        session.slots.clear()
        session.writer.close()
        if self.session is session:
            self.session = None

    # ---------------------------------------------------------------- pump
    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        next_state = 0.0
        while not self._stop.is_set():
            session = self.session
            if session is not None:
                self._forward(session)
            freed = self._reclaim()
            now = loop.time()
            if session is not None and not session.closed:
                if freed:
                    session.outbox.put(W.Freed(tuple(freed)))
                if now >= next_state:
                    session.outbox.put(self._state())
                await self._flush(session)
            if now >= next_state:
                next_state = now + self.state_s
                if self._host_gone():
                    return
            busy = self.producer.in_flight > 0
            await asyncio.sleep(self.poll_s if busy else self.state_s)

    def _forward(self, session: Session) -> None:
        for slot in list(session.slots):
            update = self.producer.poll(slot)
            if not update.tokens and update.finish == FinishReason.NONE:
                continue
            session.outbox.put(W.Tokens(slot, tuple(update.tokens), update.finish, update.error_code, update.prompt_len,
                                         tuple(update.logprobs)))
            if update.finish != FinishReason.NONE:
                self.producer.release(slot)
                session.slots.discard(slot)

    def _reclaim(self) -> list[int]:
        """Slots of ended sessions (or of an earlier producer) that the engine has now finished."""
        owned = self.session.slots if self.session is not None else set()
        freed = [slot for slot in self.producer.reclaim() if slot not in owned]
        for slot in freed:
            self.producer.release(slot)
        return freed

    async def _flush(self, session: Session) -> None:
        """Write queued frames; a gateway that does not read for `idle_timeout_s` is dropped."""
        session.outbox.flush(session.writer)
        try:
            await asyncio.wait_for(session.writer.drain(), self.idle_timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            if self.session is session:
                self._drop(session, f"writing failed: {exc!r}")

    def _state(self) -> W.State:
        return W.State(self.ring.heartbeat, self.ring.engine_state, self.ring.stats())

    def _host_gone(self) -> bool:
        if self.parent_pid and os.getppid() != self.parent_pid:
            log.warning("the backend process %d is gone; agent exits", self.parent_pid)
            return True
        if _inode(self.ring.name) != self._ring_inode:
            log.warning("ring %s was removed or replaced (backend restarted?); agent exits", self.ring.name)
            return True
        return False


def _subject(writer: asyncio.StreamWriter) -> str:
    """The client certificate's common name, for logs (no certificate: said so)."""
    cert = writer.get_extra_info("peercert") or {}
    names = dict(entry[0] for entry in cert.get("subject", ()))
    return f"certificate CN={names['commonName']}" if "commonName" in names else "no client certificate"


def _inode(name: str) -> int:
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino
    except FileNotFoundError:
        return -1


def split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} must look like HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_agent_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ring", required=True, help="the backend's shared-memory ring name")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address gateways connect to")
    p.add_argument("--idle-timeout", type=float, default=5.0, help="drop a gateway silent this long (s)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is no longer the parent")
    add_control_tls_args(p)
    p.set_defaults(func=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    try:
        host, port = split_host_port(args.listen)
        tls = control_tls(agent_tls_config(args))
        ring = attach_ring(args.ring)
    except (ValueError, OSError, RingAttachError) as exc:  # ConfigError is a ValueError; OSError: a TLS file
        print(f"blink agent: {exc}", file=sys.stderr)
        return 2
    agent = TcpAgent(ShmProducer(ring, defer_consumed=True), idle_timeout_s=args.idle_timeout,
                     parent_pid=args.parent_pid, tls=tls)

    async def main() -> None:
        import signal
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        if tls is not None:
            loop.add_signal_handler(signal.SIGHUP, tls.reload)
        await agent.serve(host, port)

    try:
        asyncio.run(main())
    except OSError as exc:
        print(f"blink agent: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    finally:
        ring.close()
    return 0
