"""The `blink` command: `serve` (backend + gateway together), `gateway`, `backend`, `model`, `bench`.

This package only wires processes together: `gateway/` and `gpu_backend/` never import each other,
and `serve` runs each as its own process, as they run on separate machines in production.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

from gateway import env as gateway_env
from protocols.shm import stable_ring_name

# gpu_backend is imported inside the backend commands only: `blink gateway` runs on hosts without the
# backend's dependencies (torch), and must not load them.
BACKEND_PACKAGES = ("torch", "safetensors", "gguf", "tqdm", "triton")  # pyproject's `backend` extra, as imported
# `serve` flags passed on to the gateway as given (TLS and the admin listener; BLINK_METRICS_KEY by the environment).
GATEWAY_FLAGS = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs", "admin_host", "admin_port",
                 "backend_ssl_certfile", "backend_ssl_keyfile", "backend_ssl_ca_certs")


def _serve_args(p: argparse.ArgumentParser) -> None:
    from gpu_backend.main import add_backend_args

    p.add_argument("--host", default="127.0.0.1", help="gateway address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="port of the gateway's gRPC API (default BLINK_GRPC_PORT or 50052; 0: off)")
    p.add_argument("--control-port", type=int, default=0,
                   help="the backend's control-plane port on 127.0.0.1 (default: a free one, so that instances "
                        "never meet; --control HOST:PORT sets the whole address)")
    p.add_argument("--admin-key", default=None, help="key of the gateway's admin API (/admin/, blinkctl); "
                   "also BLINK_ADMIN_KEY (default: no admin API)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for start-up")
    for dest in GATEWAY_FLAGS:  # docs/operations.md, "TLS"
        p.add_argument("--" + dest.replace("_", "-"), type=int if dest in ("ssl_cert_reqs", "admin_port") else str,
                       help=f"the gateway's --{dest.replace('_', '-')} (see `blink gateway --help`)")
    add_backend_args(p)
    p.set_defaults(control=None)  # serve's default is a free port (--control-port), not the backend's 50051


def serve(args: argparse.Namespace) -> int:
    """Start a backend and a gateway, wait until the API answers, stop both together."""
    env = _serve_env(args)
    grpc_port = args.grpc_port if args.grpc_port is not None else int(env.get(gateway_env.GRPC_PORT.name) or 50052)
    if taken := _taken_ports(args, grpc_port):
        print(f"blink serve: {taken}", file=sys.stderr)
        return 2
    control = args.control or f"127.0.0.1:{args.control_port or _free_port()}"
    # A name stable across restarts (the gateway's address, which no other instance can hold while this one
    # runs): a backend that crashed leaves its ring behind, and the next `serve` on that port reclaims it.
    ring = args.ring or stable_ring_name(f"{args.host}:{args.port}", prefix="blink-serve")
    backend = subprocess.Popen([sys.executable, "-m", "blink.cli", "backend", *_backend_argv(args), "--ring", ring,
                                "--control", control], env=env)
    # --expect-ring: should the control port belong to another instance, the gateway refuses its ring
    gateway = subprocess.Popen([sys.executable, "-m", "blink.cli", "gateway", "--host", args.host,
                                "--port", str(args.port), "--grpc-port", str(grpc_port), "--backend", control,
                                "--expect-ring", ring, *_gateway_flags(args)], env=env)
    procs = [backend, gateway]
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        tls = bool(args.ssl_certfile or gateway_env.SSL_CERTFILE.get() or _config_file_sets_tls())
        if _wait_ready(_readiness(args.host, args.port, tls), procs, args.ready_timeout, stopping):
            grpc_api = f"gRPC API on {args.host}:{grpc_port}{' (TLS)' if tls else ''}, " if grpc_port else ""
            print(f"blink serving the OpenAI API on {'https' if tls else 'http'}://{args.host}:{args.port}/v1 "
                  f"({grpc_api}backend control plane on {control})", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        _stop_all([gateway, backend])
    failed = [p.returncode for p in procs if p.returncode not in (0, -signal.SIGTERM, None)]
    return 0 if stopping or not failed else 1


def _serve_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: the API key (generated and printed if none is set), the admin key."""
    key = gateway_env.API_KEY.get() or secrets.token_urlsafe(24)
    if not gateway_env.API_KEY.get():
        print(f"BLINK_API_KEY not set; generated API key: {key}", flush=True)
    env = {**os.environ, gateway_env.API_KEY.name: key}
    if args.admin_key:  # by the environment: a key on a command line shows in `ps`
        env[gateway_env.ADMIN_KEY.name] = args.admin_key
    return env


def _taken_ports(args: argparse.Namespace, grpc_port: int) -> str:
    """Which listening address of this instance another process holds, naming its flag ('' if none)."""
    from gpu_backend.main import listen_error, split_address

    wanted = [(args.host, args.port, "--port"), (args.host, grpc_port, "--grpc-port or BLINK_GRPC_PORT")]
    if args.control:
        wanted.append((*split_address(args.control), "--control"))
    elif args.control_port:
        wanted.append(("127.0.0.1", args.control_port, "--control-port"))
    for host, port, flag in wanted:
        if port and (exc := listen_error(host, port)):
            return f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another with {flag}"
    return ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _backend_argv(args: argparse.Namespace) -> list[str]:
    """The backend flags of a `serve` invocation that differ from their defaults (--ring and --control apart)."""
    from gpu_backend.main import add_backend_args

    probe = argparse.ArgumentParser(add_help=False)
    add_backend_args(probe)
    argv = []
    for action in probe._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in ("ring", "control") or value is None or value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            argv.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true / store_false / store_const: its flag sets `value` or does nothing
            if value == action.const:
                argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def _gateway_flags(args: argparse.Namespace) -> list[str]:
    return [arg for dest in GATEWAY_FLAGS if getattr(args, dest) is not None
            for arg in ("--" + dest.replace("_", "-"), str(getattr(args, dest)))]


def _config_file_sets_tls() -> bool:
    """Whether the gateway's config file (BLINK_CONFIG) turns TLS on; a bad file is the gateway's to report."""
    from gateway.config_file import ConfigFileError, read_config_file

    path = gateway_env.CONFIG.get()
    try:
        return bool(path and read_config_file(path).get("ssl_certfile"))
    except ConfigFileError:
        return False


def _readiness(host: str, port: int, tls: bool) -> Callable[[], bool]:
    """Plain HTTP: /health answers 200. TLS: the port accepts (serve holds no client certificate that
    `--ssl-cert-reqs 2` would ask for; the gateway listens only once its backend has answered)."""
    def health() -> bool:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1) as resp:
            return resp.status == 200

    def listening() -> bool:
        with socket.create_connection((host, port), timeout=1):
            return True
    return listening if tls else health


def _wait_ready(ready: Callable[[], bool], procs: list[subprocess.Popen], timeout_s: float, stopping: list) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            if ready():
                return True
        except OSError:
            pass
        time.sleep(0.2)
    print(f"blink serve: not ready after {timeout_s:.0f} s", file=sys.stderr)
    return False


def _stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _gateway(argv: list[str]) -> int:
    from gateway.main import main as gateway_main

    return gateway_main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    from gpu_backend.main import add_backend_args
    from gpu_backend.tcp_agent import add_agent_args

    parser = argparse.ArgumentParser(prog="blink", description="CPU-free LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(sub.add_parser("serve", help="run a backend and the gateway together"))
    add_backend_args(sub.add_parser("backend", help="run one backend (engine + ring + control plane)"))
    sub.add_parser("gateway", help="run the OpenAI-compatible gateway (see `blink gateway --help`)", add_help=False)
    add_agent_args(sub.add_parser("agent", help="relay a backend's ring to gateways on other hosts (tcp transport)"))
    from gpu_backend.models.cli import add_model_commands

    add_model_commands(sub)
    from blink.bench.cli import add_bench_args

    add_bench_args(sub.add_parser("bench", help="load generator and CPU interference (see `blink bench --help`)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=gateway_env.LOG_LEVEL.get(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv[:1] == ["gateway"]:
        return _gateway(argv[1:])
    try:
        parser = build_parser()
    except ModuleNotFoundError as exc:  # a gateway-only install (`pip install 'blink-serve[gateway]'`)
        if (exc.name or "").partition(".")[0] not in BACKEND_PACKAGES:
            raise
        print(f"blink: this install has only the gateway; the other commands need the backend's packages "
              f"(no module {exc.name!r}): pip install 'blink-serve[backend]'", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "backend":
        from gpu_backend.main import run_backend

        return run_backend(args)
    if args.command == "bench":
        from blink.bench.cli import run_bench

        return run_bench(args)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
