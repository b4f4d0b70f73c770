"""The gateway's YAML config file (`--config FILE` or BLINK_CONFIG), read at start and again on SIGHUP.

    routing: prefix_affinity          # least_outstanding_tokens (default) | most_free_kv | prefix_affinity | prefix_cache
    heartbeat_timeout_s: 1.0
    backends:                         # control-plane addresses; a reload adds and drains to match
      - 127.0.0.1:50051
      - addr: 127.0.0.1:50061
      - addr: 10.20.0.7:50051         # mutual TLS settings of its own (else backend_ssl_* apply)
        ssl_ca_certs: /etc/blink/tls/site-b-ca.crt
        ssl_certfile: /etc/blink/tls/site-b-gateway.crt
        ssl_keyfile: /etc/blink/tls/site-b-gateway.key

Any other top-level key names a `GatewayConfig` field. Flags and BLINK_* variables override the file
at start; a reload takes only `backends` and `routing` (other fields need a restart). The same SIGHUP re-reads
the TLS files at the paths the gateway started with (`gateway/tls.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from .config import GatewayConfig

RELOADABLE = ("backend_addrs", "backend_tls_by_addr", "routing")
_FIELDS = {f.name for f in dataclasses.fields(GatewayConfig)} - {"config_file", "api_keys", "admin_keys", "backend_addrs",
                                                                  "backend_tls_by_addr",
                                                                  "worker_index",
                                                                  "accept_fd"}  # keys: hashed, in the keys file


class ConfigFileError(ValueError):
    """The file is missing, is not YAML, or names an unknown field or a bad value."""


def read_config_file(path: str | Path) -> dict:
    """`GatewayConfig` fields from the file (`backends` becomes `backend_addrs`)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"cannot read the gateway config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of settings")
    out = {}
    for key, value in data.items():
        if key == "backends":
            out["backend_addrs"] = _backend_addrs(path, value)
            if tls := _backend_tls(path, value):
                out["backend_tls_by_addr"] = tls
        elif key in _FIELDS:
            out[key] = value
        else:
            raise ConfigFileError(f"{path}: unknown setting {key!r}")
    return out


def _backend_addrs(path, value) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigFileError(f"{path}: 'backends' must be a list of HOST:PORT (or {{addr: HOST:PORT}})")
    addrs = [item.get("addr") if isinstance(item, dict) else item for item in value]
    for i, addr in enumerate(addrs):
        if not isinstance(addr, str) or ":" not in addr:
            raise ConfigFileError(f"{path}: backends[{i}] must be HOST:PORT, got {addr!r}")
    if len(set(addrs)) != len(addrs):
        raise ConfigFileError(f"{path}: 'backends' lists an address twice")
    return tuple(addrs)


def _backend_tls(path, value: list) -> dict:
    """{addr: {backend_ssl_*: path}} for the entries that carry ssl_certfile, ssl_keyfile or ssl_ca_certs."""
    out = {}
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            continue
        unknown = set(item) - {"addr", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs"}
        if unknown:
            raise ConfigFileError(f"{path}: backends[{i}]: unknown settings {', '.join(sorted(unknown))} "
                                  f"(known: addr, ssl_certfile, ssl_keyfile, ssl_ca_certs)")
        tls = {f"backend_{k}": v for k, v in item.items() if k != "addr"}
        if tls:
            out[item["addr"]] = tls
    return out


def reload_fields(config: GatewayConfig) -> dict:
    """What a SIGHUP changes: the file's backends and routing, validated as a whole config."""
    fields = {k: v for k, v in read_config_file(config.config_file).items() if k in RELOADABLE}
    if "backend_addrs" in fields:
        fields.setdefault("backend_tls_by_addr", {})  # entries that lost their TLS settings lose them here too
    try:
        config.replace(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigFileError(f"{config.config_file}: {exc}") from None
    return fields
