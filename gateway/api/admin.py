"""The admin HTTP API under /admin/ (admin key only; `blinkctl` is its client).

    GET    /admin/status              uptime, this worker, backends, requests in flight (total, per key)
    GET    /admin/backends            health, load, KV usage, draining, per backend
    POST   /admin/backends/drain      {"addr": "HOST:PORT"}: the router sends it no new request
    POST   /admin/backends/undrain    {"addr": "HOST:PORT"}
    GET    /admin/keys                names, roles, limits (never hashes)
    POST   /admin/keys                {"name", "role"?, limits..., "cache_salt"?}: the new key, shown once
    DELETE /admin/keys/{name}
    POST   /admin/reload              re-read the keys file
    POST   /admin/gc                  a full garbage collection now: what it found, by type (gateway/gc_policy.py)

With `--workers N` each call reaches one worker: status and in-flight counts are that worker's.
Keys are shared through the keys file, drains through a small file named after the port
(`drain_file`): every worker re-reads both within a second of a change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from aiohttp import web

from ..errors import ApiError, bad_request
from ..gc_policy import GcPolicy
from ..policy.keys import LIMIT_FIELDS, KeyLimits, KeysFileError
from ..state import GatewayState

log = logging.getLogger("blink.gateway.admin")

KEYS_CHECK_S = 1.0  # how often a worker looks at the keys file's modification time
_STARTED_S = time.monotonic()


def _state(request: web.Request) -> GatewayState:
    from .http import STATE  # http imports pipeline; import late to keep admin independent of the routes

    return request.app[STATE]


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/status", status)
    app.router.add_get("/admin/backends", backends)
    app.router.add_post("/admin/backends/drain", drain)
    app.router.add_post("/admin/backends/undrain", undrain)
    app.router.add_get("/admin/keys", list_keys)
    app.router.add_post("/admin/keys", add_key)
    app.router.add_delete("/admin/keys/{name}", remove_key)
    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/gc", collect_garbage)


def backend_report(backend) -> dict:
    report = {"addr": backend.info.addr, "model": backend.info.model_name, "engine": backend.info.engine_mode,
              "transport": backend.info.transport, "stalled": backend.stalled,
              "draining": getattr(backend, "draining", False), "load": round(backend.load, 3),
              "in_flight": backend.num_in_flight, "waiting": backend.num_waiting, "free_slots": backend.free_slots,
              "native_stream": getattr(backend, "native_stream", "off"),  # gateway/streaming/stream_round.py
              "native_streams": getattr(backend, "num_native_streams", 0),
              "link_error": getattr(backend, "link_error", None)}  # e.g. its tcp agent refused our certificate
    try:
        stats = backend.engine_stats()
        total = stats["total_kv_blocks"]
        report.update(serving=backend.serving, heartbeat=backend.heartbeat, running=stats["running"],
                      kv_usage=round((total - stats["free_kv_blocks"]) / total, 3) if total else 0.0)
        if "cached_kv_blocks" in stats:  # a backend with a prefix cache
            report["cached_kv_blocks"] = stats["cached_kv_blocks"]
    except (TypeError, ValueError, KeyError):  # the ring is gone: the gateway is stopping
        report["serving"] = False
    return report


async def status(request: web.Request) -> web.Response:
    state = _state(request)
    in_flight = sum(b.num_in_flight for b in state.router.backends)
    return web.json_response({
        "uptime_s": round(time.monotonic() - _STARTED_S, 1), "pid": os.getpid(),
        "worker": state.config.worker_index, "workers": state.config.workers,
        "in_flight": in_flight, "in_flight_by_key": state.quotas.in_flight(),
        "connections": state.open_connections() if state.open_connections is not None else None,
        "backends": [backend_report(b) for b in state.router.backends],
        "gc": state.gc.report() if state.gc is not None else None})


async def collect_garbage(request: web.Request) -> web.Response:
    """A full collection now, counted by type (two collections: it stops this worker for 150-165 ms with 512
    streams open on the 2-vCPU test VM; bench/RESULTS.md).
    `unreachable` counts the objects in reference cycles it freed; `by_type` names the most common."""
    state = _state(request)
    policy = state.gc if state.gc is not None else GcPolicy(freeze_s=0)  # in-process gateways (tests)
    return web.json_response(policy.full_collection(reason="asked", by_type=True))


async def backends(request: web.Request) -> web.Response:
    return web.json_response({"backends": [backend_report(b) for b in _state(request).router.backends]})


async def drain(request: web.Request) -> web.Response:
    return await _set_draining(request, True)


async def undrain(request: web.Request) -> web.Response:
    return await _set_draining(request, False)


async def _set_draining(request: web.Request, draining: bool) -> web.Response:
    addr = (await _body(request)).get("addr")
    if not isinstance(addr, str) or not addr:
        raise bad_request("'addr' must name a backend (HOST:PORT)", "addr")
    matched = [b for b in _state(request).router.backends if b.info.addr == addr]
    if not matched:
        known = ", ".join(b.info.addr for b in _state(request).router.backends)
        raise ApiError(404, f"no backend {addr!r}; this gateway has: {known}", param="addr", code="not_found")
    for backend in matched:
        backend.draining = draining  # the router skips draining backends; requests in flight finish
    path = drain_file(_state(request).config)
    if path is not None:  # tell the other workers
        drained = read_drained(path)
        write_drained(path, drained | {addr} if draining else drained - {addr})
    log.warning("backend %s %s by the admin API", addr, "drained" if draining else "undrained")
    return web.json_response({"backends": [backend_report(b) for b in matched]})


async def list_keys(request: web.Request) -> web.Response:
    state = _state(request)
    state.keys.maybe_reload()
    return web.json_response({"keys": state.keys.listing(), "file": str(state.keys.path or "")})


async def add_key(request: web.Request) -> web.Response:
    body = await _body(request)
    unknown = set(body) - {"name", "role", "cache_salt", *LIMIT_FIELDS}
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
    try:
        limits = KeyLimits(**{k: body[k] for k in LIMIT_FIELDS if body.get(k) is not None})
        key = _state(request).keys.add(str(body.get("name", "")), body.get("role", "client"), limits,
                                       body.get("cache_salt"))
    except KeysFileError as exc:
        raise bad_request(str(exc), "cache_salt" if "cache_salt" in str(exc) else "name") from None
    return web.json_response({"name": body["name"], "key": key}, status=201)


async def remove_key(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        removed = _state(request).keys.remove(name)
    except KeysFileError as exc:
        raise bad_request(str(exc), "name") from None
    if not removed:
        raise ApiError(404, f"no key named {name!r}", param="name", code="not_found")
    return web.json_response({"removed": name})


async def reload(request: web.Request) -> web.Response:
    keys = _state(request).keys
    try:
        keys.reload()
    except KeysFileError as exc:
        raise bad_request(f"the keys file was not reloaded: {exc}") from None
    return web.json_response({"keys": len(keys.records), "file": str(keys.path or "")})


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        raise bad_request("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def drain_file(config) -> Path | None:
    """Where the workers of one port share their drained backends (None: a single worker)."""
    if config.workers == 1:
        return None
    return Path(tempfile.gettempdir()) / f"blink-gateway-{config.port}.drained.json"


def read_drained(path: Path) -> set[str]:
    try:
        return set(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError):
        return set()


def write_drained(path: Path, addrs: set[str]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(sorted(addrs)))
    os.replace(tmp, path)


async def watch_keys_file(state: GatewayState) -> None:
    """Re-read the keys file when it changes (another worker or `blinkctl keys` wrote it), and the
    drained backends of the other workers."""
    path, drained_stamp = drain_file(state.config), None
    while True:
        await asyncio.sleep(KEYS_CHECK_S)
        try:
            if state.keys.maybe_reload():
                log.info("keys file %s reloaded: %d keys", state.keys.path, len(state.keys.records))
        except (KeysFileError, OSError) as exc:  # keep the keys we have; say why
            log.error("keys file %s not reloaded: %s", state.keys.path, exc)
        if path is not None and (stamp := _mtime(path)) != drained_stamp:
            drained_stamp, drained = stamp, read_drained(path)
            for backend in state.router.backends:
                backend.draining = backend.info.addr in drained


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
