"""gateway/streaming/pacing.py: request set-ups take turns with the rest of the event loop (one per pass, in order)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.streaming.pacing import SetupPacer


class PassCounter:
    """Stands in for a backend poller: one round per event-loop pass (it sleeps 0 between rounds)."""

    def __init__(self):
        self.passes = 0

    async def run(self) -> None:
        while True:
            self.passes += 1
            await asyncio.sleep(0)


async def _burst(pacer: SetupPacer, n: int, cancel: set[int] = frozenset()) -> tuple[list[int], list[int]]:
    """`n` set-ups made ready in the same pass; returns (the order they ran in, the pass each ran in)."""
    counter = PassCounter()
    ticker = asyncio.create_task(counter.run())
    await asyncio.sleep(0)
    order, passes = [], []

    async def setup(i: int) -> None:
        await pacer.turn()
        order.append(i)
        passes.append(counter.passes)

    tasks = [asyncio.create_task(setup(i)) for i in range(n)]
    await asyncio.sleep(0)  # every task has reached turn(): the first has its turn, the rest wait
    for i in cancel:
        tasks[i].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ticker.cancel()
    return order, passes


def test_one_setup_per_pass_in_arrival_order():
    pacer = SetupPacer()
    order, passes = asyncio.run(_burst(pacer, 20))
    assert order == list(range(20))
    assert len(set(passes)) == 20, f"two set-ups ran in one pass: {passes}"
    assert pacer.waiting == 0


def test_without_pacing_every_ready_setup_runs_in_one_pass():
    order, passes = asyncio.run(_burst(SetupPacer(enabled=False), 20))
    assert order == list(range(20))
    assert len(set(passes)) == 1


def test_a_cancelled_waiter_gives_up_its_place():
    pacer = SetupPacer()
    order, passes = asyncio.run(_burst(pacer, 10, cancel={3, 4, 7}))
    assert order == [0, 1, 2, 5, 6, 8, 9]
    assert len(set(passes)) == len(passes)
    assert pacer.waiting == 0


def test_a_lone_setup_does_not_wait():
    async def main() -> bool:
        pacer = SetupPacer()
        task = asyncio.create_task(pacer.turn())
        await asyncio.sleep(0)
        done = task.done()
        await asyncio.sleep(0)  # its pass ends: a set-up arriving now goes straight in too
        second = asyncio.create_task(pacer.turn())
        await asyncio.sleep(0)
        return done and second.done()

    assert asyncio.run(main())


@pytest.mark.parametrize("n", [1, 2, 50])
def test_the_turn_goes_round_even_with_nothing_else_running(n):
    async def main() -> list[int]:
        pacer = SetupPacer()
        ran = []

        async def setup(i):
            await pacer.turn()
            ran.append(i)

        await asyncio.wait_for(asyncio.gather(*(setup(i) for i in range(n))), 5)
        return ran

    assert asyncio.run(main()) == list(range(n))
