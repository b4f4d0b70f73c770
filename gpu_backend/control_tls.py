"""The backend's side of mutual TLS with gateways: one set of files (`BackendConfig.control_ssl_*`) for its
gRPC control plane (health included) and its tcp agent, with the flags both commands take.

    blink backend --control-ssl-certfile backend.pem --control-ssl-keyfile backend.key \\
                  --control-ssl-ca-certs gateways-ca.pem        # client certificates required (default 2)

The policy (TLS 1.2+, the CA file alone, reload on SIGHUP for new connections) is protocols/mtls.py's.
"""
from __future__ import annotations

import argparse

from gpu_backend.config import BackendConfig
from protocols.mtls import ServerTls

TLS_FIELDS = ("control_ssl_certfile", "control_ssl_keyfile", "control_ssl_ca_certs", "control_ssl_cert_reqs")


def add_control_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control-ssl-certfile", metavar="FILE", default=None,
                   help="serve the control plane (and the tcp agent) over TLS with this certificate chain (PEM; "
                        "also BLINK_CONTROL_SSL_CERTFILE)")
    p.add_argument("--control-ssl-keyfile", metavar="FILE", default=None,
                   help="its private key (PEM; default: in the certfile; also BLINK_CONTROL_SSL_KEYFILE)")
    p.add_argument("--control-ssl-ca-certs", metavar="FILE", default=None,
                   help="CA that gateways' client certificates must chain to (PEM; also BLINK_CONTROL_SSL_CA_CERTS)")
    p.add_argument("--control-ssl-cert-reqs", type=int, choices=(0, 1, 2), default=2,
                   help="gateways' client certificates: 0 not asked, 1 optional, 2 required (default; Python's "
                        "ssl.CERT_*; also BLINK_CONTROL_SSL_CERT_REQS)")


def control_tls(config: BackendConfig) -> ServerTls | None:
    """The files loaded (TlsFileError, an OSError, names a bad one), or None when TLS is off."""
    if not config.control_tls:
        return None
    return ServerTls(config.control_ssl_certfile, config.control_ssl_keyfile, config.control_ssl_ca_certs,
                     config.control_ssl_cert_reqs, name="control-plane TLS")


def agent_tls_argv(config: BackendConfig) -> list[str]:
    """The flags that hand the backend's TLS files to its tcp agent (paths only, never their contents)."""
    argv = []
    for name in TLS_FIELDS:
        value = getattr(config, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def agent_tls_config(args: argparse.Namespace) -> BackendConfig:
    """A `blink agent`'s TLS settings, validated as a backend's are (ConfigError names a half configuration)."""
    return BackendConfig(**{name: getattr(args, name) for name in TLS_FIELDS})
