"""TLS at the gateway (`gateway/tls.py`): HTTPS and gRPC with a CA made here by `openssl`, client
certificates, plain HTTP on the TLS port, the admin listener and the metrics key. In-process gateways on
the echo engine (tests/gateway/conftest.py); the SIGHUP reload and the log scan run a real gateway process
(test_gateway_tls_process.py)."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import grpc
import httpx2
import openai
import pytest

from gateway import env
from gateway.config import GatewayConfig
from gateway.config_file import read_config_file
from gateway.main import config_from_args, parse_args
from gateway.tls import TlsFileError, TlsFiles
from protocols import inference_pb2 as pb
from protocols import inference_pb2_grpc
from tls_pki import Pki, make_pki, served_name

API_KEY, ADMIN_KEY, METRICS_KEY = "tls-client-key", "tls-admin-key", "tls-metrics-key"
CHAT = [{"role": "user", "content": "hello world hello there"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls_config(pki: Pki, pick_free_port, **fields) -> GatewayConfig:
    return GatewayConfig(port=0, grpc_port=pick_free_port(), api_keys=frozenset({API_KEY}),
                         admin_keys=frozenset({ADMIN_KEY}), slot_wait_s=2.0, ssl_certfile=str(pki.server.cert),
                         ssl_keyfile=str(pki.server.key), **fields)


@pytest.fixture(scope="module")
def tls_gateway(start_harness, pki, pick_free_port):
    """HTTPS and gRPC over TLS, no client certificates; /metrics (keyed) and /admin/ on a listener apart."""
    return start_harness(_tls_config(pki, pick_free_port, admin_port=0, metrics_key=METRICS_KEY), API_KEY)


@pytest.fixture(scope="module")
def mtls_gateway(start_harness, pki, pick_free_port):
    """Client certificates required (ssl_cert_reqs 2, vLLM's ssl.CERT_REQUIRED); /metrics keyed on the API port."""
    config = _tls_config(pki, pick_free_port, ssl_ca_certs=str(pki.ca), ssl_cert_reqs=2, metrics_key=METRICS_KEY)
    return start_harness(config, API_KEY)


def _native_calls(harness) -> list:
    """Record each hand-over of a stream to the native C round (which writes to the raw socket)."""
    calls, go_native = [], harness.backend.go_native

    def recording(*args):
        calls.append(args[1])
        return go_native(*args)
    harness.backend.go_native = recording
    return calls


def _openai(harness, verify) -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30,
                         http_client=httpx2.Client(verify=verify))


def _chat_and_stream(client: openai.OpenAI, model: str) -> tuple[str, str]:
    """(the chat's text, the same chat streamed and put back together); checks the stream's finish."""
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, stream=True))
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    return full.choices[0].message.content, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ---------------------------------------------------------------- HTTPS


def test_openai_client_chats_and_streams_over_https(tls_gateway, pki):
    assert tls_gateway.url.startswith("https://")
    native = _native_calls(tls_gateway)
    text, streamed = _chat_and_stream(_openai(tls_gateway, pki.client_context()), tls_gateway.model)
    assert text and streamed == text
    assert native == []  # the C round writes plaintext to the socket: never on a TLS connection


def test_plain_streams_still_take_the_native_round(harness):
    """The control for the test above: the same stream over plain HTTP is handed to the C round."""
    native = _native_calls(harness)
    client = openai.OpenAI(base_url=harness.url + "/v1", api_key=harness.api_key, max_retries=0, timeout=30)
    text, streamed = _chat_and_stream(client, harness.model)
    assert streamed == text and native


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_gateway):
    with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx2.get(tls_gateway.url + "/health")  # the system's CAs: they never signed this certificate


def test_plain_http_to_the_tls_port_fails_cleanly(tls_gateway):
    port = tls_gateway.server.port
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            reply = sock.recv(4096)
        except ConnectionResetError:
            reply = b""
    assert reply[:5] != b"HTTP/"  # no plaintext answer: at most a TLS alert, then the close
    assert time.monotonic() - started < 3
    with pytest.raises(httpx2.TransportError):
        httpx2.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion:DeprecationWarning")  # the old client, on purpose
def test_tls_1_2_is_the_oldest_version(tls_gateway, pki):
    server = tls_gateway.server
    context = server.tls.context
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2 and context.verify_mode == ssl.CERT_NONE
    for port, alpn in ((server.port, None), (server.admin_port, None), (server.grpc_port, "h2")):
        for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
            client = pki.client_context()
            client.minimum_version = client.maximum_version = version
            assert served_name(port, client, alpn) == "server"
        old = pki.client_context()
        old.minimum_version, old.maximum_version = ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1
        old.set_ciphers("DEFAULT:@SECLEVEL=0")  # a client that would speak TLS 1.1 if the server did
        with pytest.raises(ssl.SSLError):
            served_name(port, old, alpn)


# ---------------------------------------------------------------- client certificates


def test_client_certificate_required(mtls_gateway, pki):
    url = mtls_gateway.url + "/health"
    for refused in (None, pki.rogue_client):  # none at all; one from a CA the gateway does not trust
        with pytest.raises(httpx2.TransportError):
            httpx2.get(url, verify=pki.client_context(refused), timeout=5)
    assert httpx2.get(url, verify=pki.client_context(pki.client), timeout=5).status_code == 200
    text, streamed = _chat_and_stream(_openai(mtls_gateway, pki.client_context(pki.client)), mtls_gateway.model)
    assert text and streamed == text


def test_an_optional_client_certificate_must_verify_when_sent(start_harness, pki, pick_free_port):
    """ssl_cert_reqs 1 (ssl.CERT_OPTIONAL): no certificate is fine, a good one too, one from another CA is not."""
    gateway = start_harness(_tls_config(pki, pick_free_port, ssl_ca_certs=str(pki.ca), ssl_cert_reqs=1), API_KEY)
    url = gateway.url + "/health"
    for accepted in (None, pki.client):
        assert httpx2.get(url, verify=pki.client_context(accepted), timeout=5).status_code == 200
    with pytest.raises(httpx2.TransportError):
        httpx2.get(url, verify=pki.client_context(pki.rogue_client), timeout=5)


def test_metrics_key_on_the_api_port(mtls_gateway, pki):
    verify = pki.client_context(pki.client)
    url = mtls_gateway.url + "/metrics"
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": "Bearer wrong"}):
        reply = httpx2.get(url, headers=headers, verify=verify, timeout=5)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    reply = httpx2.get(url, headers={"Authorization": f"Bearer {METRICS_KEY}"}, verify=verify, timeout=5)
    assert reply.status_code == 200 and "blink:" in reply.text


# ---------------------------------------------------------------- gRPC


def _generate(addr: str, credentials: grpc.ChannelCredentials) -> list[pb.GenerateResponse]:
    with grpc.secure_channel(addr, credentials) as channel:
        request = pb.GenerateRequest(model="tiny-echo", prompt="hello world", max_tokens=5)
        return list(inference_pb2_grpc.InferenceStub(channel).Generate(
            request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=10))


def test_grpc_over_tls(tls_gateway, pki):
    replies = _generate(tls_gateway.grpc_addr, grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes()))
    assert replies[-1].finish_reason == "length" and "".join(r.text for r in replies)
    with grpc.insecure_channel(tls_gateway.grpc_addr) as channel:  # plaintext gRPC on the TLS port
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(model="tiny-echo"), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_client_certificate_required(mtls_gateway, pki):
    ca = pki.ca.read_bytes()
    for refused in (None, pki.rogue_client):
        creds = grpc.ssl_channel_credentials(ca, *(() if refused is None else
                                                   (refused.key.read_bytes(), refused.cert.read_bytes())))
        with pytest.raises(grpc.RpcError) as info:
            _generate(mtls_gateway.grpc_addr, creds)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(ca, pki.client.key.read_bytes(), pki.client.cert.read_bytes())
    assert _generate(mtls_gateway.grpc_addr, creds)[-1].finish_reason == "length"


# ---------------------------------------------------------------- the admin listener


def test_metrics_and_admin_only_on_their_own_listener(tls_gateway, pki):
    verify, admin = pki.client_context(), tls_gateway.server.admin_url
    assert admin.startswith("https://") and tls_gateway.server.admin_port != tls_gateway.server.port

    def get(url, key):
        return httpx2.get(url, headers={"Authorization": f"Bearer {key}"}, verify=verify, timeout=5)
    for path, key in (("/metrics", METRICS_KEY), ("/admin/status", ADMIN_KEY), ("/admin/backends", ADMIN_KEY)):
        public = get(tls_gateway.url + path, key)
        assert public.status_code == 404 and public.json()["error"]["code"] == "not_found"
        assert get(admin + path, key).status_code == 200
    assert get(admin + "/v1/models", API_KEY).status_code == 404  # no API there
    assert get(tls_gateway.url + "/v1/models", API_KEY).status_code == 200
    for key in ("wrong", ADMIN_KEY):  # the admin key does not open /metrics
        assert get(admin + "/metrics", key).status_code == 401
    assert httpx2.get(admin + "/health", verify=verify, timeout=5).status_code == 200


# ---------------------------------------------------------------- settings


def test_flags_env_and_file_carry_the_tls_settings(tmp_path, pki):
    cert, key = pki.server.files
    args = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", str(pki.ca), "--ssl-cert-reqs", "2",
            "--admin-host", "127.0.0.2", "--admin-port", "9100", "--metrics-key", "m"]
    from_flags = config_from_args(parse_args(args), environ={})
    environ = {"BLINK_SSL_CERTFILE": cert, "BLINK_SSL_KEYFILE": key, "BLINK_SSL_CA_CERTS": str(pki.ca),
               "BLINK_SSL_CERT_REQS": "2", "BLINK_ADMIN_HOST": "127.0.0.2", "BLINK_ADMIN_PORT": "9100",
               "BLINK_METRICS_KEY": "m"}
    from_env = config_from_args(parse_args([]), environ=environ)
    path = tmp_path / "gateway.yaml"
    path.write_text(f"ssl_certfile: {cert}\nssl_keyfile: {key}\nssl_ca_certs: {pki.ca}\nssl_cert_reqs: 2\n"
                    "admin_host: 127.0.0.2\nadmin_port: 9100\nmetrics_key: m\n")
    from_file = GatewayConfig(**read_config_file(path))
    for config in (from_flags, from_env, from_file):
        assert (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_cert_reqs) == \
            (cert, key, str(pki.ca), 2)
        assert (config.admin_host, config.admin_port, config.metrics_key, config.url[:8]) == \
            ("127.0.0.2", 9100, "m", "https://")
    assert {v.field for v in env.VARIABLES} >= {"ssl_certfile", "ssl_cert_reqs", "admin_port", "metrics_key"}
    assert "'m'" not in repr(from_flags) and "metrics_key" not in repr(from_flags)


def test_the_deploy_example_is_a_valid_config():
    root = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "tls"
    config = GatewayConfig(**read_config_file(root / "gateway.yaml"))
    assert config.tls and config.ssl_cert_reqs == 2 and config.separate_admin
    assert "BLINK_METRICS_KEY=" in (root / "gateway.env").read_text()


def test_serve_waits_for_a_tls_gateway_set_by_its_config_file(monkeypatch):
    """`blink serve` cannot ask a TLS port for /health in plain HTTP: it learns TLS from flags, env or file."""
    from blink import cli

    deploy = Path(__file__).resolve().parents[2] / "deploy" / "configs"
    for path, tls in ((deploy / "tls" / "gateway.yaml", True), (deploy / "several-gpu-hosts" / "gateway.yaml", False)):
        monkeypatch.setenv("BLINK_CONFIG", str(path))
        assert cli._config_file_sets_tls() is tls


@pytest.mark.parametrize("fields, message", [
    ({"ssl_keyfile": "k.pem"}, "ssl_keyfile needs ssl_certfile"),
    ({"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 3}, "ssl_cert_reqs must be 0"),
    ({"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 2}, "set ssl_ca_certs"),
    ({"ssl_ca_certs": "ca.pem"}, "need TLS on"),
    ({"admin_host": "0.0.0.0"}, "admin_host needs admin_port"),
    ({"admin_port": 8000}, "admin_port 8000 is taken"),
    ({"metrics_key": " "}, "metrics_key must not be empty"),
])
def test_bad_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**fields)


def test_a_key_inside_the_certificate_file_serves_https_and_grpc(start_harness, pki, pick_free_port, tmp_path):
    """vLLM takes --ssl-certfile alone when the key is in it; so does the gateway, on both ports."""
    combined = tmp_path / "combined.pem"
    combined.write_bytes(pki.server.key.read_bytes() + pki.server.cert.read_bytes())
    config = GatewayConfig(port=0, grpc_port=pick_free_port(), ssl_certfile=str(combined))
    server = start_harness(config).server
    assert served_name(server.port, pki.client_context()) == "server"
    assert served_name(server.grpc_port, pki.client_context(), "h2") == "server"


def test_unreadable_or_mismatched_files_name_the_file_not_the_key(tmp_path, pki):
    missing = GatewayConfig(ssl_certfile=str(tmp_path / "none.pem"), ssl_keyfile=str(pki.server.key))
    with pytest.raises(TlsFileError, match="none.pem"):
        TlsFiles(missing)
    mismatched = GatewayConfig(ssl_certfile=str(pki.server.cert), ssl_keyfile=str(pki.client.key))
    with pytest.raises(TlsFileError, match="KEY_VALUES_MISMATCH") as info:
        TlsFiles(mismatched)
    key_body = pki.client.key.read_text().splitlines()[1]
    assert key_body not in str(info.value)
