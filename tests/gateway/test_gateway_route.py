"""Routing policies and the router (fake backends), the config file, and the pool with two echo engines
on real shm rings: ejection on a stale heartbeat moves requests with no token yet; drain."""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass

import aiohttp
import pytest

from gateway.backends.backend import Backend
from protocols.messages import BackendInfo
from gateway.config import GatewayConfig
from gateway.config_file import ConfigFileError, read_config_file
from gateway.errors import ApiError
from gateway.main import config_from_args, parse_args
from gateway.backends.route import LeastOutstandingTokens, MostFreeKv, PrefixAffinity, Router
from gateway.server import start_gateway
from protocols.shm import attach_ring, create_ring
from protocols.shm_producer import ShmProducer

from tests.gateway.conftest import ERROR_TOKEN, GEOMETRY, EchoEngine


@dataclass
class FakeInfo:
    addr: str
    model_name: str = "m"


class FakeBackend:
    def __init__(self, addr: str, outstanding: int = 0, free_kv: int = 10):
        self.info = FakeInfo(addr)
        self.outstanding_tokens, self.free_kv = outstanding, free_kv
        self.healthy, self.draining = True, False
        self.stalled = self.dead = False

    def engine_stats(self) -> dict[str, int]:
        return {"free_kv_blocks": self.free_kv}


def test_least_outstanding_tokens_and_most_free_kv():
    a, b = FakeBackend("a", outstanding=100, free_kv=5), FakeBackend("b", outstanding=50, free_kv=3)
    assert LeastOutstandingTokens().choose([a, b], [1]) is b
    assert MostFreeKv().choose([a, b], [1]) is a
    b.free_kv = 5  # a tie on KV goes to the less loaded
    assert MostFreeKv().choose([a, b], [1]) is b


def test_prefix_affinity_is_sticky_spreads_and_leaves_a_much_busier_backend():
    backends = [FakeBackend(f"10.0.0.{i}:1") for i in range(4)]
    policy = PrefixAffinity(prefix_len=32, max_extra_tokens=100)
    prompt = list(range(40))
    chosen = policy.choose(backends, prompt)
    assert policy.choose(backends, prompt[:32] + [999] * 50) is chosen  # same first two blocks
    assert policy.choose(list(reversed(backends)), prompt) is chosen  # order does not matter
    assert len({policy.choose(backends, [p] * 32).info.addr for p in range(40)}) == 4
    chosen.outstanding_tokens = 101
    assert policy.choose(backends, prompt) is not chosen


def test_router_skips_ejected_draining_and_tried_backends():
    a, b = FakeBackend("a"), FakeBackend("b", outstanding=10)
    router = Router([a, b])
    assert router.pick("m") is a
    a.healthy = False
    assert router.pick("m") is b
    b.healthy = False  # both ejected: still served rather than refused
    assert router.pick("m") is a
    b.dead = True
    with pytest.raises(ApiError):  # a dead one never
        router.pick("m", exclude=["a"])
    a.healthy, b.healthy, b.dead = True, True, False
    assert router.pick("m", exclude=["a"]) is b
    b.draining = True
    with pytest.raises(ApiError) as exc:
        router.pick("m", exclude=["a"])
    assert exc.value.status == 503 and "tried: a" in exc.value.detail.message
    router.remove(a)
    router.remove(b)
    with pytest.raises(ApiError) as exc:
        router.backends_for("m")
    assert exc.value.status == 503  # its backends went away: not a 404


def test_config_file(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("routing: prefix_affinity\nheartbeat_timeout_s: 2\nbackends:\n  - 127.0.0.1:1\n"
                    "  - addr: 127.0.0.1:2\n")
    assert read_config_file(path) == {"routing": "prefix_affinity", "heartbeat_timeout_s": 2,
                                      "backend_addrs": ("127.0.0.1:1", "127.0.0.1:2")}
    config = config_from_args(parse_args(["--config", str(path), "--backend", "127.0.0.1:3"]), {})
    assert config.backend_addrs == ("127.0.0.1:3",) and config.routing == "prefix_affinity"
    assert config_from_args(argparse.Namespace(**{**vars(parse_args([])), "config_file": None}),
                            {"BLINK_CONFIG": str(path)}).config_file == str(path)
    path.write_text("routng: most_free_kv\n")
    with pytest.raises(ConfigFileError, match="unknown setting 'routng'"):
        read_config_file(path)
    with pytest.raises(ValueError, match="routing must be one of"):
        GatewayConfig(routing="random")


# ---------------------------------------------------------------- the pool, two echo engines


async def _two_backends(model_dir, tokenizer, config):
    engines, backends, rings = [], [], []
    for i in range(2):
        name = f"blink-route-test-{os.getpid()}-{i}"
        ring = create_ring(name, GEOMETRY, "fp-test")
        engine = EchoEngine(ring, tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id(ERROR_TOKEN))
        engine.task = asyncio.create_task(engine.run())
        info = BackendInfo(addr=f"echo-{i}", model_name="tiny", model_dir=str(model_dir), model_fingerprint="fp-test",
                           context_len=256, vocab_size=tokenizer.get_vocab_size(), eos_token_ids=(engine.eos_id,),
                           engine_mode="echo", ring_name=name, geometry=GEOMETRY)
        backend = Backend(info, ShmProducer(attach_ring(name)), config)
        backend.start()
        engines.append(engine), backends.append(backend), rings.append(ring)
    server = await start_gateway(config, backends=backends)
    return server, engines, backends, rings


async def _stop(server, engines, rings):
    await server.close()
    for engine, ring in zip(engines, rings):
        engine.task.cancel()
        ring.close()


async def _complete(session, server, max_tokens: int = 4) -> dict:
    async with session.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [40, 41, 42],
                                                                  "max_tokens": max_tokens}) as resp:
        return await resp.json()


CONFIG = GatewayConfig(host="127.0.0.1", port=0, grpc_port=0, heartbeat_timeout_s=0.3, health_check_s=0.05)


def test_stale_heartbeat_ejects_and_moves_requests_with_no_token(model_dir, byte_tokenizer):
    async def main():
        server, engines, backends, rings = await _two_backends(model_dir, byte_tokenizer, CONFIG)
        try:
            engines[0].paused = True  # its heartbeat stops; the first request goes there (both idle)
            async with aiohttp.ClientSession() as session:
                body = await asyncio.wait_for(_complete(session, server), 5)
            assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 4
            assert backends[0].ejected and [b.num_requests for b in backends] == [1, 1]
            engines[0].paused = False
            await asyncio.sleep(0.05)
            assert not backends[0].ejected  # re-admitted once the heartbeat moves
        finally:
            await _stop(server, engines, rings)
    asyncio.run(main())


def test_drain_lets_the_stream_finish_and_sends_new_work_elsewhere(model_dir, byte_tokenizer):
    async def main():
        server, engines, backends, rings = await _two_backends(model_dir, byte_tokenizer, CONFIG)
        try:
            engines[0].step_s = 0.03  # 16 tokens take half a second
            async with aiohttp.ClientSession() as session:
                slow = asyncio.create_task(_complete(session, server, 16))
                await asyncio.sleep(0.1)
                assert backends[0].num_in_flight == 1
                assert server.pool.drain("echo-0") and not server.pool.drain("nowhere")
                other = await _complete(session, server)
                assert other["usage"]["completion_tokens"] == 4 and backends[1].num_requests == 1
                assert (await slow)["usage"]["completion_tokens"] == 16
            for _ in range(40):
                if backends[0] not in server.backends:
                    break
                await asyncio.sleep(0.05)
            assert server.backends == [backends[1]]
        finally:
            await _stop(server, engines, rings)
    asyncio.run(main())


def test_deploy_gateway_configs_load():
    from tests.conftest import ROOT
    paths = sorted((ROOT / "deploy" / "configs").glob("*/gateway.yaml"))
    assert paths
    for path in paths:
        GatewayConfig(**read_config_file(path))


def test_a_failure_before_the_first_token_is_tried_once_on_each_backend(model_dir, byte_tokenizer):
    async def main():
        server, engines, backends, rings = await _two_backends(model_dir, byte_tokenizer, CONFIG)
        try:
            error_id = byte_tokenizer.token_to_id(ERROR_TOKEN)  # the echo engine fails it at once
            async with aiohttp.ClientSession() as session:
                async with session.post(server.url + "/v1/completions",
                                        json={"model": "tiny", "prompt": [error_id, 0], "max_tokens": 4}) as resp:
                    body = await resp.json()
            assert resp.status == 500 and "engine failed" in body["error"]["message"]
            assert [b.num_requests for b in backends] == [1, 1]
        finally:
            await _stop(server, engines, rings)
    asyncio.run(main())
