"""The tcp transport on loopback: a real shm ring driven by hand, a `TcpAgent`, and the gateway's
`Backend` over a `TcpProducer`. Tokens, backpressure, cancel, a lost agent, a silent link, a mismatch."""

from __future__ import annotations

import asyncio
import contextlib
import os

import numpy as np
import pytest

from gateway.backends.backend import Backend, BackendConnectError
from protocols.messages import BackendInfo
from gateway.backends.transports import connect_tcp
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.backends.tcp_producer import TcpProducer
from gpu_backend.tcp_agent import TcpAgent
from protocols import tcp_wire as W
from protocols.ring import FinishReason, RequestSpec, RingGeometry, TokenLogprob
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

GEOMETRY = RingGeometry(num_slots=2, max_prompt_len=16, max_output_len=4, max_stop_ids=2)
CONFIG = GatewayConfig(slot_wait_s=2.0, heartbeat_check_s=0.02, tcp_idle_timeout_s=0.5)


@pytest.fixture
def ring():
    ring = create_ring(f"blink-gw-tcp-{os.getpid()}", GEOMETRY, "fp")
    yield ring
    ring.close()


def spec(i: int, max_tokens: int = 8) -> RequestSpec:
    return RequestSpec(request_id=i, prompt_ids=[1, 2, 3], max_tokens=max_tokens)


async def start_agent(ring, port: int = 0) -> tuple[TcpAgent, asyncio.Task]:
    agent = TcpAgent(ShmProducer(attach_ring(ring.name), defer_consumed=True), state_s=0.02, idle_timeout_s=1.0)
    task = asyncio.create_task(agent.serve("127.0.0.1", port))
    while not agent.port:
        await asyncio.sleep(0.005)
    return agent, task


async def start_backend(ring, port: int) -> Backend:
    info = BackendInfo(addr="test", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                       vocab_size=100, eos_token_ids=(0,), engine_mode="test", ring_name=ring.name,
                       geometry=GEOMETRY, transport="tcp", tcp_endpoint=f"127.0.0.1:{port}")
    backend = Backend(info, await connect_tcp(info, CONFIG), CONFIG)
    backend.start()
    return backend


@contextlib.asynccontextmanager
async def linked(ring):
    """An agent on `ring`, a gateway backend over tcp to it, and the engine's end of the ring."""
    agent, task = await start_agent(ring)
    backend = await start_backend(ring, agent.port)
    try:
        yield agent, backend, RingConsumer(ring)
    finally:
        await backend.close()
        agent.stop()
        await task


async def until(cond, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_tokens_flow_with_backpressure_and_the_slot_returns(ring):
    async def main():
        async with linked(ring) as (agent, backend, engine):
            handle = await backend.submit(spec(1))
            taken = []
            await until(lambda: taken.extend(engine.take_new()) or taken)
            slot = taken[0].slot
            engine.publish(slot, [7, 8, 9, 10])
            assert engine.room(slot) == 0  # the output buffer is full until the gateway says it read them
            first = await asyncio.wait_for(handle.next(), 2)
            await until(lambda: engine.room(slot) == 4)  # Consumed crossed the wire
            engine.publish(slot, [11])
            engine.finish(slot, FinishReason.LENGTH)
            rest = await asyncio.wait_for(handle.next(), 2)
            assert first.tokens + rest.tokens == [7, 8, 9, 10, 11] and rest.finish == FinishReason.LENGTH
            assert first.prompt_len == 3
            await until(lambda: backend.free_slots == 2 and agent.producer.free_slots == 2)
            await until(lambda: backend.heartbeat == 0 and backend.num_in_flight == 0)
            engine.beat()
            await until(lambda: backend.heartbeat == 1)  # State frames carry the heartbeat
    asyncio.run(main())


def test_penalties_logit_bias_and_logprobs_cross_the_agent(ring):
    async def main():
        async with linked(ring) as (agent, backend, engine):
            sent = RequestSpec(request_id=5, prompt_ids=[1, 2], max_tokens=8, presence_penalty=0.5,
                               frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias=((3, -100.0), (4, 2.5)),
                               num_logprobs=2)
            handle = await backend.submit(sent)
            taken = []
            await until(lambda: taken.extend(engine.take_new()) or taken)
            assert taken[0].spec == RequestSpec(**{**sent.__dict__, "prompt_ids": [1, 2], "stop_ids": ()})
            entries = [TokenLogprob(-0.5, ((6, -0.5), (7, -1.5))), TokenLogprob(-0.25, ((9, -0.25), (6, -2.0)))]
            engine.publish(taken[0].slot, [6], logprobs=entries[:1])
            engine.publish(taken[0].slot, [9], logprobs=entries[1:])
            engine.finish(taken[0].slot, FinishReason.LENGTH)
            got = []
            while not got or got[-1].finish == FinishReason.NONE:
                got.append(await asyncio.wait_for(handle.next(), 2))
            assert [t for u in got for t in u.tokens] == [6, 9] and [e for u in got for e in u.logprobs] == entries
    asyncio.run(main())


def test_token_masks_cross_the_agent_into_the_ring():
    geometry = RingGeometry(num_slots=2, max_prompt_len=16, max_output_len=4, max_stop_ids=2, mask_words=3)
    masked = create_ring(f"blink-gw-tcp-mask-{os.getpid()}", geometry, "fp")

    async def main():
        agent, task = await start_agent(masked)
        info = BackendInfo(addr="test", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                           vocab_size=96, eos_token_ids=(0,), engine_mode="test", ring_name=masked.name,
                           geometry=geometry, transport="tcp", tcp_endpoint=f"127.0.0.1:{agent.port}")
        backend = Backend(info, await connect_tcp(info, CONFIG), CONFIG)
        backend.start()
        engine = RingConsumer(masked)
        try:
            handle = await backend.submit(RequestSpec(request_id=1, prompt_ids=[1], max_tokens=4,
                                                      token_mask=np.array([1, 0, 1 << 31], dtype=np.uint32)))
            taken = []
            await until(lambda: taken.extend(engine.take_new()) or taken)
            slot = taken[0].slot
            assert taken[0].spec.token_mask is not None and engine.mask(slot, 0).tolist() == [1, 0, 1 << 31]
            backend._producer.put_mask(handle.slot, 1, np.array([0, 7, 0], dtype=np.uint32))
            await until(lambda: engine.mask(slot, 1) is not None)
            assert engine.mask(slot, 1).tolist() == [0, 7, 0] and engine.mask(slot, 0) is None
            with pytest.raises(ValueError, match="put_mask: words"):
                backend._producer.put_mask(handle.slot, 2, np.zeros(2, dtype=np.uint32))
        finally:
            await backend.close()
            agent.stop()
            await task
    try:
        asyncio.run(main())
    finally:
        masked.close()


def test_client_cancel_reaches_the_engine(ring):
    async def main():
        async with linked(ring) as (agent, backend, engine):
            handle = await backend.submit(spec(1))
            taken = []
            await until(lambda: taken.extend(engine.take_new()) or taken)
            handle.close()  # the client went away
            await until(lambda: engine.cancelled(taken[0].slot, taken[0].seq))
            engine.finish(taken[0].slot, FinishReason.CANCELLED)
            await until(lambda: backend.free_slots == 2 and backend.num_in_flight == 0)
    asyncio.run(main())


def test_lost_agent_fails_requests_then_the_gateway_reconnects(ring):
    async def main():
        agent, task = await start_agent(ring)
        port = agent.port
        backend = await start_backend(ring, port)
        engine = RingConsumer(ring)
        handle = await backend.submit(spec(1))
        taken = []
        await until(lambda: taken.extend(engine.take_new()) or taken)
        agent.stop()  # the agent dies with the request running
        await task
        update = await asyncio.wait_for(handle.next(), 2)
        assert update.finish == FinishReason.ERROR and "lost the connection" in update.error
        assert engine.cancelled(taken[0].slot, taken[0].seq)  # nothing keeps running unseen
        with pytest.raises(ApiError) as exc:
            await backend.submit(spec(2))
        assert exc.value.status == 503
        agent, task = await start_agent(ring, port)  # a new agent on the same ring
        await until(lambda: backend.free_slots == 1, 5)  # the cancelled slot is still draining
        engine.finish(taken[0].slot, FinishReason.CANCELLED)
        await until(lambda: backend.free_slots == 2)  # Freed
        handle = await backend.submit(spec(3, max_tokens=1))
        taken = []
        await until(lambda: taken.extend(engine.take_new()) or taken)
        engine.publish(taken[0].slot, [5])
        engine.finish(taken[0].slot, FinishReason.LENGTH)
        update = await asyncio.wait_for(handle.next(), 2)
        assert update.tokens == [5] and update.finish == FinishReason.LENGTH
        await backend.close()
        agent.stop()
        await task
    asyncio.run(main())


def test_a_silent_link_counts_as_lost(ring):
    """An agent that says Hello and then nothing (a link that went down) fails requests after the idle timeout."""
    async def main():
        async def mute(reader, writer):
            writer.write(W.encode(W.Hello(GEOMETRY, "fp", (0, 1))))
            await asyncio.sleep(5)
        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        backend = await start_backend(ring, server.sockets[0].getsockname()[1])
        handle = await backend.submit(spec(1))
        update = await asyncio.wait_for(handle.next(), 3)
        assert update.finish == FinishReason.ERROR and "no frame" in update.error
        await backend.close()
        server.close()
    asyncio.run(main())


def test_an_agent_for_another_model_is_refused(ring):
    async def main():
        agent, task = await start_agent(ring)
        producer = TcpProducer(f"127.0.0.1:{agent.port}", GEOMETRY, "other-model")
        with pytest.raises(Exception, match="Describe said"):
            await producer.start(2)
        info = BackendInfo(addr="x", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                           vocab_size=100, eos_token_ids=(0,), engine_mode="test", ring_name=ring.name,
                           geometry=GEOMETRY, transport="tcp", tcp_endpoint="127.0.0.1:1")
        with pytest.raises(BackendConnectError, match="no session"):
            await connect_tcp(info, CONFIG.replace(connect_timeout_s=0.3))
        agent.stop()
        await task
    asyncio.run(main())
