"""Backends as the gateway sees them: a Describe over gRPC, then one ring and one poller task each.

The poller is the only code that touches a ring's response side. While requests are in flight it
finds the slots with news (`ready_slots`: one vectorized read of every slot's counters), polls those,
and hands each `TokenUpdate` to that request's `sink` if it has one (a streamed response writes it to
its client right there, `gateway/sse.py`), else (or when the sink declines) pushes it into the request's
`UpdateQueue`; it polls again right after the readers ran while news keeps coming (up to `poll_spin_s`
after the last), else every `poll_active_s`; with no request in flight it waits for a submission. It
releases a slot once the engine has reported a finish, also for requests whose client went away (those
are cancelled first, then drained).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import grpc

from protocols import control_pb2, control_pb2_grpc
from protocols.rdma import RdmaProducer
from protocols.ring import EngineState, ErrorCode, FinishReason, RequestSpec, RingGeometry
from protocols.shm import RingFull
from protocols.shm_producer import RingProducer, TokenUpdate

from . import stream_round
from .config import GatewayConfig
from .errors import unavailable
from .request_handle import RequestHandle
from .tcp_producer import TcpProducer
from .transports import BackendConnectError, connect_transport

_ALWAYS_EXTENDED = ("cpu", "host")  # engine modes that always apply penalties, logit_bias and logprobs

log = logging.getLogger("blink.gateway.backends")

# The longest spin (`GatewayConfig.poll_spin_s`) of a poller whose engine is `cpu`: that engine computes on
# this host's cores, and a spinning poller would take them from it.
CPU_ENGINE_SPIN_S = 0.002

_started = threading.local()  # .backends: the started backends of this thread's event loop (see `poll_checkpoint`)


def poll_checkpoint() -> None:
    """A place in a request's set-up or end where the pollers may run: each backend of this event loop whose
    last poll round began more than `GatewayConfig.poll_checkpoint_s` ago gets one now, right here.

    The event loop runs a callback to its end, and runs every callback that is ready in one pass; a
    request's set-up or end (HTTP parsing, validation, tokenizing, the ring submission, the response head,
    metrics) is several hundred microseconds of such work, and a pass can hold several requests'. Every
    open stream's tokens wait meanwhile. Called between the steps of that work, this gives the token path
    priority over it: tokens wait for at most one step, not for a pass. Cheap when no round is due (a clock
    read per backend). Never call it from the poller's own path (sinks, `Generation.take`)."""
    backends = getattr(_started, "backends", None)
    if backends:
        now_ns = time.monotonic_ns()
        for backend in backends:
            if now_ns - backend.round_ns > backend.checkpoint_ns:
                try:
                    backend.poll_round(now_ns)
                except Exception:  # not the caller's request's failure: the poller's own round meets it next
                    log.exception("poll round of backend %s failed at a checkpoint", backend.info.addr)


@dataclass(frozen=True)
class BackendInfo:
    """What a backend's `Describe` said."""

    addr: str
    model_name: str
    model_dir: str
    model_fingerprint: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    engine_mode: str
    ring_name: str
    geometry: RingGeometry
    transport: str = "shm"  # shm | tcp
    tcp_endpoint: str = ""  # HOST:PORT of the backend's tcp agent
    sampling_extensions: bool = True  # penalties, logit_bias and logprobs are applied

    @classmethod
    def from_reply(cls, addr: str, reply: control_pb2.DescribeReply) -> BackendInfo:
        g = reply.geometry
        geometry = RingGeometry(**{f.name: getattr(g, f.name) for f in dataclasses.fields(RingGeometry)})
        return cls(addr=addr, model_name=reply.model_name, model_dir=reply.model_dir,
                   model_fingerprint=reply.model_fingerprint, context_len=reply.context_len,
                   vocab_size=reply.vocab_size, eos_token_ids=tuple(reply.eos_token_ids),
                   engine_mode=reply.engine_mode, ring_name=reply.ring_name,
                   geometry=geometry,
                   transport=reply.transport or "shm", tcp_endpoint=reply.tcp_endpoint,
                   sampling_extensions=reply.sampling_extensions or reply.engine_mode in _ALWAYS_EXTENDED)


def describe(addr: str, timeout_s: float) -> control_pb2.DescribeReply:
    """Blocking Describe that waits up to `timeout_s` for the backend to come up."""
    with grpc.insecure_channel(addr) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        try:
            return stub.Describe(control_pb2.DescribeRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise BackendConnectError(f"backend {addr} did not answer Describe within {timeout_s:g} s: "
                                      f"{exc.code().name} {exc.details()}") from None


class Backend:
    """One backend: its description, the producer end of its ring, and its poller task."""

    def __init__(self, info: BackendInfo, producer: RingProducer | TcpProducer | RdmaProducer, config: GatewayConfig):
        self.info = info
        self.config = config
        self._producer = producer
        self._requests: dict[int, RequestHandle] = {}  # slot -> request in flight
        self._slots: list[int] | None = None  # its slots in ring order, for a round (None: changed since)
        # The native round (gateway/stream_round.py), for shared-memory rings read as they come.
        if type(producer) is not RingProducer or producer.defer_consumed:
            native_off = f"off ({info.transport} transport)"
        else:
            native_off = None if config.native_stream else "off (native_stream: false)"
        self.native = stream_round.NativeStreams(producer, info.geometry, native_off)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._wakeup = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._beat = (producer.heartbeat, time.monotonic())  # last heartbeat value, when it changed
        self._next_check_s = 0.0
        self._news_s = 0.0  # when a poll last found tokens or a finish (time.monotonic)
        self.round_ns = 0  # when the last poll round began (time.monotonic_ns)
        self.checkpoint_ns = int(config.poll_checkpoint_s * 1e9) if config.poll_checkpoint_s else 1 << 62
        self._in_round = False
        self.spin_s = min(config.poll_spin_s, CPU_ENGINE_SPIN_S) if info.engine_mode == "cpu" else config.poll_spin_s
        self._queued_tokens = 0  # outstanding tokens of requests waiting here for a ring slot
        # Sum of `outstanding_tokens` over `_requests`, kept as they change: routing reads it per request,
        # and summing over hundreds of streams each time made routing quadratic in the streams in flight.
        self._outstanding = 0
        self.stalled = False  # heartbeat stuck for stall_timeout_s with requests in flight: they were failed
        self._ejected_at: int | None = None  # the heartbeat that stood still when the pool ejected it
        self.dead = False  # control plane unreachable: its requests were failed (set by the pool)
        self.draining = False  # no new work; closed by the pool once its requests finish
        self.num_requests = 0  # submitted here since the gateway started

    @classmethod
    async def connect(cls, addr: str, config: GatewayConfig) -> Backend:
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(None, describe, addr, config.connect_timeout_s)
        info = BackendInfo.from_reply(addr, reply)
        if config.expect_ring is not None and info.ring_name != config.expect_ring:
            raise BackendConnectError(f"backend {addr} serves ring {info.ring_name!r}, not {config.expect_ring!r} "
                                      f"(--expect-ring): another instance holds that control address")
        producer = await connect_transport(info, config)
        log.info("backend %s: model %s, %s engine, %s transport, ring %s (%d slots), context %d", addr,
                 info.model_name, info.engine_mode, info.transport, info.ring_name, info.geometry.num_slots,
                 info.context_len)
        backend = cls(info, producer, config)
        await loop.run_in_executor(None, backend.native.prepare)  # its library built now, off the event loop
        backend.start()
        return backend

    # ---------------------------------------------------------------- state
    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def free_slots(self) -> int:
        return self._producer.free_slots

    @property
    def heartbeat(self) -> int:
        return self._producer.heartbeat

    @property
    def num_waiting(self) -> int:
        """Requests queued in the gateway for a free ring slot."""
        return len(self._waiters)

    def engine_stats(self) -> dict[str, int]:
        """What the engine last wrote into the ring header: KV blocks, running and waiting sequences."""
        return self._producer.engine_stats()

    @property
    def has_work(self) -> bool:
        """Requests in flight here or waiting for a slot: what the heartbeat must move for."""
        return bool(self._requests or self._waiters)

    @property
    def stopping(self) -> bool:
        """The engine announced its shutdown: a heartbeat that stands still then is no stall."""
        return self._producer.engine_state in (EngineState.STOPPING, EngineState.STOPPED)

    @property
    def ejected(self) -> bool:
        """Ejected for a stuck heartbeat, and it has not moved since (re-admitted the moment it does)."""
        return self._ejected_at is not None and self.heartbeat == self._ejected_at

    def eject(self) -> None:
        self._ejected_at = self.heartbeat

    def readmit(self) -> bool:
        """Forget an ejection; True if there was one."""
        was, self._ejected_at = self._ejected_at is not None, None
        return was

    @property
    def healthy(self) -> bool:
        """Fit for new work as far as liveness goes (draining is a separate matter)."""
        return not (self.stalled or self.ejected or self.dead)

    @property
    def outstanding_tokens(self) -> int:
        """Prompt plus output tokens still to be produced for requests here (the gateway's own count)."""
        return self._queued_tokens + self._outstanding

    @property
    def serving(self) -> bool:
        """The engine says it serves and its heartbeat moves."""
        return not self.stalled and self._producer.engine_state == EngineState.SERVING

    @property
    def load(self) -> float:
        """Fraction of ring slots in use, plus queued waiters: what the router balances."""
        return (self.info.geometry.num_slots - self.free_slots + len(self._waiters)) / self.info.geometry.num_slots

    # ---------------------------------------------------------------- requests
    async def submit(self, spec: RequestSpec) -> RequestHandle:
        """Write a request into a free slot, waiting (FIFO) up to `slot_wait_s` for one."""
        if self.stalled or self.dead or self.draining:  # ejected is routing's business: it may still queue here
            state = "draining" if self.draining else "dead" if self.dead else "not making progress"
            raise unavailable(f"backend {self.info.addr} is {state}")
        if not self._producer.connected:
            raise unavailable(f"backend {self.info.addr}: the connection to its tcp agent "
                              f"{self.info.tcp_endpoint} is down; reconnecting")
        tokens = len(spec.prompt_ids) + spec.max_tokens
        self._queued_tokens += tokens
        try:
            slot = await self._acquire_slot(spec)
        finally:
            self._queued_tokens -= tokens
        self.num_requests += 1
        handle = RequestHandle(self, slot, spec)
        self._requests[slot] = handle
        self._slots = None
        self._outstanding += handle.outstanding_tokens
        self._wakeup.set()
        return handle

    async def _acquire_slot(self, spec: RequestSpec) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.slot_wait_s
        woken = False  # a woken waiter goes first, ahead of the queue it left
        while True:
            if self.dead:
                raise unavailable(f"backend {self.info.addr} died while this request waited for a slot")
            if woken or not self._waiters:
                try:
                    return self._producer.submit(spec)
                except RingFull:
                    pass
            waiter = loop.create_future()
            (self._waiters.appendleft if woken else self._waiters.append)(waiter)
            try:
                # asyncio.wait, not wait_for: a cancelled client must never swallow a wake-up.
                await asyncio.wait((waiter,), timeout=deadline - loop.time())
            except asyncio.CancelledError:
                if waiter.done():
                    self._wake_one()  # pass the wake-up on
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if not waiter.done():
                raise unavailable(f"all {self.info.geometry.num_slots} request slots of backend "
                                  f"{self.info.addr} stayed busy for {self.config.slot_wait_s:g} s")
            woken = True

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def cancel(self, handle: RequestHandle) -> None:
        self._producer.cancel(handle.slot)

    # ---------------------------------------------------------------- poller
    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_loop(), name=f"poller {self.info.addr}")
        if not hasattr(_started, "backends"):
            _started.backends = []
        _started.backends.append(self)

    async def close(self) -> None:
        if self in getattr(_started, "backends", ()):
            _started.backends.remove(self)
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for handle in self._requests.values():
            self.take_back(handle)
            handle.queue.put_nowait(_error_update("the gateway is shutting down"))
        self.native.close()  # before the ring it points into
        self._producer.close()

    # ---------------------------------------------------------------- the native round
    def go_native(self, handle: RequestHandle, *args) -> bool:
        """`NativeStreams.go` for a request in flight here."""
        return handle.slot in self._requests and self.native.go(handle, *args)

    def take_back(self, handle: RequestHandle) -> None:
        """`NativeStreams.take_back`."""
        self.native.take_back(handle)

    @property
    def native_stream(self) -> str:
        """Whether the native round delivers this backend's plain streams, for operators (`/admin/status`)."""
        return self.native.state

    @property
    def num_native_streams(self) -> int:
        return sum(handle.native is not None for handle in self._requests.values())

    async def _poll_loop(self) -> None:
        while True:
            try:
                if self._requests:
                    now_ns = time.monotonic_ns()
                    now_s = now_ns / 1e9
                    self.poll_round(now_ns)
                    self._housekeeping()
                    # Within poll_spin_s of the last news, poll again as soon as the readers woken have
                    # run (one loop iteration): flowing tokens wait for no timer tick. After that, sleep
                    # poll_active_s per round, so requests that produce nothing cost no spinning core.
                    spinning = now_s - self._news_s < self.spin_s
                    await asyncio.sleep(0 if spinning else self.config.poll_active_s)
                else:
                    await self._idle()
            except asyncio.CancelledError:
                raise
            except Exception:  # a poller that dies would hang every request: fail them, keep going
                log.exception("poller of backend %s failed", self.info.addr)
                self._fail_all("the gateway lost track of this request (poller error)")
                await asyncio.sleep(self.config.heartbeat_check_s)

    def poll_round(self, now_ns: int) -> None:
        """One poll round, begun at `now_ns` (time.monotonic_ns): the poller's, or a `poll_checkpoint`'s."""
        if self._in_round or not self._requests:
            return
        self._in_round, self.round_ns = True, now_ns
        try:
            if self._poll_once():
                self._news_s = now_ns / 1e9
        finally:
            self._in_round = False

    def _poll_once(self) -> int:
        """Pass each request's news to its reader; returns how many requests had some."""
        num_updates = 0
        if self._slots is None:  # in ring order: a round then reads the ring's words in address order
            self._slots = sorted(self._requests)
        requests, poll, native = self._requests, self._producer.poll, self.native.round  # bound once a round
        if native is None:
            ready = self._producer.ready_slots(self._slots)
        else:  # the native streams' tokens go out now; the rest is this loop's
            ready, num_updates, fell = native.round(self._slots, time.perf_counter_ns())
            self._outstanding -= fell
        for slot in ready:
            handle = requests[slot]
            if handle.native is not None:  # handed back by the round: its news is this loop's
                self.take_back(handle)
            update = poll(slot)
            tokens = update.tokens
            if not tokens and not update.finish:  # FinishReason.NONE is 0
                continue
            num_updates += 1
            if not handle.abandoned:
                if tokens:
                    self._outstanding -= handle.produced(len(tokens))
                sink = handle.sink
                if sink is None or not sink(update):
                    handle.queue.put_nowait(update)
            if update.finish:
                del self._requests[slot]
                self._slots = None
                self._outstanding -= handle.outstanding_tokens
                self._producer.release(slot)
                self._wake_one()
        return num_updates

    async def _idle(self) -> None:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), self.config.heartbeat_check_s)
        except TimeoutError:
            self._reclaim_adopted()
            self._wake_free()
        self._beat = (self.heartbeat, time.monotonic())

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._next_check_s:
            self._next_check_s = now + self.config.heartbeat_check_s
            self._check_heartbeat()
            self._reclaim_adopted()
            self._wake_free()

    def _reclaim_adopted(self) -> None:
        """Slots an earlier gateway left running are released once their finish arrives."""
        for slot in self._producer.reclaim():
            if slot not in self._requests:
                self._producer.release(slot)
                self._wake_one()

    def _wake_free(self) -> None:
        """Slots can appear without a release here (a tcp agent frees those of a lost session)."""
        for _ in range(min(self.free_slots, len(self._waiters))):
            self._wake_one()

    def _check_heartbeat(self) -> None:
        beat, since = self._beat
        now, current = time.monotonic(), self.heartbeat
        if current != beat or self.stopping:  # stopping: it ends its requests itself
            self._beat = (current, now)
            if self.stalled:
                log.warning("backend %s: heartbeat moves again", self.info.addr)
            self.stalled = False
        elif not self.stalled and now - since > self.config.stall_timeout_s:
            self.stalled = True
            log.error("backend %s: heartbeat stuck at %d for %.0f s; failing its requests",
                      self.info.addr, beat, now - since)
            self._fail_all(f"backend {self.info.addr} stopped making progress")

    def fail_unstarted(self, message: str) -> int:
        """Fail (so that they move elsewhere) the requests that have no token yet; streams go on."""
        return self._fail_all(message, unstarted_only=True)

    def fail_all(self, message: str) -> int:
        return self._fail_all(message)

    def _fail_all(self, message: str, unstarted_only: bool = False) -> int:
        """Tell every reader its request failed; cancel in the engine; slots return if it ever finishes."""
        num_failed = 0
        for handle in self._requests.values():
            if unstarted_only and handle.num_produced:
                continue
            num_failed += 1
            self.take_back(handle)
            if not handle.abandoned:
                handle.queue.put_nowait(_error_update(message))
                handle.abandoned = True
            self._producer.cancel(handle.slot)
        if not unstarted_only:
            for waiter in self._waiters:  # requests still waiting for a slot find the backend unusable
                if not waiter.done():
                    waiter.set_result(None)
        return num_failed


def _error_update(message: str) -> TokenUpdate:
    return TokenUpdate(finish=FinishReason.ERROR, error=message, error_code=ErrorCode.INTERNAL)

