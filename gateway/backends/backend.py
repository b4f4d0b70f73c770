"""Backends as the gateway sees them: a Describe over gRPC, then one ring, its producer end and its poller
(`gateway/streaming/poller.py`) each. A backend takes submissions (waiting, first come first served, for a free
slot), watches the engine's heartbeat, and fails its requests when the engine stops or goes away."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time

import grpc

from protocols import control_pb2, control_pb2_grpc
from protocols.messages import BackendInfo, TokenUpdate
from protocols.producer import RingProducer
from protocols.ring import EngineState, ErrorCode, FinishReason, RequestSpec
from protocols.shm import RingFull
from protocols.shm_producer import ShmProducer

from ..config import GatewayConfig
from ..errors import overloaded, unavailable
from ..streaming.native import NativeStreams
from ..streaming.poller import Poller
from ..streaming.request_handle import RequestHandle
from ..tls import plaintext_refusal, tls_refusal
from .transports import BackendConnectError, TlsRefused, connect_transport, control_channel

log = logging.getLogger("blink.gateway.backends")

# The longest spin (`GatewayConfig.poll_spin_s`) of a poller whose engine is `cpu`: that engine computes on
# this host's cores, and a spinning poller would take them from it.
CPU_ENGINE_SPIN_S = 0.002
TLS_CHECK_S = 1.0  # how often a Describe that waits checks the session (TLS or not) itself


def describe(addr: str, timeout_s: float, config: GatewayConfig) -> control_pb2.DescribeReply:
    """Blocking Describe that waits up to `timeout_s` for the backend to come up.

    gRPC reports a failed TLS handshake as a mere wait: every `TLS_CHECK_S` of waiting the session is tried
    directly, and a refused one (wrong certificate, wrong CA; TLS to a plaintext backend or plaintext to a
    TLS one) ends the wait at once with its reason."""
    deadline = time.monotonic() + timeout_s
    with control_channel(addr, config) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        while True:
            remaining_s = max(deadline - time.monotonic(), 0.0)
            step_s = min(remaining_s, TLS_CHECK_S)
            try:
                return stub.Describe(control_pb2.DescribeRequest(), timeout=step_s, wait_for_ready=True)
            except grpc.RpcError as exc:
                refused = tls_refusal(addr, config) if config.backend_tls else plaintext_refusal(addr)
                if refused is None and step_s < remaining_s and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                if refused is not None:
                    raise TlsRefused(refused) from None
                raise BackendConnectError(f"backend {addr} did not answer Describe within {timeout_s:g} s: "
                                          f"{exc.code().name} {exc.details()}") from None


class Backend:
    """One backend: its description, the producer end of its ring, and its poller task."""

    def __init__(self, info: BackendInfo, producer: RingProducer, config: GatewayConfig):
        self.info = info
        self.config = config
        self._producer = producer
        # The native round (gateway/streaming/stream_round.py), for shared-memory rings read as they come.
        if type(producer) is not ShmProducer or producer.defer_consumed:
            native_off = f"off ({info.transport} transport)"
        else:
            native_off = None if config.native_stream else "off (native_stream: false)"
        spin_s = min(config.poll_spin_s, CPU_ENGINE_SPIN_S) if info.engine_mode == "cpu" else config.poll_spin_s
        self.poller = Poller(info.addr, producer, NativeStreams(producer, info.geometry, native_off), config,
                             spin_s, owner=self)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._beat = (producer.heartbeat, time.monotonic())  # last heartbeat value, when it changed
        self._queued_tokens = 0  # outstanding tokens of requests waiting here for a ring slot
        self.stalled = False  # heartbeat stuck for stall_timeout_s with requests in flight: they were failed
        self._ejected_at: int | None = None  # the heartbeat that stood still when the pool ejected it
        self.dead = False  # control plane unreachable: its requests were failed (set by the pool)
        self.draining = False  # no new work; closed by the pool once its requests finish
        self.num_requests = 0  # submitted here since the gateway started

    @classmethod
    async def connect(cls, addr: str, config: GatewayConfig) -> Backend:
        config = config.for_backend(addr)  # its own TLS settings, if the config file gives it some
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(None, describe, addr, config.connect_timeout_s, config)
        try:
            info = BackendInfo.from_reply(addr, reply)
        except ValueError as exc:  # another release's Describe: no traceback, the reason
            raise BackendConnectError(str(exc)) from None
        if config.expect_ring is not None and info.ring_name != config.expect_ring:
            raise BackendConnectError(f"backend {addr} serves ring {info.ring_name!r}, not {config.expect_ring!r} "
                                      f"(--expect-ring): another instance holds that control address")
        producer = await connect_transport(info, config)
        log.info("backend %s: model %s, %s engine, %s transport, ring %s (%d slots), context %d", addr,
                 info.model_name, info.engine_mode, info.transport, info.ring_name, info.geometry.num_slots,
                 info.context_len)
        backend = cls(info, producer, config)
        await loop.run_in_executor(None, backend.poller.native.prepare)  # its library built now, off the event loop
        backend.start()
        return backend

    # ---------------------------------------------------------------- state
    @property
    def num_in_flight(self) -> int:
        return len(self.poller.requests)

    @property
    def free_slots(self) -> int:
        return self._producer.free_slots

    @property
    def heartbeat(self) -> int:
        return self._producer.heartbeat

    @property
    def link_error(self) -> str | None:
        """Why the link to a remote ring (tcp agent) is down, e.g. a refused TLS handshake; None while up."""
        if self._producer.connected:
            return None
        return getattr(self._producer, "last_error", "") or "down"

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
        return bool(self.poller.requests or self._waiters)

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
        return self._queued_tokens + self.poller.outstanding

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
        self.poller.add(handle)
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
            if not waiter.done():  # shed: retrying after another such wait has a chance
                raise overloaded(f"all {self.info.geometry.num_slots} request slots of backend "
                                 f"{self.info.addr} stayed busy for {self.config.slot_wait_s:g} s",
                                 self.config.slot_wait_s)
            woken = True

    def slot_freed(self) -> None:
        """A slot came back (`Poller`'s owner): the first request waiting for one goes."""
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def cancel(self, handle: RequestHandle) -> None:
        self._producer.cancel(handle.slot)

    @property
    def takes_masks(self) -> bool:
        """Its ring has a token-mask area and its transport carries masks: structured outputs can run here."""
        return self.info.geometry.mask_words > 0 and hasattr(self._producer, "put_mask")

    @property
    def masks_from_any_thread(self) -> bool:
        """`put_mask` may run on a mask thread (the producer's word: shm), not only on the event loop."""
        return self._producer.masks_from_any_thread

    def token_reads(self, handle: RequestHandle):
        """How a thread other than the event loop reads the request's generated tokens: (peek, response, seq),
        `peek(start)` -> the tokens from index `start` on, [] if none yet, None while the engine has not taken
        the request (`ShmProducer.peek_tokens`); `response`: the slot's response area (read-only, for native
        code) and the request's `seq`. None where the transport has no such reads (tcp, rdma)."""
        if not self.masks_from_any_thread or not hasattr(self._producer, "peek_tokens"):
            return None
        seq, _ = self._producer.position(handle.slot)
        return (functools.partial(self._producer.peek_tokens, handle.slot, seq),
                self._producer.response_view(handle.slot), seq)

    def put_mask(self, handle: RequestHandle, token_index: int, words) -> None:
        """The mask of the request's generated token `token_index` into its slot (the engine waits for it);
        nothing once the request has left this ring."""
        if self.poller.requests.get(handle.slot) is handle and not handle.finished:
            self._producer.put_mask(handle.slot, token_index, words)

    def fail_request(self, handle: RequestHandle, message: str) -> None:
        """End one request with an error (its reader gets `message`); cancelled in the engine."""
        self.take_back(handle)
        if not handle.abandoned:
            handle.queue.put_nowait(_error_update(message))
            handle.abandoned = True
        if self.poller.requests.get(handle.slot) is handle:
            self._producer.cancel(handle.slot)

    # ---------------------------------------------------------------- poller
    def start(self) -> None:
        self.poller.start()

    async def close(self) -> None:
        await self.poller.stop()
        for handle in self.poller.requests.values():
            self.take_back(handle)
            handle.queue.put_nowait(_error_update("the gateway is shutting down"))
        self.poller.native.close()  # before the ring it points into
        self._producer.close()

    # ---------------------------------------------------------------- the native round
    def go_native(self, handle: RequestHandle, *args) -> bool:
        """`NativeStreams.go` for a request in flight here."""
        return handle.slot in self.poller.requests and self.poller.native.go(handle, *args)

    def take_back(self, handle: RequestHandle) -> None:
        """`NativeStreams.take_back`."""
        self.poller.native.take_back(handle)

    @property
    def native_stream(self) -> str:
        """Whether the native round delivers this backend's plain streams, for operators (`/admin/status`)."""
        return self.poller.native.state

    @property
    def num_native_streams(self) -> int:
        return sum(handle.native is not None for handle in self.poller.requests.values())

    # ---------------------------------------------------------------- asked by the poller (`Owner`)
    def tidy(self) -> None:
        self._reclaim_adopted()
        self._wake_free()

    def reset_heartbeat(self) -> None:
        self._beat = (self.heartbeat, time.monotonic())

    def _reclaim_adopted(self) -> None:
        """Slots an earlier gateway left running are released once their finish arrives."""
        for slot in self._producer.reclaim():
            if slot not in self.poller.requests:
                self._producer.release(slot)
                self._wake_one()

    def _wake_free(self) -> None:
        """Slots can appear without a release here (a tcp agent frees those of a lost session)."""
        for _ in range(min(self.free_slots, len(self._waiters))):
            self._wake_one()

    def check_heartbeat(self) -> None:
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
        for handle in self.poller.requests.values():
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

