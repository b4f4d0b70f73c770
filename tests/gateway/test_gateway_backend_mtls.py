"""Mutual TLS between the gateway and a backend on loopback, with a CA made here (tls_pki.py): the backend's
control plane (Describe and grpc.health.v1) and its tcp agent serve TLS and require a client certificate;
the gateway dials them with its own (`backend_ssl_*`). A gateway with no certificate, one from another CA,
or no TLS at all is refused with an error that says why, quickly; the agent's open session survives
refused connections; a reload serves the new certificate to new connections."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import ssl
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.backends.backend import Backend, BackendConnectError, describe
from gateway.backends.transports import TlsRefused, aio_control_channel, connect_tcp
from gateway.config import GatewayConfig
from gpu_backend.control_server import ControlServer
from gpu_backend.tcp_agent import TcpAgent
from protocols.messages import BackendDescription, BackendInfo
from protocols.mtls import ServerTls
from protocols.ring import FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer
from tls_pki import Pki, make_pki, served_name

GEOMETRY = RingGeometry(num_slots=2, max_prompt_len=16, max_output_len=4, max_stop_ids=2)
REFUSED_WITHIN_S = 5.0  # a refused certificate is reported at once, not after connect_timeout_s


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def ring():
    ring = create_ring(f"blink-mtls-{os.getpid()}", GEOMETRY, "fp")
    yield ring
    ring.close()


def backend_tls(pki: Pki, cert_reqs: int = 2) -> ServerTls:
    return ServerTls(*pki.server.files, str(pki.ca), cert_reqs, name="control-plane TLS")


def gateway_config(pki: Pki, pair="client", ca=None, **fields) -> GatewayConfig:
    pair = getattr(pki, pair) if pair else None
    return GatewayConfig(backend_ssl_certfile=str(pair.cert) if pair else None,
                         backend_ssl_keyfile=str(pair.key) if pair else None,
                         backend_ssl_ca_certs=str(ca or pki.ca), slot_wait_s=2.0, heartbeat_check_s=0.02,
                         tcp_idle_timeout_s=0.5, connect_timeout_s=30.0, **fields)


@pytest.fixture
def control(ring, pki):
    server = ControlServer("127.0.0.1:0", BackendDescription("m", "", "fp", 64, 100, (0,), "cpu"), ring,
                           tls=backend_tls(pki))
    server.start()
    yield f"127.0.0.1:{server.port}", server
    server.stop(0)


def test_describe_and_health_over_mutual_tls(control, pki):
    addr, _ = control
    config = gateway_config(pki)
    assert describe(addr, 10, config).model_name == "m"

    async def check() -> int:
        async with aio_control_channel(addr, config) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status
    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("pair", ["rogue_client", None], ids=["other-ca", "no-certificate"])
def test_a_gateway_without_a_valid_certificate_is_refused_at_once(control, pki, pair):
    addr, _ = control
    start = time.monotonic()
    with pytest.raises(TlsRefused, match="refused the gateway's client certificate") as info:
        describe(addr, 30, gateway_config(pki, pair))
    assert time.monotonic() - start < REFUSED_WITHIN_S
    assert (pair is None) == ("presents no certificate" in str(info.value))


def test_a_plaintext_gateway_is_told_the_backend_serves_tls(control):
    addr, _ = control
    start = time.monotonic()
    with pytest.raises(TlsRefused, match="closed a plaintext connection: it serves TLS"):
        describe(addr, 30, GatewayConfig())
    assert time.monotonic() - start < REFUSED_WITHIN_S


def test_a_backend_that_is_not_up_yet_is_waited_for(ring, pki):
    """Neither check mistakes a backend still starting (nothing listening yet) for a refusal."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ControlServer(f"127.0.0.1:{port}", BackendDescription("m", "", "fp", 64, 100, (0,), "cpu"), ring,
                           tls=backend_tls(pki))
    timer = threading.Timer(2.5, server.start)  # past two checks of the waiting Describe
    timer.start()
    try:
        assert describe(f"127.0.0.1:{port}", 30, gateway_config(pki)).model_name == "m"
    finally:
        timer.join()
        server.stop(0)


def test_health_refuses_a_gateway_without_a_certificate(control):
    addr, _ = control
    with grpc.insecure_channel(addr) as channel:  # plaintext to the TLS port: refused, and no hang
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_backend_certificate_from_another_ca_is_named(control, pki):
    addr, _ = control
    with pytest.raises(TlsRefused, match="certificate verify failed|unable to get local issuer"):
        describe(addr, 30, gateway_config(pki, ca=pki.rogue_client.cert))  # trusts another CA only


def test_a_plaintext_backend_is_named(ring, pki):
    server = ControlServer("127.0.0.1:0", BackendDescription("m", "", "fp", 64, 100, (0,), "cpu"), ring)
    server.start()
    try:
        with pytest.raises(TlsRefused, match="TLS with the backend at .* failed"):
            describe(f"127.0.0.1:{server.port}", 30, gateway_config(pki))
    finally:
        server.stop(0)


def test_reload_serves_the_new_certificate_to_new_connections(ring, pki, tmp_path):
    cert, key = tmp_path / "backend.pem", tmp_path / "backend.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    tls = ServerTls(str(cert), str(key), str(pki.ca), 2)
    server = ControlServer("127.0.0.1:0", BackendDescription("m", "", "fp", 64, 100, (0,), "cpu"), ring, tls=tls)
    server.start()
    try:
        client = pki.client_context(pki.client)
        assert served_name(server.port, client, "h2") == "server"
        shutil.copy(pki.server2.cert, cert)
        shutil.copy(pki.server2.key, key)
        assert tls.reload()
        assert served_name(server.port, pki.client_context(pki.client), "h2") == "server2"
        key.write_text("not a key")
        assert not tls.reload()  # refused: the old pair stays
        assert describe(f"127.0.0.1:{server.port}", 10, gateway_config(pki)).model_name == "m"
    finally:
        server.stop(0)


# ---------------------------------------------------------------- the tcp transport
async def start_agent(ring, pki: Pki, port: int = 0, tls: ServerTls | None = None) -> tuple[TcpAgent, asyncio.Task]:
    agent = TcpAgent(ShmProducer(attach_ring(ring.name), defer_consumed=True), state_s=0.02, idle_timeout_s=1.0,
                     tls=tls or backend_tls(pki))
    task = asyncio.create_task(agent.serve("127.0.0.1", port))
    while not agent.port:
        await asyncio.sleep(0.005)
    return agent, task


async def connect_backend(ring, port: int, config: GatewayConfig) -> Backend:
    info = BackendInfo(addr="test", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                       vocab_size=100, eos_token_ids=(0,), engine_mode="test", ring_name=ring.name,
                       geometry=GEOMETRY, transport="tcp", tcp_endpoint=f"127.0.0.1:{port}")
    backend = Backend(info, await connect_tcp(info, config), config)
    backend.start()
    return backend


async def until(cond, timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def stream_one(backend: Backend, engine: RingConsumer, request_id: int) -> list[int]:
    handle = await backend.submit(RequestSpec(request_id=request_id, prompt_ids=[1, 2, 3], max_tokens=4))
    taken = []
    await until(lambda: taken.extend(engine.take_new()) or taken)
    engine.publish(taken[0].slot, [7, 8])
    engine.finish(taken[0].slot, FinishReason.LENGTH)
    got = []
    while not got or got[-1].finish == FinishReason.NONE:
        got.append(await asyncio.wait_for(handle.next(), 3))
    return [t for u in got for t in u.tokens]


async def raw_tls_attempt(port: int, context: ssl.SSLContext | None) -> None:
    """A connection that tries its luck: TLS with `context`, or plaintext bytes (None); errors expected."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context,
                                                       server_hostname="127.0.0.1" if context else None)
        if context is None:
            writer.write(b"\x00" * 64)
        await asyncio.wait_for(reader.read(1), 3)
        writer.close()
    except (OSError, asyncio.TimeoutError):
        pass


def test_tcp_transport_over_mutual_tls_and_refused_connections_leave_the_session(ring, pki, caplog):
    async def main():
        agent, task = await start_agent(ring, pki)
        backend = await connect_backend(ring, agent.port, gateway_config(pki))
        engine = RingConsumer(ring)
        try:
            assert await stream_one(backend, engine, 1) == [7, 8]
            await raw_tls_attempt(agent.port, pki.client_context(pki.rogue_client))
            await raw_tls_attempt(agent.port, pki.client_context(None))
            await raw_tls_attempt(agent.port, None)  # plaintext to the TLS port
            await until(lambda: agent.num_refused == 3)
            assert agent.session is not None and backend._producer.connected
            assert await stream_one(backend, engine, 2) == [7, 8]  # the session went on
        finally:
            await backend.close()
            agent.stop()
            await task
    with caplog.at_level(logging.INFO, logger="blink.agent"):
        asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 3, refusals
    assert any("CN=client" in r.getMessage() for r in caplog.records if "connected" in r.getMessage())


@pytest.mark.parametrize("pair", ["rogue_client", None], ids=["other-ca", "no-certificate"])
def test_tcp_agent_refuses_a_gateway_without_a_valid_certificate(ring, pki, pair):
    async def main():
        agent, task = await start_agent(ring, pki)
        start = time.monotonic()
        try:
            with pytest.raises(TlsRefused, match="refused the gateway's client certificate"):
                await connect_backend(ring, agent.port, gateway_config(pki, pair))
            assert time.monotonic() - start < REFUSED_WITHIN_S and agent.session is None
            assert agent.num_refused >= 1
        finally:
            agent.stop()
            await task
    asyncio.run(main())


def test_tcp_gateway_without_tls_gets_nowhere_with_a_tls_agent(ring, pki):
    async def main():
        agent, task = await start_agent(ring, pki)
        try:
            with pytest.raises(BackendConnectError, match="no session with the tcp agent"):
                await connect_backend(ring, agent.port, GatewayConfig(tcp_idle_timeout_s=0.5, connect_timeout_s=2.0))
            assert agent.session is None and agent.num_refused >= 1
        finally:
            agent.stop()
            await task
    asyncio.run(main())



def test_the_agent_serves_a_reloaded_certificate_to_new_connections(ring, pki, tmp_path):
    cert, key = tmp_path / "backend.pem", tmp_path / "backend.key"
    shutil.copy(pki.server.cert, cert)
    shutil.copy(pki.server.key, key)
    tls = ServerTls(str(cert), str(key), str(pki.ca), 2)

    async def main():
        agent, task = await start_agent(ring, pki, tls=tls)
        loop = asyncio.get_running_loop()
        try:
            names = [await loop.run_in_executor(None, served_name, agent.port, pki.client_context(pki.client))]
            shutil.copy(pki.server2.cert, cert)
            shutil.copy(pki.server2.key, key)
            assert tls.reload()
            names.append(await loop.run_in_executor(None, served_name, agent.port, pki.client_context(pki.client)))
            return names
        finally:
            agent.stop()
            await task
    assert asyncio.run(main()) == ["server", "server2"]


def test_a_refusal_after_a_restart_shows_in_the_backend_status(ring, pki):
    """The backend comes back trusting another CA (a rotation gone wrong): /health and /admin/backends say why."""
    async def main():
        agent, task = await start_agent(ring, pki)
        port = agent.port
        backend = await connect_backend(ring, port, gateway_config(pki))
        try:
            assert backend.link_error is None
            agent.stop()
            await task
            other_ca = ServerTls(*pki.server.files, str(pki.ca.parent / "rogue-ca.pem"), 2)
            agent, task = await start_agent(ring, pki, port, other_ca)
            await until(lambda: agent.num_refused >= 1 and "refused" in (backend.link_error or ""), 5.0)
            assert "refused the gateway's client certificate" in backend.link_error
        finally:
            await backend.close()
            agent.stop()
            await task
    asyncio.run(main())


# ---------------------------------------------------------------- the gateway's settings
@pytest.mark.parametrize("fields, message", [
    ({"backend_ssl_keyfile": "k.pem"}, "backend_ssl_keyfile needs backend_ssl_certfile"),
    ({"backend_ssl_certfile": "c.pem"}, "backend_ssl_certfile needs backend_ssl_ca_certs"),
])
def test_half_a_backend_tls_configuration_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**fields)


def test_backend_tls_settings_from_file_env_and_flags(tmp_path):
    from gateway.main import config_from_args, parse_args

    path = tmp_path / "gateway.yaml"
    path.write_text("backend_ssl_certfile: /file/gw.pem\nbackend_ssl_ca_certs: /file/ca.pem\n")
    environ = {"BLINK_BACKEND_SSL_KEYFILE": "/env/gw.key", "BLINK_BACKEND_SSL_CA_CERTS": "/env/ca.pem"}
    config = config_from_args(parse_args(["--config", str(path), "--backend-ssl-certfile", "/flag/gw.pem"]), environ)
    assert (config.backend_ssl_certfile, config.backend_ssl_keyfile, config.backend_ssl_ca_certs) == \
        ("/flag/gw.pem", "/env/gw.key", "/env/ca.pem")
    assert config.backend_tls and not GatewayConfig().backend_tls


def test_a_missing_backend_tls_file_is_named(control, tmp_path, pki):
    addr, _ = control
    with pytest.raises(OSError, match=f"the TLS CA certificates {tmp_path / 'absent.pem'}: No such file"):
        describe(addr, 5, GatewayConfig(backend_ssl_ca_certs=str(tmp_path / "absent.pem")))


def test_blinkctl_reaches_an_admin_api_that_requires_client_certificates(start_harness, pki, pick_free_port, capsys):
    from blink import ctl

    harness = start_harness(GatewayConfig(port=0, grpc_port=pick_free_port(), admin_keys=frozenset({"adm"}),
                                          ssl_certfile=str(pki.server.cert), ssl_keyfile=str(pki.server.key),
                                          ssl_ca_certs=str(pki.ca), ssl_cert_reqs=2))
    common = ["--url", harness.url, "--admin-key", "adm", "--ssl-ca-certs", str(pki.ca)]
    assert ctl.main(["status", *common, "--ssl-certfile", str(pki.client.cert), "--ssl-keyfile",
                     str(pki.client.key), "--json"]) == 0
    assert '"backends"' in capsys.readouterr().out
    assert ctl.main(["status", *common]) == 2  # no client certificate: the handshake fails, said plainly
    assert "cannot reach the gateway" in capsys.readouterr().err
    assert ctl.main(["status", *common, "--ssl-certfile", str(pki.ca.parent / "absent.pem")]) == 2
    assert "cannot load the TLS files given to blinkctl" in capsys.readouterr().err


def test_a_backend_of_its_own_ca_in_the_config_file(control, pki, tmp_path):
    """`backends: [{addr, ssl_*}]`: that backend is dialled with its own files, the others with backend_ssl_*."""
    from gateway.config_file import ConfigFileError, read_config_file

    addr, _ = control
    path = tmp_path / "gateway.yaml"
    path.write_text(f"backend_ssl_ca_certs: {pki.rogue_client.cert}\nbackends:\n  - 127.0.0.1:1\n"
                    f"  - addr: {addr}\n    ssl_certfile: {pki.client.cert}\n    ssl_keyfile: {pki.client.key}\n"
                    f"    ssl_ca_certs: {pki.ca}\n")
    config = GatewayConfig(**read_config_file(path))
    assert config.for_backend("127.0.0.1:1") is config and not config.for_backend(addr).backend_tls_by_addr
    assert describe(addr, 10, config.for_backend(addr)).model_name == "m"
    with pytest.raises(TlsRefused):  # the file-wide CA does not sign this backend's certificate
        describe(addr, 10, config)
    path.write_text("backends:\n  - addr: 127.0.0.1:2\n    ssl_certfile: gw.pem\n")
    with pytest.raises(ValueError, match="backend 127.0.0.1:2: backend_ssl_certfile needs backend_ssl_ca_certs"):
        GatewayConfig(**read_config_file(path))
    path.write_text("backends:\n  - addr: 127.0.0.1:2\n    ssl_cert: gw.pem\n")
    with pytest.raises(ConfigFileError, match=r"backends\[0\]: unknown settings ssl_cert"):
        read_config_file(path)

