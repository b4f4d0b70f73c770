"""The backends a gateway serves from, as they come and go: connect, eject and re-admit on the heartbeat,
drop the dead, drain, and reload the list from the config file (SIGHUP).

Health, every `health_check_s`: a backend with work pending whose heartbeat stays unchanged for its engine
mode's timeout (`GatewayConfig.heartbeat_timeout_for`) is ejected from routing (its requests with no token
yet move to another backend, when one exists; its streams go on); the heartbeat moving again, or no work
left, re-admits it. An idle backend, or one whose engine announced its shutdown, is never ejected.
Every `probe_interval_s` the control plane of each backend whose heartbeat has not moved since the last
look is asked for its health: refused while the heartbeat
stands still means the process is gone, and every request there fails (those with no token yet are
retried elsewhere by `Generation`). A moving heartbeat needs no RPC: the backend's CPU stays idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..config import GatewayConfig
from ..config_file import ConfigFileError, reload_fields
from .backend import Backend
from .transports import TlsRefused, aio_control_channel
from .route import Router, make_policy

log = logging.getLogger("blink.gateway.pool")

DRAIN_POLL_S = 0.05


class BackendPool:
    """Owns the router's backend list; `drain(addr)` and `reload()` change it without dropping requests."""

    def __init__(self, config: GatewayConfig, router: Router,
                 on_added: Callable[[Backend], Awaitable[None]] | None = None):
        self.config = config
        self.router = router
        self.on_added = on_added  # e.g. load the tokenizer of a model the gateway did not serve yet
        self._beats: dict[Backend, tuple[int, float]] = {}  # heartbeat seen, when it last changed
        self._probe_beats: dict[Backend, int] = {}  # heartbeat at the previous probe
        self._channels: dict[Backend, grpc.aio.Channel] = {}  # control planes of backends connected here
        self._tasks: set[asyncio.Task] = set()  # drains and closes in progress
        self._monitor: asyncio.Task | None = None
        self._reloading = asyncio.Lock()

    @property
    def backends(self) -> list[Backend]:
        return self.router.backends

    # ---------------------------------------------------------------- membership
    async def connect(self, addrs: Iterable[str]) -> list[Backend]:
        """Connect to `addrs` together and add them; raises the first BackendConnectError."""
        backends = await asyncio.gather(*(Backend.connect(addr, self.config) for addr in addrs))
        for backend in backends:
            try:
                await self.add(backend, aio_control_channel(backend.info.addr, self.config.for_backend(backend.info.addr)))
            except Exception:  # e.g. its tokenizer does not load: close it rather than leak its poller
                await backend.close()
                raise
        return list(backends)

    async def add(self, backend: Backend, channel: grpc.aio.Channel | None = None) -> None:
        """Route to `backend` from now on; with `channel`, its control plane is probed for liveness."""
        if self.on_added is not None:
            await self.on_added(backend)
        if channel is not None:
            self._channels[backend] = channel
        self._beats[backend] = (backend.heartbeat, time.monotonic())
        self.router.add(backend)

    def drain(self, addr: str) -> bool:
        """No new work to `addr`; its requests finish, then it is closed and removed. False if unknown."""
        backend = self.router.find(addr)
        if backend is None:
            return False
        if not backend.draining:
            backend.draining = True
            log.warning("backend %s: draining (%d requests in flight)", addr, backend.num_in_flight)
            self._spawn(self._finish_drain(backend), f"drain {addr}")
        return True

    async def _finish_drain(self, backend: Backend) -> None:
        while backend.draining and (backend.num_in_flight or backend.num_waiting) and not backend.dead:
            await asyncio.sleep(DRAIN_POLL_S)
        if backend.draining and not backend.dead:  # a dead one was closed already
            log.info("backend %s: drained; closing it", backend.info.addr)
            await self._remove(backend)

    async def _remove(self, backend: Backend) -> None:
        self.router.remove(backend)
        self._beats.pop(backend, None)
        self._probe_beats.pop(backend, None)
        channel = self._channels.pop(backend, None)
        await backend.close()
        if channel is not None:
            await channel.close()

    # ---------------------------------------------------------------- reload
    async def reload(self) -> None:
        """Read the config file again: connect the backends it adds, drain those it drops, set routing."""
        async with self._reloading:
            try:
                fields = reload_fields(self.config)
            except ConfigFileError as exc:
                log.error("reload refused, nothing changed: %s", exc)
                return
            routing_before, self.config = self.config.routing, self.config.replace(**fields)
            if self.config.routing != routing_before:  # the same policy keeps what it learnt (prefix_cache's index)
                self.router.policy = make_policy(self.config)
            wanted = self.config.backend_addrs
            for backend in list(self.backends):
                if backend.info.addr not in wanted:
                    self.drain(backend.info.addr)
                elif backend.draining:
                    backend.draining = False  # listed again before its drain finished: keep it
            new = [a for a in wanted if self.router.find(a) is None]
            results = await asyncio.gather(*(self.connect([a]) for a in new), return_exceptions=True)
            for addr, result in zip(new, results):
                if isinstance(result, BaseException):
                    log.error("reload: backend %s not added: %s", addr, result)
            log.info("reloaded %s: routing %s, backends %s", self.config.config_file, self.config.routing,
                     ", ".join(b.info.addr + (" (draining)" if b.draining else "") for b in self.backends))

    def request_reload(self) -> None:
        """From a signal handler: reload in the background."""
        if self.config.config_file is None:
            log.warning("SIGHUP ignored: the gateway was started without --config")
            return
        self._spawn(self.reload(), "reload")

    # ---------------------------------------------------------------- health
    def start(self) -> None:
        self._monitor = asyncio.create_task(self._watch(), name="backend health")

    async def _watch(self) -> None:
        next_probe_s = 0.0
        while True:
            await asyncio.sleep(self.config.health_check_s)
            try:
                now = time.monotonic()
                for backend in list(self.backends):
                    self._check_beat(backend, now)
                if now >= next_probe_s:
                    next_probe_s = now + self.config.probe_interval_s
                    await asyncio.gather(*(self._probe(b, c) for b, c in list(self._channels.items())))
            except Exception:  # a dead watcher would leave failed backends in routing
                log.exception("backend health check failed")

    def _check_beat(self, backend: Backend, now: float) -> None:
        """Eject a backend that has work and whose heartbeat stood still for its mode's timeout; re-admit it
        when the heartbeat moves, or when it has no work left (an idle engine owes no progress)."""
        beat = backend.heartbeat
        seen, since = self._beats.get(backend, (beat, now))
        if beat != seen or not backend.has_work or backend.stopping:
            self._beats[backend] = (beat, now)  # the clock of a stall starts with pending work
            if backend.readmit():
                log.info("backend %s: %s; routing to it again", backend.info.addr,
                         "heartbeat moves again" if beat != seen else "no work left")
            return
        timeout_s = self.config.heartbeat_timeout_for(backend.info.engine_mode)
        if not backend.ejected and now - since >= timeout_s:
            backend.eject()
            moved = self._move_unstarted(backend)
            log.warning("backend %s (%s engine): no progress for %.1f s with %d requests pending (heartbeat %d); "
                        "ejected from routing until it moves (%d with no token yet moved elsewhere)",
                        backend.info.addr, backend.info.engine_mode, now - since, backend.num_in_flight, beat, moved)

    def _move_unstarted(self, backend: Backend) -> int:
        others = [b for b in self.backends if b is not backend and b.healthy and not b.draining
                  and b.info.model_name == backend.info.model_name]
        if not others:  # nowhere to go: they wait here in case it recovers (or stall_timeout_s fails them)
            return 0
        return backend.fail_unstarted(f"backend {backend.info.addr} stopped making progress")

    async def _probe(self, backend: Backend, channel: grpc.aio.Channel) -> None:
        beat = backend.heartbeat
        if self._probe_beats.get(backend) != beat:
            # the heartbeat moved since the last look: the engine, and so its process, lives. No RPC: on a
            # persistent backend these probes were most of the host CPU it spent while serving
            self._probe_beats[backend] = beat
            return
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=self.config.probe_interval_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and self._probe_beats.get(backend) == beat:
                await self._lose(backend, f"control plane unreachable: {exc.details()}")
        self._probe_beats[backend] = beat

    async def _lose(self, backend: Backend, reason: str) -> None:
        if backend.dead:
            return
        backend.dead = True
        num_failed = backend.fail_all(f"backend {backend.info.addr} died ({reason})")
        log.error("backend %s died (%s): removed from routing, %d requests failed over or ended",
                  backend.info.addr, reason, num_failed)
        await self._remove(backend)
        self._spawn(self._revive(backend.info.addr), f"revive {backend.info.addr}")

    async def _revive(self, addr: str) -> None:
        """Connect again to a lost backend (restarted, or a new one at its address) while it stays listed."""
        config = self.config.replace(connect_timeout_s=max(2.0, self.config.probe_interval_s))
        last_error = ""
        while addr in self.config.backend_addrs and self.router.find(addr) is None:
            try:
                backend = await Backend.connect(addr, config)
            except Exception as exc:  # not back yet; or refused (TLS): said once per change, as it is no wait
                if isinstance(exc, TlsRefused) and str(exc) != last_error:
                    log.error("backend %s: %s", addr, exc)
                last_error = str(exc)
                await asyncio.sleep(self.config.probe_interval_s)
                continue
            log.warning("backend %s is back", addr)
            await self.add(backend, aio_control_channel(addr, self.config.for_backend(addr)))

    # ---------------------------------------------------------------- lifecycle
    def stop_watching(self) -> None:
        """The gateway shuts down: no more ejections or probes (backends stopping beside it are no news)."""
        if self._monitor is not None:
            self._monitor.cancel()

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        tasks = [t for t in (self._monitor, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for backend in list(self.backends):
            await self._remove(backend)
