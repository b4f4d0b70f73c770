"""The backend poller on a real shm ring with a hand-driven consumer: stalls, waiting, adopted slots."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from gateway.backends.backend import CPU_ENGINE_SPIN_S, Backend
from gateway.backends.route import Router
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.streaming import poller as poller_module
from gateway.streaming.poller import poll_checkpoint
from protocols.messages import BackendInfo
from protocols.ring import FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

GEOMETRY = RingGeometry(num_slots=2, max_prompt_len=16, max_output_len=8, max_stop_ids=2)


@pytest.fixture
def ring():
    ring = create_ring(f"blink-gw-backend-{os.getpid()}", GEOMETRY, "fp")
    yield ring
    ring.close()


def make_backend(ring, engine_mode: str = "test", **config) -> Backend:
    info = BackendInfo(addr="test", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                       vocab_size=100, eos_token_ids=(0,), engine_mode=engine_mode, ring_name=ring.name,
                       geometry=GEOMETRY)
    cfg = GatewayConfig(**{"slot_wait_s": 5.0, "heartbeat_check_s": 0.02, **config})
    return Backend(info, ShmProducer(attach_ring(ring.name)), cfg)


def spec(i: int) -> RequestSpec:
    return RequestSpec(request_id=i, prompt_ids=[1, 2, 3], max_tokens=4)


def count_rounds(backend: Backend) -> list[int]:
    """The backend's poll rounds from now on: the list gets each one's start (monotonic ns)."""
    rounds, poll_once = [], backend.poller._poll_once

    def counted() -> int:
        rounds.append(time.monotonic_ns())
        return poll_once()
    backend.poller._poll_once = counted
    return rounds


async def start_with_one_request(backend: Backend, ring):
    """Starts the backend's poller and submits one request, which a hand-driven engine takes:
    (engine, handle, taken)."""
    backend.start()
    engine = RingConsumer(ring)
    handle = await backend.submit(spec(1))
    (taken,) = engine.take_new()
    return engine, handle, taken


def test_tokens_flow_and_the_slot_is_released(ring):
    async def main():
        backend = make_backend(ring)
        backend.start()
        engine = RingConsumer(ring)
        handle = await backend.submit(spec(1))
        (taken,) = engine.take_new()
        engine.publish(taken.slot, [7, 8])
        first = await asyncio.wait_for(handle.next(), 1)
        engine.publish(taken.slot, [9])
        engine.finish(taken.slot, FinishReason.LENGTH)
        rest = await asyncio.wait_for(handle.next(), 1)
        assert first.tokens + rest.tokens == [7, 8, 9] and rest.finish == FinishReason.LENGTH
        await asyncio.sleep(0.01)
        assert backend.free_slots == 2 and backend.num_in_flight == 0
        await backend.close()
    asyncio.run(main())


def test_outstanding_tokens_follow_submissions_tokens_and_releases(ring):
    """The running count routing reads is the sum over the requests in flight, at every step."""
    async def main():
        backend = make_backend(ring)
        backend.start()
        engine = RingConsumer(ring)

        def check(expected: int) -> None:
            assert backend.outstanding_tokens == expected == \
                sum(h.outstanding_tokens for h in backend.poller.requests.values())
        a, b = await backend.submit(spec(1)), await backend.submit(spec(2))
        check(2 * (3 + 4))
        taken = engine.take_new()
        engine.publish(taken[0].slot, [7, 8])
        await asyncio.wait_for(a.next(), 1)
        check(2 + 3 + 4)  # a's prompt is done, 2 of its 4 tokens too
        a.close()  # cancelled in the engine; its slot stays in flight until the engine confirms
        engine.publish(taken[1].slot, [5, 6, 7, 8])
        engine.finish(taken[1].slot, FinishReason.LENGTH)
        await asyncio.wait_for(b.next(), 1)
        check(2)
        engine.finish(taken[0].slot, FinishReason.CANCELLED)
        await asyncio.sleep(0.01)
        check(0)
        await backend.close()
    asyncio.run(main())


def test_the_poller_spins_for_poll_spin_s_after_news_then_sleeps(ring):
    """Within poll_spin_s of the last token the poller polls back to back (no millisecond timer between
    rounds); a `cpu` engine's poller spins at most CPU_ENGINE_SPIN_S; with 0 it sleeps poll_active_s."""
    def rounds_after_news(backend: Backend, quiet_s: float) -> int:
        async def main() -> int:
            rounds = count_rounds(backend)
            engine, handle, taken = await start_with_one_request(backend, ring)
            engine.publish(taken.slot, [7])
            await asyncio.wait_for(handle.next(), 1)
            rounds.clear()
            await asyncio.sleep(quiet_s)  # no news meanwhile
            counted_rounds = len(rounds)
            engine.finish(taken.slot, FinishReason.LENGTH)
            await asyncio.wait_for(handle.next(), 1)
            await backend.close()
            return counted_rounds
        return asyncio.run(main())

    assert make_backend(ring, poll_spin_s=0.5).poller.spin_s == 0.5
    spinning = rounds_after_news(make_backend(ring, poll_spin_s=0.5), 0.05)
    sleeping = rounds_after_news(make_backend(ring, poll_spin_s=0.0, poll_active_s=0.005), 0.05)
    assert spinning > 50 and sleeping <= 11, (spinning, sleeping)  # back to back vs one per 5 ms
    assert make_backend(ring, "cpu", poll_spin_s=0.5).poller.spin_s == CPU_ENGINE_SPIN_S < 0.5


@pytest.mark.parametrize("checkpoint_s", [0.001, 0.0])
def test_a_poll_checkpoint_takes_tokens_in_the_middle_of_other_work(ring, checkpoint_s):
    """Work that holds the event loop (a request's set-up) and calls `poll_checkpoint` between its steps
    lets the poller's round run there, once `poll_checkpoint_s` has passed since the last one: a token
    published meanwhile reaches its request before the work yields. With 0, only the poller's own rounds."""
    async def main():
        backend = make_backend(ring, poll_checkpoint_s=checkpoint_s)
        rounds = count_rounds(backend)
        engine, handle, taken = await start_with_one_request(backend, ring)
        await asyncio.sleep(0.01)  # the poller has run its rounds; no news
        engine.publish(taken.slot, [7])
        rounds.clear()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.02:  # 20 ms of work that never yields, checkpoints in between
            poll_checkpoint()
        taken_in_work = list(handle.queue)
        in_work = len(rounds)
        await asyncio.wait_for(handle.next(), 1)
        await backend.close()
        assert backend.poller not in poller_module._started.pollers  # closed: checkpoints leave it alone
        return taken_in_work, in_work
    taken_in_work, in_work = asyncio.run(main())
    if checkpoint_s:
        assert [u.tokens for u in taken_in_work] == [[7]]
        assert 10 <= in_work <= 21, in_work  # one round per millisecond of work, not one per checkpoint
    else:
        assert taken_in_work == [] and in_work == 0


def test_stalled_heartbeat_fails_requests_and_routes_around(ring):
    async def main():
        backend = make_backend(ring, stall_timeout_s=0.2)
        backend.start()
        handle = await backend.submit(spec(1))  # nobody consumes: the heartbeat never moves
        update = await asyncio.wait_for(handle.next(), 2)
        assert update.finish == FinishReason.ERROR and "progress" in update.error
        assert backend.stalled
        with pytest.raises(ApiError) as exc:
            Router([backend]).pick("m")
        assert exc.value.status == 503
        engine = RingConsumer(ring)
        engine.beat()
        await asyncio.sleep(0.1)
        assert not backend.stalled
        (taken,) = engine.take_new()
        assert engine.cancelled(taken.slot, taken.seq)  # the gateway asked the engine to drop it
        engine.finish(taken.slot, FinishReason.CANCELLED)
        await asyncio.sleep(0.05)
        assert backend.free_slots == 2
        await backend.close()
    asyncio.run(main())


def test_waiters_are_served_in_order_and_a_cancelled_waiter_passes_its_turn(ring):
    async def main():
        backend = make_backend(ring)
        backend.start()
        engine = RingConsumer(ring)
        engine.beat()
        held = [await backend.submit(spec(i)) for i in range(2)]
        order = []

        async def wait_for_slot(i):
            handle = await backend.submit(spec(i))
            order.append(i)
            return handle
        tasks = [asyncio.create_task(wait_for_slot(i)) for i in (10, 11, 12)]
        await asyncio.sleep(0.05)
        assert backend.load > 1.0  # full, with a queue
        tasks[0].cancel()  # this client leaves while queued
        for taken in engine.take_new():
            engine.finish(taken.slot, FinishReason.STOP)
        for h in held:
            await h.next()
        done = await asyncio.wait_for(asyncio.gather(*tasks[1:]), 2)
        assert order == [11, 12] and len({h.slot for h in done}) == 2
        for taken in engine.take_new():
            engine.finish(taken.slot, FinishReason.STOP)
        await asyncio.sleep(0.05)
        assert backend.free_slots == 2
        await backend.close()
    asyncio.run(main())


def test_slots_left_by_an_earlier_gateway_are_reclaimed(ring):
    async def main():
        engine = RingConsumer(ring)
        crashed = ShmProducer(attach_ring(ring.name))
        crashed.submit(spec(1))  # that gateway dies with the request running
        (taken,) = engine.take_new()
        backend = make_backend(ring)  # attaching adopts the slot and cancels it
        backend.start()
        assert backend.free_slots == 1
        assert engine.cancelled(taken.slot, taken.seq)
        engine.finish(taken.slot, FinishReason.CANCELLED)
        await asyncio.sleep(0.1)
        assert backend.free_slots == 2
        await backend.close()
    asyncio.run(main())


def test_router_404_for_unknown_model(ring):
    async def main():
        backend = make_backend(ring)
        with pytest.raises(ApiError) as exc:
            Router([backend]).pick("other")
        assert exc.value.status == 404 and exc.value.detail.code == "model_not_found"
        backend._producer.ring.close()
    asyncio.run(main())


def test_a_failing_poll_round_at_a_checkpoint_is_not_the_callers_failure(ring, caplog):
    """A checkpoint runs in some request's code: a poll round that raises there is logged, and the request
    goes on (the poller's own loop meets the error on its next round and fails what it must)."""
    async def main():
        backend = make_backend(ring, poll_checkpoint_s=0.0001)
        await start_with_one_request(backend, ring)

        def broken() -> int:
            raise RuntimeError("ring gone")
        backend.poller._poll_once = broken
        backend.poller.round_ns = 0
        poll_checkpoint()  # must not raise
        await backend.close()
    asyncio.run(main())
    assert "failed at a checkpoint" in caplog.text
