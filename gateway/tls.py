"""TLS for the gateway's listeners: one server `ssl.SSLContext` for HTTPS (public and admin listeners) and
gRPC credentials from the same files (`GatewayConfig.ssl_*`, vLLM's flag names).

TLS 1.2 and later only, Python's default cipher list. Client certificates are checked against
`ssl_ca_certs` alone (never the system's CAs: a public CA must not vouch for a client).
`reload()` (SIGHUP) reads the files again: HTTPS loads the new chain into the live context, so new
handshakes present it while open connections go on; gRPC hands the new pair to its certificate fetcher,
which grpc asks before each new connection's handshake. A reload that fails keeps the old certificate.
Key material never goes into a log or an error message: they name files, and certificates by fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
from pathlib import Path

import grpc

from .config import GatewayConfig

log = logging.getLogger("blink.gateway.tls")

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}  # vLLM passes ssl.CERT_* as ints
MIN_VERSION = ssl.TLSVersion.TLSv1_2
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


class TlsFileError(OSError):
    """A certificate, key or CA file is missing, unreadable or not a matching PEM pair; names the file."""


def fingerprint(cert_pem: bytes) -> str:
    """SHA-256 of the chain's first certificate (what `openssl x509 -fingerprint -sha256` prints), for logs."""
    match = _PEM_CERT.search(cert_pem)
    if match is None:
        return "(no certificate)"
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(match.group().decode())).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsFileError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None


def _new_context(config: GatewayConfig) -> ssl.SSLContext:
    """A server context with the configured chain, CA and client check (raises TlsFileError naming files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # Python's secure defaults; no system CAs
    context.minimum_version = MIN_VERSION
    _load_chain(context, config)
    if config.ssl_ca_certs is not None:
        _load_ca(context, config.ssl_ca_certs)
    context.verify_mode = CERT_REQS[config.ssl_cert_reqs]
    return context


def _load_chain(context: ssl.SSLContext, config: GatewayConfig) -> None:
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:  # the library's reason only: it never quotes the key
        raise TlsFileError(f"cannot load the TLS certificate {config.ssl_certfile} with the key "
                           f"{config.ssl_keyfile or '(in the same file)'}: "
                           f"{getattr(exc, 'reason', None) or exc.strerror or type(exc).__name__}") from None


def _load_ca(context: ssl.SSLContext, path: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFileError(f"cannot load the TLS CA certificates {path}: "
                           f"{getattr(exc, 'reason', None) or exc.strerror or type(exc).__name__}") from None


class TlsFiles:
    """The gateway's TLS state: `context` for aiohttp listeners, `grpc_credentials()` for the gRPC server,
    and `reload()` for both. Use from the event loop's thread (grpc's fetcher only swaps a reference)."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self._pair = self._grpc_pair()  # first: a missing file is named alone
        self.context = _new_context(config)
        self._next_grpc: grpc.ServerCertificateConfiguration | None = None  # for grpc's fetcher, once
        log.info("TLS on: certificate %s (SHA-256 %s), client certificates %s", config.ssl_certfile,
                 fingerprint(self._pair[1]), ("none", "optional", "required")[config.ssl_cert_reqs])

    def _grpc_pair(self) -> tuple[bytes, bytes]:
        """(key, chain) as PEM bytes; without a keyfile both are the certfile (grpc picks each block it needs)."""
        key_path = self.config.ssl_keyfile or self.config.ssl_certfile
        return _read(key_path, "key"), _read(self.config.ssl_certfile, "certificate")

    def _grpc_config(self, pair: tuple[bytes, bytes]) -> grpc.ServerCertificateConfiguration:
        ca = _read(self.config.ssl_ca_certs, "CA certificates") if self.config.ssl_ca_certs else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate follows `reload()` (for new connections)."""
        return grpc.dynamic_ssl_server_credentials(self._grpc_config(self._pair), self._fetch_grpc_config,
                                                   require_client_authentication=self.config.ssl_cert_reqs == 2)

    def _fetch_grpc_config(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher, called before each new connection's handshake: a new configuration once, else None."""
        fresh, self._next_grpc = self._next_grpc, None
        return fresh

    def reload(self) -> bool:
        """Read the files again. New connections get the new certificate; on any error nothing changes."""
        try:
            pair = self._grpc_pair()
            _new_context(self.config)  # the whole set checked first: a half-loaded live context would fail
            grpc_config = self._grpc_config(pair)
            _load_chain(self.context, self.config)
            if self.config.ssl_ca_certs is not None:
                _load_ca(self.context, self.config.ssl_ca_certs)  # adds: a CA taken out stays until a restart
        except TlsFileError as exc:
            log.error("TLS reload refused, the old certificate stays: %s", exc)
            return False
        self._pair, self._next_grpc = pair, grpc_config
        log.info("TLS certificate reloaded from %s (SHA-256 %s)", self.config.ssl_certfile, fingerprint(pair[1]))
        return True


def tls_files(config: GatewayConfig) -> TlsFiles | None:
    """The gateway's TLS state, or None when TLS is off (no ssl_certfile)."""
    return TlsFiles(config) if config.tls else None
