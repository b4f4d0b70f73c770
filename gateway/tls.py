"""TLS for the gateway's listeners: one server `ssl.SSLContext` for HTTPS (public and admin listeners) and
gRPC credentials from the same files (`GatewayConfig.ssl_*`, vLLM's flag names); and the client side of
mutual TLS toward backends (`GatewayConfig.backend_ssl_*`: their control planes and tcp agents).

The policy and the reload are `protocols/mtls.py`'s, shared with the backends: TLS 1.2 and later, peers
checked against the configured CA alone, SIGHUP re-reads the files for new connections while open ones go
on, a failed reload keeps the old certificate, and logs name files and fingerprints, never key material.
"""

from __future__ import annotations

import socket
import ssl

import grpc

from protocols.mtls import CERT_REQS, MIN_VERSION, ServerTls, TlsFileError, client_context, fingerprint
from protocols.mtls import grpc_channel_credentials

from .config import GatewayConfig

__all__ = ["CERT_REQS", "MIN_VERSION", "TlsFileError", "TlsFiles", "fingerprint", "tls_files",
           "backend_ssl_context", "backend_channel_credentials", "tls_refusal", "plaintext_refusal"]


class TlsFiles(ServerTls):
    """The gateway's listener TLS state: `context` for aiohttp listeners, `grpc_credentials()` for the gRPC
    server, and `reload()` for both. Use from the event loop's thread (grpc's fetcher only swaps a reference)."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        super().__init__(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_cert_reqs)


def tls_files(config: GatewayConfig) -> TlsFiles | None:
    """The gateway's TLS state, or None when TLS is off (no ssl_certfile)."""
    return TlsFiles(config) if config.tls else None


def backend_ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The client context for backends' tcp agents (files read now), or None when backend TLS is off."""
    if not config.backend_tls:
        return None
    return client_context(config.backend_ssl_certfile, config.backend_ssl_keyfile, config.backend_ssl_ca_certs)


def backend_channel_credentials(config: GatewayConfig) -> grpc.ChannelCredentials | None:
    """gRPC credentials for backends' control planes (files read now), or None when backend TLS is off."""
    if not config.backend_tls:
        return None
    return grpc_channel_credentials(config.backend_ssl_certfile, config.backend_ssl_keyfile,
                                    config.backend_ssl_ca_certs)


def tls_refusal(addr: str, config: GatewayConfig, timeout_s: float = 2.0) -> str | None:
    """Why a TLS session with the backend at HOST:PORT fails, in words, or None (it succeeds, or nothing
    listens there: not a TLS matter). gRPC says only "Deadline Exceeded" when a handshake fails; this asks
    the handshake itself. With TLS 1.3 a server judges the client's certificate after the client's side of
    the handshake is done, so its verdict is the first read: an alert, or (gRPC's servers) a bare close."""
    host, _, port = addr.rpartition(":")
    context = backend_ssl_context(config)
    context.set_alpn_protocols(["h2"])  # as gRPC offers: a gRPC server refuses a session without it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=host.strip("[]")) as tls:
                tls.settimeout(0.5)
                if tls.recv(1) == b"":
                    return (f"the backend at {addr} closed the connection after the TLS handshake: it refused "
                            f"the gateway's client certificate ({_client_cert(config)}; check that the backend's "
                            f"--control-ssl-ca-certs signed it)")
    except ssl.SSLError as exc:
        why = getattr(exc, "verify_message", None) or exc.reason or exc
        return f"TLS with the backend at {addr} failed: {why} ({_client_cert(config)})"
    except OSError:  # refused, unreachable, or a timeout waiting for data: a session that works
        pass
    return None


def _client_cert(config: GatewayConfig) -> str:
    if config.backend_ssl_certfile is None:
        return "the gateway presents no certificate: set --backend-ssl-certfile"
    return f"the gateway presents {config.backend_ssl_certfile}, trusts {config.backend_ssl_ca_certs}"


# HTTP/2's connection preface and an empty SETTINGS frame: what a plaintext gRPC client sends first.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def plaintext_refusal(addr: str, timeout_s: float = 2.0) -> str | None:
    """Why a plaintext gRPC session with HOST:PORT fails when the backend serves TLS, or None (a plaintext
    server answers the preface with its SETTINGS; a TLS one closes the connection)."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.sendall(_H2_PREFACE)
            sock.settimeout(0.5)
            if sock.recv(1) == b"":
                return (f"the backend at {addr} closed a plaintext connection: it serves TLS (--control-ssl-certfile); "
                        f"give the gateway --backend-ssl-ca-certs (and --backend-ssl-certfile/--backend-ssl-keyfile)")
    except OSError:  # refused, unreachable, or no answer yet: not a TLS matter
        pass
    return None
