"""Every environment variable the gateway reads, in one table: name, default, what it sets, what it means.

Nothing else in `gateway/` (or the gateway's part of `blink/cli.py`) reads `os.environ`: it asks a variable
here (`CACHE.get()`), or takes the `GatewayConfig` fields the variables set (`config_overrides`). Flags
override these; these override the config file (`gateway/main.py`)."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "BLINK_"


def _names(text: str) -> frozenset[str]:
    return frozenset(k.strip() for k in text.split(",") if k.strip())


def _addrs(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


@dataclass(frozen=True)
class EnvVar:
    """One variable: `field` is the `GatewayConfig` field it sets (None: a module reads it with `get`)."""

    name: str
    doc: str
    default: str | None = None
    field: str | None = None
    parse: Callable[[str], object] = str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """Its value (an empty one counts as unset), else its default."""
        return (os.environ if environ is None else environ).get(self.name) or self.default

    def value(self, environ: Mapping[str, str] | None = None):
        """Its value parsed (None when unset and without a default); ValueError names the variable."""
        raw = self.get(environ)
        if raw is None:
            return None
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r}: {exc}") from None


API_KEY = EnvVar(f"{PREFIX}API_KEY", "accepted API keys, comma-separated (--api-key)", field="api_keys", parse=_names)
ADMIN_KEY = EnvVar(f"{PREFIX}ADMIN_KEY", "admin API keys, comma-separated (--admin-key)", field="admin_keys",
                   parse=_names)
KEYS_FILE = EnvVar(f"{PREFIX}KEYS_FILE", "YAML file of hashed keys with per-key limits (--keys-file)",
                   field="keys_file")
WORKERS = EnvVar(f"{PREFIX}WORKERS", "gateway processes sharing the port (--workers)", field="workers", parse=int)
WORKER_BALANCE = EnvVar(f"{PREFIX}WORKER_BALANCE", "how the workers share the HTTP port's connections: connections "
                        "or kernel (--worker-balance)", field="worker_balance")
GATEWAY_HOST = EnvVar(f"{PREFIX}GATEWAY_HOST", "address the HTTP API listens on (--host)", field="host")
GATEWAY_PORT = EnvVar(f"{PREFIX}GATEWAY_PORT", "port of the HTTP API (--port)", field="port", parse=int)
GRPC_PORT = EnvVar(f"{PREFIX}GRPC_PORT", "port of the gRPC API, 0: off (--grpc-port)", field="grpc_port", parse=int)
LOG_FORMAT = EnvVar(f"{PREFIX}LOG_FORMAT", "text or json (--log-format)", field="log_format")
BACKENDS = EnvVar(f"{PREFIX}BACKENDS", "backends' control-plane addresses, comma-separated (--backend)",
                  field="backend_addrs", parse=_addrs)
CONFIG = EnvVar(f"{PREFIX}CONFIG", "YAML config file, re-read on SIGHUP (--config)", field="config_file")
MAX_BODY_BYTES = EnvVar(f"{PREFIX}MAX_BODY_BYTES", "largest request body accepted (--max-body-bytes)",
                        field="max_body_bytes", parse=int)
HEADER_TIMEOUT = EnvVar(f"{PREFIX}HEADER_TIMEOUT", "seconds a connection has to send a request head",
                        field="header_timeout_s", parse=float)
BODY_TIMEOUT = EnvVar(f"{PREFIX}BODY_TIMEOUT", "seconds a request has to send its body after its head",
                      field="body_timeout_s", parse=float)
LOG_LEVEL = EnvVar(f"{PREFIX}LOG_LEVEL", "log level of the `blink` command's processes", default="INFO")
CACHE = EnvVar(f"{PREFIX}CACHE", "where built native libraries (and models) are cached",
               default=str(Path("~/.cache/blink")), parse=lambda text: Path(text).expanduser())
CC = EnvVar("CC", "C compiler of the native stream round (default: the first of gcc, cc, clang on PATH)")
SLOT_WAIT = EnvVar(f"{PREFIX}SLOT_WAIT", "seconds a request waits for a free ring slot before a 503 with "
                   "Retry-After (--slot-wait)", field="slot_wait_s", parse=float)

VARIABLES: tuple[EnvVar, ...] = (API_KEY, ADMIN_KEY, KEYS_FILE, WORKERS, WORKER_BALANCE, GATEWAY_HOST, GATEWAY_PORT,
                                 GRPC_PORT,
                                 LOG_FORMAT, BACKENDS, CONFIG, MAX_BODY_BYTES, HEADER_TIMEOUT, BODY_TIMEOUT,
                                 LOG_LEVEL, CACHE, CC, SLOT_WAIT)

# TLS and the admin listener (gateway/tls.py, docs/operations.md "TLS"), as the flags of the same names.
SSL_CERTFILE = EnvVar(f"{PREFIX}SSL_CERTFILE", "TLS certificate chain, PEM (--ssl-certfile)", field="ssl_certfile")
SSL_KEYFILE = EnvVar(f"{PREFIX}SSL_KEYFILE", "TLS private key, PEM (--ssl-keyfile)", field="ssl_keyfile")
SSL_CA_CERTS = EnvVar(f"{PREFIX}SSL_CA_CERTS", "CA that signs client certificates, PEM (--ssl-ca-certs)",
                      field="ssl_ca_certs")
SSL_CERT_REQS = EnvVar(f"{PREFIX}SSL_CERT_REQS", "client certificates: 0 none, 1 optional, 2 required "
                       "(--ssl-cert-reqs)", field="ssl_cert_reqs", parse=int)
ADMIN_HOST = EnvVar(f"{PREFIX}ADMIN_HOST", "address of the /metrics and /admin listener (--admin-host)",
                    field="admin_host")
ADMIN_PORT = EnvVar(f"{PREFIX}ADMIN_PORT", "port of the /metrics and /admin listener (--admin-port)",
                    field="admin_port", parse=int)
METRICS_KEY = EnvVar(f"{PREFIX}METRICS_KEY", "key /metrics asks for as a bearer token (--metrics-key)",
                     field="metrics_key")
VARIABLES += (SSL_CERTFILE, SSL_KEYFILE, SSL_CA_CERTS, SSL_CERT_REQS, ADMIN_HOST, ADMIN_PORT, METRICS_KEY)

# Mutual TLS toward the backends (control planes and tcp agents; docs/operations.md "TLS to the backends").
BACKEND_SSL_CERTFILE = EnvVar(f"{PREFIX}BACKEND_SSL_CERTFILE", "the gateway's client certificate toward backends, "
                              "PEM (--backend-ssl-certfile)", field="backend_ssl_certfile")
BACKEND_SSL_KEYFILE = EnvVar(f"{PREFIX}BACKEND_SSL_KEYFILE", "its private key, PEM (--backend-ssl-keyfile)",
                             field="backend_ssl_keyfile")
BACKEND_SSL_CA_CERTS = EnvVar(f"{PREFIX}BACKEND_SSL_CA_CERTS", "CA that signs the backends' certificates, PEM; "
                              "set: backends are dialled over TLS (--backend-ssl-ca-certs)", field="backend_ssl_ca_certs")
VARIABLES += (BACKEND_SSL_CERTFILE, BACKEND_SSL_KEYFILE, BACKEND_SSL_CA_CERTS)

# Diagnostics (docs/operations.md "Logs"): off unless set; the structured outputs' mask step limit.
MASK_STATS_S = EnvVar(f"{PREFIX}MASK_STATS_S", "seconds between each gateway worker's log line of its token-mask "
                      "steps (queued, computed, late-risk counts; gateway/structured/mask_loop.py MaskStats)",
                      parse=float)
MASK_STEP_LIMIT_S = EnvVar(f"{PREFIX}MASK_STEP_LIMIT_S", "seconds one token's mask step (queued and computed) may take "
                           "before its request ends with an error, default 5 (gateway/structured/mask_loop.py): "
                           "raise it where the gateway's cores are slow or shared", default="5", parse=float)
VARIABLES += (MASK_STATS_S, MASK_STEP_LIMIT_S)


def config_overrides(environ: Mapping[str, str] | None = None) -> dict:
    """The `GatewayConfig` fields the set variables give (unset ones give nothing)."""
    out = {}
    for var in VARIABLES:
        if var.field is not None and var.get(environ) is not None:
            out[var.field] = var.value(environ)
    return out

