"""Assembling and running the gateway: backends, tokenizers, the aiohttp app and its error handling,
the gRPC server beside it on the same event loop, TLS on both (`gateway/tls.py`), and the admin listener
(/metrics and /admin/* apart from the public port, when `admin_port` is set)."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from .api.admin import add_admin_routes, watch_keys_file
from .api.grpc_api import GrpcServer
from .api.http import STATE, add_metrics_route, add_routes, health
from .backends.backend import Backend
from .balance import Adopter
from .backends.pool import BackendPool
from .backends.route import Router, make_policy
from .config import GatewayConfig
from .errors import ApiError, from_http_exception, request_timeout, server_error
from .gc_policy import GcPolicy
from .metrics import Metrics
from .policy.auth import auth_middleware
from .policy.keys import KeyStore
from .policy.quotas import Quotas, attach_shared_table
from .request.tokenize import TokenizerService
from .state import GatewayState
from .streaming.pacing import SetupPacer
from .streaming.poller import poll_checkpoint
from .structured.mask_loop import configure as configure_masks_at_once
from .tls import TlsFiles, tls_files

log = logging.getLogger("blink.gateway")

# Connections the kernel holds for accept(). aiohttp's default of 128 overflows when hundreds of clients
# connect at once while the loop is busy: each connection dropped there waits a second for a SYN-ACK retransmit.
LISTEN_BACKLOG = 1024


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable]):
    """Every failure leaves as an OpenAI error object; a stack trace goes to the log, never to the client."""
    poll_checkpoint()  # aiohttp's part of a new request (parsing, the request object) has just run
    try:
        return await handler(request)
    except ApiError as err:
        return _rejected(request, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _rejected(request, from_http_exception(exc, request.path))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _rejected(request, server_error("the gateway failed to handle this request; see its log"))


def _rejected(request: web.Request, err: ApiError) -> web.Response:
    request.app[STATE].metrics.rejected(err)
    return err.response()


def body_timeout_middleware(timeout_s: float) -> Callable:
    """Slowloris, body half: the whole body must arrive within `timeout_s` of the head, or 408 and close.

    The head's half is aiohttp's keep-alive timer (`header_timeout_s`, see `start_gateway`). Reading
    here caches the body: handlers' `request.read()` then returns it at once."""
    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable]):
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                return await _timed_out(request, timeout_s)
        return await handler(request)
    return middleware


async def _timed_out(request: web.Request, timeout_s: float) -> web.StreamResponse:
    """Send the 408, then close at once: aiohttp would otherwise linger (10 s) reading the rest of the body."""
    response = _rejected(request, request_timeout(f"the request body did not arrive within {timeout_s:g} s "
                                                  "(body_timeout_s)"))
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the transport flushes the 408 before it closes
    return response


def _new_app(config: GatewayConfig, state: GatewayState) -> web.Application:
    middlewares = [error_middleware, auth_middleware(state.keys, config.metrics_key),
                   body_timeout_middleware(config.body_timeout_s)]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[STATE] = state
    return app


def build_app(config: GatewayConfig, state: GatewayState) -> web.Application:
    """The public port's app: the API and /health, and /metrics and /admin/* unless they are apart."""
    app = _new_app(config, state)
    add_routes(app)
    if not config.separate_admin:
        add_metrics_route(app)
        add_admin_routes(app)
    return app


def build_admin_app(config: GatewayConfig, state: GatewayState) -> web.Application:
    """The admin listener's app: /metrics, /admin/* and /health; no API."""
    app = _new_app(config, state)
    app.router.add_get("/health", health)
    add_metrics_route(app)
    add_admin_routes(app)
    return app


class GatewayServer:
    """A started gateway: `url` once listening; `close()` stops it."""

    def __init__(self, config: GatewayConfig, runner: web.AppRunner, pool: BackendPool,
                 grpc_server: GrpcServer | None = None, state: GatewayState | None = None,
                 admin_runner: web.AppRunner | None = None, tls: TlsFiles | None = None):
        self.config = config
        self.state = state
        self.runner = runner
        self.admin_runner = admin_runner  # /metrics and /admin/* apart (None: on the public port)
        self.adopter: Adopter | None = None  # a worker's connections from the supervisor (gateway/balance.py)
        self.pool = pool
        self.grpc_server = grpc_server
        self.tls = tls
        self.keys_watcher: asyncio.Task | None = None

    @property
    def backends(self) -> list[Backend]:
        return self.pool.backends

    @property
    def grpc_port(self) -> int | None:
        return self.grpc_server.port if self.grpc_server else None

    @property
    def port(self) -> int:
        return self.runner.addresses[0][1] if self.runner.addresses else self.config.port  # (passed connections)

    @property
    def url(self) -> str:
        return f"{self._scheme}://{self.config.host}:{self.port}"

    @property
    def admin_port(self) -> int | None:
        return self.admin_runner.addresses[0][1] if self.admin_runner else None

    @property
    def admin_url(self) -> str:
        """Where /metrics and /admin/* answer: the admin listener, else the public port."""
        if self.admin_runner is None:
            return self.url
        return f"{self._scheme}://{self.config.admin_host or self.config.host}:{self.admin_port}"

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def reload(self) -> None:
        """SIGHUP: the TLS files (new connections get the new certificate), and the config file's backends
        and routing when there is a config file."""
        if self.tls is not None:
            self.tls.reload()
        if self.tls is None or self.config.config_file is not None:
            self.pool.request_reload()

    async def close(self) -> None:
        """Both front ends let open streams finish (up to shutdown_timeout_s, together), then the backends go."""
        if self.keys_watcher is not None:
            self.keys_watcher.cancel()
        self.pool.stop_watching()  # backends stopping beside the gateway (Ctrl-C reaches both) are no stall
        if self.adopter is not None:
            self.adopter.close()  # no new connections from the supervisor
        closing = [self.runner.cleanup(), *((self.admin_runner.cleanup(),) if self.admin_runner else ())]
        if self.grpc_server is not None:
            closing.append(self.grpc_server.close(self.config.shutdown_timeout_s))
        await asyncio.gather(*closing)
        await self.pool.close()


async def start_gateway(config: GatewayConfig, backends: Sequence[Backend] | None = None) -> GatewayServer:
    """Connect to the backends (unless given), then listen. Logs 'gateway listening on URL' when ready."""
    tls = tls_files(config)  # first: a bad certificate fails at once, not after the backends' start-up
    configure_masks_at_once(config.grammar_concurrency, config.workers)
    router = Router((), make_policy(config))
    tokenizers: dict[str, TokenizerService] = {}
    executor = ThreadPoolExecutor(max_workers=config.tokenizer_threads, thread_name_prefix="tokenize")

    async def load_tokenizer(backend: Backend) -> None:  # the first backend of each model brings its tokenizer
        name = backend.info.model_name
        if name not in tokenizers:
            tokenizers[name] = await asyncio.get_running_loop().run_in_executor(
                None, TokenizerService, backend.info.model_dir, executor)
    pool = BackendPool(config, router, load_tokenizer)
    if backends is None:
        await pool.connect(config.backend_addrs)
    else:
        for backend in backends:
            await pool.add(backend)
    pool.start()
    state = GatewayState(config=config, router=router, tokenizers=tokenizers,
                         metrics=Metrics(lambda: router.backends),
                         keys=KeyStore(config.keys_file, config.api_keys, config.admin_keys),
                         quotas=Quotas(table=attach_shared_table(config.limits_table)) if config.limits_table else Quotas(),
                         pacer=SetupPacer(config.setup_pacing))
    grpc_server = None
    if config.grpc_port:  # before HTTP: once /health answers, gRPC does too
        grpc_server = GrpcServer(state)
        await grpc_server.start(config.host, config.grpc_port, tls.grpc_credentials() if tls else None)
    ssl_context = tls.context if tls else None
    try:
        # a worker under --worker-balance connections listens on nothing: the supervisor passes it connections
        runner = await _listen(build_app(config, state), config.host, config.port, ssl_context,
                               "--port (or BLINK_GATEWAY_PORT)", listen=config.accept_fd is None)
    except OSError:
        if grpc_server is not None:
            await grpc_server.close(0)
        raise
    server = GatewayServer(config, runner, pool, grpc_server, state, tls=tls)
    state.open_connections = lambda: len(runner.server.connections)
    if config.accept_fd is not None:
        server.adopter = Adopter(config.accept_fd, runner.server, state.open_connections, ssl_context)
    if config.separate_admin:
        try:
            server.admin_runner = await _listen(build_admin_app(config, state), config.admin_host or config.host,
                                                config.admin_port, ssl_context, "--admin-port (or BLINK_ADMIN_PORT)")
        except OSError:
            await server.close()
            raise
    server.keys_watcher = asyncio.create_task(watch_keys_file(state), name="keys file")
    if not state.keys.auth_enabled:
        log.warning("no API key configured: every client is accepted (set BLINK_API_KEY or --api-key)")
    if server.admin_runner is not None:
        log.info("/metrics and /admin/ listening on %s", server.admin_url)
    log.info("gateway listening on %s", server.url)
    return server


async def _listen(app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None,
                  flag: str, listen: bool = True) -> web.AppRunner:
    """A started runner of `app` on host:port (TLS with `ssl_context`); OSError naming `flag` if it cannot.
    listen=False: set up only (its connections come from gateway/balance.py's Adopter)."""
    # handler_cancellation: a client that goes away cancels its handler, which cancels its request.
    # keepalive_timeout is aiohttp's timer on a connection with no request in progress: armed when it
    # opens and when a request ends, not moved by bytes that do not complete a request head. So it
    # closes a slowloris head as well as an idle keep-alive connection: our header timeout.
    config = app[STATE].config
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           shutdown_timeout=config.shutdown_timeout_s, keepalive_timeout=config.header_timeout_s)
    await runner.setup()
    if not listen:
        return runner
    try:
        # reuse_port: the workers of `--workers N` share the port; the kernel spreads connections.
        await web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_port=config.workers > 1,
                          backlog=LISTEN_BACKLOG).start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, f"cannot listen for HTTP on {host}:{port}: {exc.strerror or exc}; "
                                 f"choose another port with {flag}") from None
    return runner


async def serve_forever(config: GatewayConfig) -> None:
    server: GatewayServer | None = None
    loop = asyncio.get_running_loop()

    def reload() -> None:
        if server is None:
            log.warning("SIGHUP ignored: the gateway is still starting")
        else:
            server.reload()
    loop.add_signal_handler(signal.SIGHUP, reload)  # before 'listening' is logged: from then on SIGHUP reloads
    server = await start_gateway(config)
    server.state.gc = gc_policy = GcPolicy(config.gc_freeze_s, config.gc_full_growth_blocks)
    gc_policy.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("gateway stopping")
        gc_policy.stop()
        await server.close()


def run_gateway(config: GatewayConfig) -> None:
    """Run until SIGINT/SIGTERM, on uvloop where it is installed. Blocking: call it from a main thread."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve_forever(config))
        return
    uvloop.run(serve_forever(config))
