"""A throwaway PKI for the TLS tests, made with the `openssl` command: a CA, two server certificates for
127.0.0.1 and localhost (the second to swap in on reload), a client certificate, and a client
certificate from another CA (which the gateway must refuse). `ips`: more addresses the leaf certificates
name (hosts other than loopback, as in the two-namespace test)."""

from __future__ import annotations

import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

SAN = "subjectAltName=DNS:localhost,IP:127.0.0.1\n"


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    @property
    def files(self) -> tuple[str, str]:
        return str(self.cert), str(self.key)


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Pair  # CN "server"
    server2: Pair  # CN "server2": the certificate a reload swaps in
    client: Pair
    rogue_client: Pair  # signed by another CA

    def client_context(self, pair: Pair | None = None) -> ssl.SSLContext:
        """A client context that trusts this CA and presents `pair` (None: no client certificate)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if pair is not None:
            context.load_cert_chain(*pair.files)
        return context


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _new_key(name: str, subject: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
            "-subj", f"/CN={subject}"]


def _ca(cwd: Path, name: str) -> None:
    _openssl(cwd, "req", "-x509", *_new_key(name, f"blink test {name}"), "-out", f"{name}.pem",
             "-days", "2")


def _leaf(cwd: Path, name: str, ca: str, ips: tuple[str, ...] = ()) -> Pair:
    _openssl(cwd, "req", *_new_key(name, name), "-out", f"{name}.csr")
    (cwd / "san.cnf").write_text(SAN.rstrip("\n") + "".join(f",IP:{ip}" for ip in ips) + "\n")
    _openssl(cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    return Pair(cwd / f"{name}.pem", cwd / f"{name}.key")


def make_pki(cwd: Path, ips: tuple[str, ...] = ()) -> Pki:
    _ca(cwd, "ca")
    _ca(cwd, "rogue-ca")
    return Pki(cwd / "ca.pem", _leaf(cwd, "server", "ca", ips), _leaf(cwd, "server2", "ca", ips),
               _leaf(cwd, "client", "ca", ips), _leaf(cwd, "rogue-client", "rogue-ca", ips))


def served_name(port: int, context: ssl.SSLContext, alpn: str | None = None) -> str:
    """The common name of the certificate a new TLS connection to 127.0.0.1:port is shown."""
    if alpn:
        context.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return dict(entry[0] for entry in tls.getpeercert()["subject"])["commonName"]
