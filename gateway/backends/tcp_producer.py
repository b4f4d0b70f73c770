"""The gateway's end of the `tcp` transport: a ring producer whose ring is a `blink agent` over TCP.

`TcpProducer` has the interface `Backend` uses of `protocols.shm_producer.ShmProducer` (submit, poll, cancel,
release, reclaim, heartbeat, free_slots, connected, close), so nothing above it changes. Writes become
frames (protocols/tcp_wire.py) queued in an outbox and sent once per event-loop pass; the agent's
Tokens frames are accumulated per slot until `poll` takes them.

A lost connection (EOF, error, or no frame for `idle_timeout_s`: the agent sends State every few tens
of ms) fails every request it carried with an error the client sees; those slots come back only when
the agent says the engine has finished them (Hello's free list or Freed). It then reconnects with
exponential backoff for as long as it runs.

With `ssl_context` (the gateway's `backend_ssl_*`: mutual TLS; a function, called at each connection, so
that a reconnection reads replaced files) the stream is TLS, the agent's certificate is checked against
the CA and the endpoint's host, and the gateway presents its own. A TLS failure at
start-up (the agent refused the gateway's certificate, or its own does not verify) is a configuration
error: `start` raises it at once instead of retrying until the timeout.
"""
from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protocols import tcp_wire as W
from protocols.ring import EngineState, ErrorCode, FinishReason, RequestSpec, RingGeometry, put_mask_words
from protocols.shm import RingFull
from protocols.messages import TokenUpdate
from protocols.shm_producer import pop_finished

log = logging.getLogger("blink.gateway.tcp")


class AgentMismatch(RuntimeError):
    """The agent serves a ring other than the one Describe announced, or TLS with it failed at start-up."""


class AgentTlsRefused(AgentMismatch):
    """TLS with the agent failed: it refused the gateway's certificate, or the gateway refused its."""


def tls_failure(endpoint: str, exc: ssl.SSLError) -> str:
    """A failed TLS session with an agent, in words (the library's reason; never key material)."""
    why = getattr(exc, "verify_message", None) or exc.reason or type(exc).__name__
    hint = {"TLSV13_ALERT_CERTIFICATE_REQUIRED": "the agent requires a client certificate: set --backend-ssl-certfile",
            "TLSV1_ALERT_UNKNOWN_CA": "the agent does not trust the CA of the gateway's certificate",
            "WRONG_VERSION_NUMBER": "is the agent serving plaintext (no --control-ssl-certfile)?"}.get(exc.reason)
    return f"TLS with the tcp agent at {endpoint} failed: {why}" + (f" ({hint})" if hint else "")


@dataclass
class _Slot:
    """A submitted request as the gateway knows it; `session` is the session that may reuse the slot."""

    session: int
    update: TokenUpdate = field(default_factory=TokenUpdate)
    consumed: int = 0
    finished: bool = False


class TcpProducer:
    masks_from_any_thread = False  # its connection is the event loop's
    """Ring producer over TCP. Use from the event loop only; `await start()` before anything else."""

    def __init__(self, endpoint: str, geometry: RingGeometry, fingerprint: str | None = None, *,
                 ping_s: float = 0.5, idle_timeout_s: float = 3.0, backoff_s: tuple[float, float] = (0.05, 2.0),
                 ssl_context: Callable[[], ssl.SSLContext] | None = None):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"tcp endpoint {endpoint!r} must look like HOST:PORT")
        self.endpoint, self._host, self._port = endpoint, host.strip("[]"), int(port)
        self.geometry, self.fingerprint = geometry, fingerprint
        self.ping_s, self.idle_timeout_s, self.backoff_s = ping_s, idle_timeout_s, backoff_s
        self.ssl_context = ssl_context
        self.session = 0  # bumped on every Hello
        self.state = W.State(0, EngineState.STARTING)
        self._writer: asyncio.StreamWriter | None = None
        self._outbox = W.Outbox()
        self._flush_scheduled = False
        self._free: dict[int, None] = {}  # slots the agent said are free, in order
        self._active: dict[int, _Slot] = {}
        self._consumed: dict[int, int] = {}  # Consumed counts not yet sent
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.last_error = ""

    # ---------------------------------------------------------------- lifecycle
    async def start(self, timeout_s: float) -> None:
        """Start connecting; wait until the first session is up (raises TimeoutError, AgentMismatch)."""
        self._task = asyncio.create_task(self._run(), name=f"tcp {self.endpoint}")
        waiter = asyncio.ensure_future(self._connected.wait())
        done, _ = await asyncio.wait((waiter, self._task), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiter.cancel()
            self._task.result()  # raises what ended it
        if waiter not in done:
            waiter.cancel()
            self.close()
            raise TimeoutError(f"no session with the tcp agent at {self.endpoint} within {timeout_s:g} s"
                               f"{': ' + self.last_error if self.last_error else ''}")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._disconnect("the gateway is shutting down")

    async def _run(self) -> None:
        delay = self.backoff_s[0]
        while True:
            session = self.session
            try:
                reader, writer = await asyncio.wait_for(self._open(), self.idle_timeout_s)
                await self._session(reader, writer)  # returns only by raising
            except AgentMismatch as exc:
                if self.session == 0:
                    raise  # at start-up: the gateway's configuration is wrong, say so
                self.last_error = str(exc)
                log.error("%s; retrying", exc)
            except ssl.SSLError as exc:
                self.last_error = tls_failure(self.endpoint, exc)
                if self.session == 0:
                    raise AgentTlsRefused(self.last_error) from None
                log.error("%s; retrying", self.last_error)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, W.WireError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._disconnect(f"lost the connection to the backend's tcp agent at {self.endpoint} ({self.last_error})")
            if self.session != session:
                delay = self.backoff_s[0]  # a session worked: retry quickly
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.backoff_s[1])

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.ssl_context is None:
            return await asyncio.open_connection(self._host, self._port)
        return await asyncio.open_connection(self._host, self._port, ssl=self.ssl_context(),
                                             server_hostname=self._host, ssl_handshake_timeout=self.idle_timeout_s)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(self._read_hello(reader), self.idle_timeout_s)
            self._check_hello(hello)
            self._writer = writer
            self._on_hello(hello)
            pinger = asyncio.create_task(self._ping())
            try:
                while True:
                    self._on_message(await asyncio.wait_for(W.read_message(reader), self.idle_timeout_s))
            finally:
                pinger.cancel()
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(f"no frame from the agent for {self.idle_timeout_s:g} s") from None
        finally:
            writer.close()

    async def _read_hello(self, reader: asyncio.StreamReader) -> W.Message:
        try:
            return await W.read_message(reader)
        except asyncio.IncompleteReadError:
            if self.ssl_context is None:
                raise
            # an agent refuses a client certificate once our side of the TLS 1.3 handshake is done: it closes
            raise AgentTlsRefused(f"the tcp agent at {self.endpoint} closed the connection after the TLS handshake: "
                                f"it refused the gateway's client certificate (none, or not signed by the CA in "
                                f"its --control-ssl-ca-certs)") from None

    def _check_hello(self, hello: W.Message) -> None:
        if not isinstance(hello, W.Hello):
            raise W.WireError(f"expected Hello, got {type(hello).__name__}")
        if hello.version != W.WIRE_VERSION:
            raise AgentMismatch(f"agent at {self.endpoint} speaks wire version {hello.version}, we speak {W.WIRE_VERSION}")
        if hello.geometry != self.geometry or (self.fingerprint and hello.fingerprint != self.fingerprint):
            raise AgentMismatch(f"agent at {self.endpoint} serves ring {hello.geometry} model {hello.fingerprint!r}; "
                                f"Describe said {self.geometry} model {self.fingerprint!r}")

    def _on_hello(self, hello: W.Hello) -> None:
        self.session += 1
        self._free = {}
        self._add_free(hello.free_slots)
        self.last_error = ""
        self._connected.set()
        log.info("tcp agent %s: session %d, %d free slots", self.endpoint, self.session, len(self._free))

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(self.ping_s)
            self._send(W.Ping())

    def _disconnect(self, why: str) -> None:
        """Fail every request of the lost session; their slots return when the agent frees them."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._connected.clear()
        self._outbox = W.Outbox()
        self._consumed.clear()
        self._free = {}
        failed = 0
        for state in self._active.values():
            if not state.finished:
                state.update.finish = FinishReason.ERROR
                state.update.error_code = ErrorCode.INTERNAL
                state.update.error = why
                state.finished = True
                failed += 1
        if failed:
            log.error("%s: failed %d requests in flight", why, failed)

    # ---------------------------------------------------------------- incoming
    def _on_message(self, msg: W.Message) -> None:
        if isinstance(msg, W.Tokens):
            self._on_tokens(msg)
        elif isinstance(msg, W.State):
            self.state = msg
        elif isinstance(msg, W.Freed):
            self._add_free(msg.slots)
        else:
            raise W.WireError(f"unexpected {type(msg).__name__} from an agent")

    def _on_tokens(self, msg: W.Tokens) -> None:
        state = self._active.get(msg.slot)
        if state is None or state.finished:
            return  # a slot this session does not hold: nothing of ours
        update = state.update
        update.started, update.prompt_len, update.cached_tokens = True, msg.prompt_len, msg.cached_tokens
        update.tokens.extend(msg.tokens)
        update.logprobs.extend(msg.logprobs)
        if msg.finish != FinishReason.NONE:
            update.finish, update.error_code = msg.finish, msg.error_code
            update.error = msg.error_code.message if msg.finish == FinishReason.ERROR else ""
            state.finished = True
            state.session = self.session  # the agent released it: ours to reuse

    def _add_free(self, slots) -> None:
        for slot in slots:
            if slot in self._active:
                self._active[slot].session = self.session  # reusable once the gateway releases it
            else:
                self._free[slot] = None

    # ---------------------------------------------------------------- outgoing
    def _send(self, msg: W.Message) -> None:
        self._outbox.put(msg)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._consumed:
            self._outbox.put(W.Consumed(tuple(self._consumed.items())))
            self._consumed.clear()
        if self._writer is not None:
            self._outbox.flush(self._writer)

    # ---------------------------------------------------------------- the producer interface
    @property
    def connected(self) -> bool:
        return self._writer is not None

    @property
    def free_slots(self) -> int:
        return len(self._free) if self.connected else 0

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def engine_state(self) -> EngineState:
        return self.state.engine_state

    def engine_stats(self) -> dict[str, int]:
        """The engine's header words as the agent's last State frame carried them."""
        return dict(self.state.stats)

    @property
    def heartbeat(self) -> int:
        return self.state.heartbeat

    def submit(self, spec: RequestSpec) -> int:
        """Queue a request for a slot the agent said is free. Raises RingFull (also while disconnected)."""
        spec.validate(self.geometry)
        if not self.connected:
            raise RingFull(f"not connected to the tcp agent at {self.endpoint}")
        if not self._free:
            raise RingFull(f"all {self.geometry.num_slots} ring slots are in use")
        slot = next(iter(self._free))
        del self._free[slot]
        self._active[slot] = _Slot(session=self.session)
        self._send(W.Submit(slot, spec))
        return slot

    def cancel(self, slot: int) -> None:
        state = self._active.get(slot)
        if state is not None and not state.finished and self.connected:
            self._send(W.Cancel(slot))

    def put_mask(self, slot: int, token_index: int, words) -> None:
        """Sent to the agent, which writes it into the ring (ShmProducer.put_mask); ignored once finished."""
        state = self._active.get(slot)
        if state is None:
            raise KeyError(f"slot {slot} is not outstanding")
        words = put_mask_words(words, token_index, self.geometry)
        if not state.finished and self.connected:
            self._send(W.Mask(slot, token_index, words))

    def ready_slots(self, slots: Sequence[int]) -> list[int]:
        """Those of `slots` with an update waiting (ShmProducer's counterpart)."""
        return [s for s in slots if (u := self._active[s].update).tokens or u.finish != FinishReason.NONE]

    def poll(self, slot: int) -> TokenUpdate:
        """Everything that arrived for the slot since the last poll; acknowledges the tokens."""
        state = self._active[slot]
        update, state.update = state.update, TokenUpdate(started=state.update.started, prompt_len=state.update.prompt_len,
                                                         cached_tokens=state.update.cached_tokens)
        if update.tokens and not state.finished:
            state.consumed += len(update.tokens)
            self._consumed[slot] = state.consumed
            self._schedule_flush()
        return update

    def release(self, slot: int) -> None:
        """Forget a finished slot; it is free again if the agent has released it in this session."""
        state = pop_finished(self._active, slot)
        if state.session == self.session and self.connected:
            self._free[slot] = None

    def reclaim(self) -> list[int]:
        """Finished slots nobody released (requests failed by a lost connection)."""
        return [slot for slot, state in self._active.items() if state.finished]
