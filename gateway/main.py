"""Command line: `python -m gateway --backend 127.0.0.1:50051 --port 8000 --grpc-port 50052 --api-key KEY`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .backends.backend import BackendConnectError
from .config import ROUTING_POLICIES, WORKER_BALANCES, GatewayConfig
from .config_file import read_config_file
from .env import config_overrides
from .logs import LOG_FORMATS, setup_logging
from .server import run_gateway
from .workers import supervise

log = logging.getLogger("blink.gateway")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="blink-gateway", description="OpenAI-compatible gateway for blink backends")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--grpc-port", type=int, help="port of the gRPC inference API (default 50052; 0: off; "
                   "also BLINK_GRPC_PORT)")
    p.add_argument("--config", dest="config_file", metavar="FILE",
                   help="YAML file of backends, routing and other settings; re-read on SIGHUP (also BLINK_CONFIG)")
    p.add_argument("--routing", choices=ROUTING_POLICIES, help="how requests are spread over backends "
                   "(default least_outstanding_tokens)")
    p.add_argument("--backend", action="append", dest="backends", metavar="HOST:PORT",
                   help="a backend's control-plane address; repeat for several (default 127.0.0.1:50051)")
    p.add_argument("--expect-ring", metavar="NAME",
                   help="refuse the backend unless its Describe names this ring (`blink serve` sets it, so that "
                   "a gateway never adopts another instance's backend); needs exactly one --backend")
    p.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                   help="accepted API key; repeat for several (also BLINK_API_KEY, comma-separated)")
    p.add_argument("--admin-key", action="append", dest="admin_keys", metavar="KEY",
                   help="key of the admin API (/admin/, blinkctl); repeat for several (also BLINK_ADMIN_KEY)")
    p.add_argument("--keys", dest="keys_file", metavar="FILE",
                   help="YAML keys file: hashed client/admin keys with per-key limits (also BLINK_KEYS_FILE; "
                   "`blinkctl keys add` writes it)")
    p.add_argument("--workers", type=int, help="gateway processes sharing the port (SO_REUSEPORT; default 1; "
                   "also BLINK_WORKERS); per-key limits hold across them")
    p.add_argument("--worker-balance", choices=WORKER_BALANCES,
                   help="how the workers share the HTTP port: 'connections' (default) passes each new connection to "
                   "the worker with the fewest open, 'kernel' leaves it to SO_REUSEPORT's hash (also "
                   "BLINK_WORKER_BALANCE)")
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor for its workers
    p.add_argument("--accept-fd", type=int, help=argparse.SUPPRESS)  # likewise: where its connections come from
    p.add_argument("--limits-table", help=argparse.SUPPRESS)  # likewise: the shared per-key usage file
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--no-setup-pacing", dest="setup_pacing", action="store_const", const=False,
                   help="run every ready request set-up at once instead of one per event-loop pass "
                        "(gateway/streaming/pacing.py; for measuring)")
    p.add_argument("--no-native-stream", dest="native_stream", action="store_const", const=False,
                   help="deliver every streamed token from Python, not from the poller's C round "
                        "(gateway/streaming/stream_round.py; for measuring and debugging)")
    p.add_argument("--header-timeout", type=float, dest="header_timeout_s", metavar="SECONDS",
                   help="close a connection that has not sent a whole request head this long after it opened "
                   "or after its previous request ended (slowloris; also idle keep-alive; default 10; "
                   "also BLINK_HEADER_TIMEOUT)")
    p.add_argument("--body-timeout", type=float, dest="body_timeout_s", metavar="SECONDS",
                   help="answer 408 and close when a request body takes longer than this to arrive "
                   "(default 30; also BLINK_BODY_TIMEOUT)")
    p.add_argument("--default-max-tokens", type=int,
                   help="output budget of a request that sets no max_tokens, on every endpoint (default: "
                   "16 for /v1/completions and gRPC Generate, as OpenAI; for chat what the context leaves)")
    p.add_argument("--slot-wait", type=float, dest="slot_wait_s", metavar="SECONDS",
                   help="how long a request waits for a free ring slot before a 503 with Retry-After (load "
                   "shedding; default 30; also BLINK_SLOT_WAIT)")
    p.add_argument("--connect-timeout", type=float, dest="connect_timeout_s",
                   help="seconds to wait for each backend's Describe at start-up (default 300)")
    _tls_args(p)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="text (default) or json: one JSON object per line (also BLINK_LOG_FORMAT)")
    return p.parse_args(argv)


def _tls_args(p: argparse.ArgumentParser) -> None:
    """TLS (vLLM's flag names) and the admin listener; docs/operations.md, "TLS"."""
    p.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS and gRPC over TLS with this certificate "
                   "chain (PEM); re-read on SIGHUP (also BLINK_SSL_CERTFILE)")
    p.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM; default: in the "
                   "--ssl-certfile; also BLINK_SSL_KEYFILE)")
    p.add_argument("--ssl-ca-certs", metavar="FILE", help="CA certificates that client certificates must chain to "
                   "(PEM; also BLINK_SSL_CA_CERTS)")
    p.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), help="client certificates: 0 not asked "
                   "(default), 1 optional, 2 required (Python's ssl.CERT_*; also BLINK_SSL_CERT_REQS)")
    p.add_argument("--admin-host", help="address of the /metrics and /admin/ listener (default --host; "
                   "also BLINK_ADMIN_HOST)")
    p.add_argument("--admin-port", type=int, help="serve /metrics and /admin/ on this port only, not on the "
                   "API's (0: a free one; also BLINK_ADMIN_PORT)")
    p.add_argument("--metrics-key", metavar="KEY", help="/metrics asks for 'Authorization: Bearer KEY' (prefer "
                   "BLINK_METRICS_KEY: a flag shows in ps)")
    p.add_argument("--backend-ssl-certfile", metavar="FILE", help="mutual TLS toward backends: the gateway's client "
                   "certificate (PEM; also BLINK_BACKEND_SSL_CERTFILE)")
    p.add_argument("--backend-ssl-keyfile", metavar="FILE", help="its private key (PEM; default: in the "
                   "--backend-ssl-certfile; also BLINK_BACKEND_SSL_KEYFILE)")
    p.add_argument("--backend-ssl-ca-certs", metavar="FILE", help="dial backends' control planes and tcp agents over "
                   "TLS, trusting this CA only (PEM; also BLINK_BACKEND_SSL_CA_CERTS)")


def config_from_args(args: argparse.Namespace, environ=None) -> GatewayConfig:
    """Defaults, then the config file, then BLINK_* environment variables, then flags."""
    env = config_overrides(environ)
    config_file = args.config_file or env.get("config_file")
    fields = read_config_file(config_file) if config_file else {}
    fields.update(env)
    flags = {"host": args.host, "port": args.port, "grpc_port": args.grpc_port, "log_format": args.log_format,
             "max_body_bytes": args.max_body_bytes, "header_timeout_s": args.header_timeout_s,
             "body_timeout_s": args.body_timeout_s, "slot_wait_s": args.slot_wait_s,
             "default_max_tokens": args.default_max_tokens, "config_file": args.config_file,
             "routing": args.routing, "connect_timeout_s": args.connect_timeout_s,
             "backend_addrs": tuple(args.backends) if args.backends else None, "expect_ring": args.expect_ring,
             "api_keys": frozenset(args.api_keys) if args.api_keys else None,
             "admin_keys": frozenset(args.admin_keys) if args.admin_keys else None,
             "keys_file": args.keys_file, "workers": args.workers, "worker_index": args.worker_index,
             "worker_balance": args.worker_balance, "accept_fd": args.accept_fd,
             "limits_table": args.limits_table, "setup_pacing": args.setup_pacing,
             "native_stream": args.native_stream, "ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile,
             "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs, "admin_host": args.admin_host,
             "admin_port": args.admin_port, "metrics_key": args.metrics_key,
             "backend_ssl_certfile": args.backend_ssl_certfile, "backend_ssl_keyfile": args.backend_ssl_keyfile,
             "backend_ssl_ca_certs": args.backend_ssl_ca_certs}
    fields.update({k: v for k, v in flags.items() if v is not None})
    return GatewayConfig(**fields)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        setup_logging(args.log_level)
        log.error("bad gateway configuration: %s", exc)
        return 2
    setup_logging(args.log_level, config.log_format)
    if config.workers > 1 and args.worker_index is None:
        return supervise(config, list(argv if argv is not None else sys.argv[1:]))
    try:
        run_gateway(config)
    except (BackendConnectError, OSError) as exc:  # OSError: the port is taken, a file is missing
        log.error("gateway failed to start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
