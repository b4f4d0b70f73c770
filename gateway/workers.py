"""`--workers N`: N gateway processes on one port, each with its own event loop.

The HTTP port's connections: by default the supervisor accepts them and passes each to the worker with the
fewest open (`--worker-balance connections`, gateway/balance.py); `--worker-balance kernel` has every worker
listen with SO_REUSEPORT and the kernel hash connections to them. gRPC and a separate admin port: SO_REUSEPORT.

The supervisor starts `python -m gateway ARGS --worker-index i` N times, stops them together and passes
SIGHUP on to each (reload: TLS files, config file).
What is per worker: `/admin/status`, `/metrics` and `/health` (each answers for the worker the
connection reached), request ids.
Shared: the port, the keys file and the drained backends (each worker re-reads them within a second
of a change; `gateway/api/admin.py`), the backends' rings, and per-key usage: the supervisor creates one
usage table in /dev/shm before it starts the workers (`gateway/policy/quotas.py`), so a key's limits hold
across them.
On an shm ring worker i owns slots i, i + N, i + 2N, ...; submissions to the ring's one queue are
serialized by a lock file, so the queue's tail word still has one writer at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

from .api.admin import drain_file
from .balance import Listener
from .config import GatewayConfig
from .policy.quotas import create_shared_table
from .server import LISTEN_BACKLOG

log = logging.getLogger("blink.gateway.workers")


def worker_command(argv: list[str], index: int, limits_table: str, accept_fd: int | None = None) -> list[str]:
    fd = ["--accept-fd", str(accept_fd)] if accept_fd is not None else []
    return [sys.executable, "-m", "gateway", *argv, "--worker-index", str(index), "--limits-table", limits_table, *fd]


def limits_table_path(config: GatewayConfig) -> str:
    return f"/dev/shm/blink-gateway-{config.port}-{os.getpid()}.limits"


def supervise(config: GatewayConfig, argv: list[str]) -> int:
    """Run the workers (see `_supervise`) around one shared usage table, removed when they are done."""
    table = limits_table_path(config)
    create_shared_table(table)
    try:
        return _supervise(config, argv, table)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(table)


def _supervise(config: GatewayConfig, argv: list[str], limits_table: str) -> int:
    """Run the workers until a signal or until one exits; then stop the rest. Returns an exit code."""
    num_workers = config.workers
    drained = drain_file(config)
    if drained is not None:
        drained.unlink(missing_ok=True)  # drains do not outlive the gateway that set them
    # Ignored, SIGHUP stays ignored in the workers until their loop takes it (a reload must not kill one
    # that is still starting); here it is passed on to them from the moment they exist.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    listener = None
    if config.worker_balance == "connections":
        try:
            listener = Listener(config.host, config.port, LISTEN_BACKLOG, num_workers)
        except OSError as exc:
            log.error("gateway failed to start: cannot listen for HTTP on %s:%d: %s; choose another port with "
                      "--port (or BLINK_GATEWAY_PORT)", config.host, config.port, exc.strerror or exc)
            return 1
    try:
        return _run(argv, limits_table, num_workers, listener)
    finally:
        if listener is not None:
            listener.close()


def _run(argv: list[str], limits_table: str, num_workers: int, listener: Listener | None) -> int:
    if listener is None:
        procs = [subprocess.Popen(worker_command(argv, i, limits_table)) for i in range(num_workers)]
    else:
        procs = [subprocess.Popen(worker_command(argv, i, limits_table, listener.worker_fd(i)),
                                  pass_fds=(listener.worker_fd(i),)) for i in range(num_workers)]
        listener.after_start()
    log.info("gateway supervisor: %d workers, pids %s; HTTP connections %s", num_workers,
             " ".join(str(p.pid) for p in procs),
             "hashed by the kernel (SO_REUSEPORT)" if listener is None else "to the worker with the fewest open")
    stopping = []

    def stop(signum, _frame):
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def reload(signum, _frame):  # each worker re-reads its TLS files and config file itself
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    signal.signal(signal.SIGHUP, reload)
    while all(p.poll() is None for p in procs):
        if listener is None or stopping:
            if listener is not None and listener.sockets:
                listener.close()  # stopping: new connections are refused, not queued for workers that go
            time.sleep(0.2)
        else:
            listener.poll(0.2)
    if not stopping:
        failed = next(p for p in procs if p.poll() is not None)
        log.error("gateway worker %d exited with %s: stopping the others", procs.index(failed), failed.returncode)
        stop(signal.SIGTERM, None)
    codes = [_wait(p) for p in procs]
    return 0 if stopping else max(1, *codes)


def _wait(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """A worker gets `timeout_s` to finish its open streams after SIGTERM, then it is killed."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
