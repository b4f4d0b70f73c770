"""TLS as both sides use it: the gateway's listeners, and mutual TLS between gateway and backends (the
backend's gRPC control plane and its tcp agent as servers, the gateway as their client).

One policy everywhere: TLS 1.2 and later, Python's default ciphers, peers checked against the configured
CA file alone (never the system's CAs: a public CA must not vouch for a gateway or a backend).
`ServerTls.reload()` (SIGHUP) reads the files again: the live `ssl.SSLContext` gets the new chain, so new
handshakes present it while open connections go on; gRPC servers get the new pair through their
certificate fetcher, which grpc asks before each new connection's handshake. A failed reload keeps the
old certificate. Key material never goes into a log or an error message: they name files, and
certificates by their SHA-256 fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import re
import ssl
from pathlib import Path

import grpc

log = logging.getLogger("blink.tls")

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}  # vLLM passes ssl.CERT_* as ints
CERT_REQS_NAMES = ("none", "optional", "required")
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


def read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsFileError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None


def _reason(exc: BaseException) -> str:
    """The library's reason only: it never quotes the key."""
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__


def load_chain(context: ssl.SSLContext, certfile: str, keyfile: str | None) -> None:
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFileError(f"cannot load the TLS certificate {certfile} with the key "
                           f"{keyfile or '(in the same file)'}: {_reason(exc)}") from None


def load_ca(context: ssl.SSLContext, path: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFileError(f"cannot load the TLS CA certificates {path}: {_reason(exc)}") from None


def server_context(certfile: str, keyfile: str | None, ca_certs: str | None, cert_reqs: int) -> ssl.SSLContext:
    """A server context with the chain, the CA and the client check (raises TlsFileError naming files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # Python's secure defaults; no system CAs
    context.minimum_version = MIN_VERSION
    load_chain(context, certfile, keyfile)
    if ca_certs is not None:
        load_ca(context, ca_certs)
    context.verify_mode = CERT_REQS[cert_reqs]
    return context


def client_context(certfile: str | None, keyfile: str | None, ca_certs: str) -> ssl.SSLContext:
    """A client context that trusts `ca_certs` only, checks the server's name, and presents `certfile`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer and its host name
    context.minimum_version = MIN_VERSION
    load_ca(context, ca_certs)
    if certfile is not None:
        load_chain(context, certfile, keyfile)
    return context


def grpc_channel_credentials(certfile: str | None, keyfile: str | None, ca_certs: str) -> grpc.ChannelCredentials:
    """gRPC client credentials from the same files (read now: a channel made later sees replaced files)."""
    pair = (read_pem(keyfile or certfile, "key"), read_pem(certfile, "certificate")) if certfile else (None, None)
    client_context(certfile, keyfile, ca_certs)  # the set checked as a whole, with the same messages as tcp's
    return grpc.ssl_channel_credentials(read_pem(ca_certs, "CA certificates"), *pair)


class ServerTls:
    """A TLS server's files: `context` for asyncio/aiohttp servers, `grpc_credentials()` for gRPC servers,
    `reload()` for both. `name` says whose files they are in logs ("TLS", "control-plane TLS")."""

    def __init__(self, certfile: str, keyfile: str | None, ca_certs: str | None, cert_reqs: int,
                 name: str = "TLS"):
        self.certfile, self.keyfile, self.ca_certs, self.cert_reqs = certfile, keyfile, ca_certs, cert_reqs
        self.name = name
        self._pair = self._grpc_pair()  # first: a missing file is named alone
        self.context = server_context(certfile, keyfile, ca_certs, cert_reqs)
        self._next_grpc: grpc.ServerCertificateConfiguration | None = None  # for grpc's fetcher, once
        log.info("%s on: certificate %s (SHA-256 %s), client certificates %s", name, certfile,
                 fingerprint(self._pair[1]), CERT_REQS_NAMES[cert_reqs])

    def _grpc_pair(self) -> tuple[bytes, bytes]:
        """(key, chain) as PEM bytes; without a keyfile both are the certfile (grpc picks each block it needs)."""
        return read_pem(self.keyfile or self.certfile, "key"), read_pem(self.certfile, "certificate")

    def _grpc_config(self, pair: tuple[bytes, bytes]) -> grpc.ServerCertificateConfiguration:
        ca = read_pem(self.ca_certs, "CA certificates") if self.ca_certs else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate follows `reload()` (for new connections)."""
        return grpc.dynamic_ssl_server_credentials(self._grpc_config(self._pair), self._fetch_grpc_config,
                                                   require_client_authentication=self.cert_reqs == 2)

    def _fetch_grpc_config(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher, called before each new connection's handshake: a new configuration once, else None."""
        fresh, self._next_grpc = self._next_grpc, None
        return fresh

    def reload(self) -> bool:
        """Read the files again. New connections get the new certificate; on any error nothing changes."""
        try:
            pair = self._grpc_pair()
            server_context(self.certfile, self.keyfile, self.ca_certs, self.cert_reqs)  # whole set checked first
            grpc_config = self._grpc_config(pair)
            load_chain(self.context, self.certfile, self.keyfile)
            if self.ca_certs is not None:
                load_ca(self.context, self.ca_certs)  # adds: a CA taken out stays until a restart
        except TlsFileError as exc:
            log.error("%s reload refused, the old certificate stays: %s", self.name, exc)
            return False
        self._pair, self._next_grpc = pair, grpc_config
        log.info("%s certificate reloaded from %s (SHA-256 %s)", self.name, self.certfile, fingerprint(pair[1]))
        return True
