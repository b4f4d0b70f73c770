"""The token -> mask path without the event loop (gateway/structured/mask_watch.py, mask_loop.py,
ShmProducer.peek_tokens): a constrained request's tokens are read from the ring by the mask watcher, the mask
is computed and written by the pool, all while the event loop is blocked; a slow grammar delays only its own
request, and a step over the limit ends that request with a clear error."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from gateway.structured import mask_loop as ML
from gateway.structured.constraint import Constraint
from gateway.structured.grammar import Grammars
from gateway.structured.mask_loop import MaskLoop
from gateway.structured.mask_watch import MaskWatch
from protocols.ring import FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

GEOMETRY = RingGeometry(num_slots=2, max_prompt_len=16, max_output_len=4, max_stop_ids=2)


@pytest.fixture(scope="module")
def grammars(byte_tokenizer) -> Grammars:
    return Grammars(byte_tokenizer, byte_tokenizer.get_vocab_size(), [byte_tokenizer.token_to_id("<|im_end|>")])


@pytest.fixture
def ring_pair():
    ring = create_ring(f"blink-peek-{os.getpid()}", GEOMETRY, "fp-peek")
    producer = ShmProducer(attach_ring(ring.name))
    yield producer, RingConsumer(ring)
    producer.close()
    ring.close()


def until(condition, timeout_s: float = 5.0) -> bool:
    """Wait for `condition` with the calling thread asleep (an event loop calling this is blocked)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_peek_reads_the_tokens_without_consuming_them_and_checks_the_seq(ring_pair):
    producer, consumer = ring_pair
    slot = producer.submit(RequestSpec(1, [5, 6], 20))
    seq, _ = producer.position(slot)
    assert producer.peek_tokens(slot, seq, 0) is None  # the engine has not taken it yet
    consumer.take_new()
    assert producer.peek_tokens(slot, seq, 0) == []
    consumer.publish(slot, [7, 8, 9])
    assert producer.peek_tokens(slot, seq, 0) == [7, 8, 9] and producer.peek_tokens(slot, seq, 2) == [9]
    assert producer.peek_tokens(slot, seq + 1, 0) is None  # another request's slot
    assert producer.poll(slot).tokens == [7, 8, 9]  # peeking consumed nothing
    consumer.publish(slot, [10, 11, 12])  # wraps around the 4-token buffer
    assert producer.peek_tokens(slot, seq, 3) == [10, 11, 12] and producer.peek_tokens(slot, seq, 4) == [11, 12]
    assert producer.peek_tokens(slot, seq, 1) is None  # no longer in the buffer
    consumer.finish(slot, FinishReason.LENGTH)
    assert producer.poll(slot).tokens == [10, 11, 12]
    producer.release(slot)


def test_masks_follow_the_tokens_while_the_event_loop_is_blocked(grammars, byte_tokenizer):
    """The watcher reads the tokens, the pool computes and writes each mask and starts the next step, and once
    the request's steps proved fast the watcher computes them itself: the event loop, blocked throughout, is on
    none of it. The poller handing over the same tokens adds nothing."""
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids
    watch, generated = MaskWatch(period_s=0.0002), []

    async def run():
        put, errors, threads = [], [], []
        def put_mask(index, words):
            threads.append(threading.current_thread().name)
            put.append(index)
        loop = MaskLoop(grammars, compiled, put_mask, errors.append, put_from_pool=True)
        watch.watch(loop, lambda start: generated[start:])
        for n, token in enumerate(ids):  # no await in here: the event loop runs nothing meanwhile
            generated.append(token)
            assert until(lambda: len(put) == n + 1), f"no mask for token {n} while the event loop was blocked"
        assert put == list(range(1, len(ids) + 1)) and not errors
        first = ML.INLINE_AFTER_STEPS + 1  # the first mask is the spec's; then the pool's until proved fast
        assert all(name.startswith("grammar-mask") for name in threads[:first - 1]), threads
        assert threads[first - 1:] == ["grammar-watch"] * (len(ids) - first + 1), threads
        loop.advance(list(ids), 0)  # the poller's copy of the same tokens
        loop.advance(list(ids[1:]), 1)
        loop.advance([], len(ids))
        time.sleep(0.05)
        assert put == list(range(1, len(ids) + 1))
        loop.close()
        assert until(lambda: watch.num_watched == 0)
    asyncio.run(run())


def test_about_one_mask_computes_at_once_per_core_of_its_worker():
    """Masks computing at once beyond the cores cost every mask (bench/RESULTS.md): the worker's share of the
    cores less its event loop's, 1 to 8, unless GatewayConfig.grammar_concurrency says."""
    assert ML.masks_at_once(0, 4, 4) == 1 and ML.masks_at_once(0, 8, 8) == 1  # the H100 benchmarks
    assert ML.masks_at_once(0, 2, 2) == 1 and ML.masks_at_once(0, 1, 2) == 1  # the VM
    assert ML.masks_at_once(0, 4, 16) == 3 and ML.masks_at_once(0, 1, 16) == 8 and ML.masks_at_once(0, 1, 6) == 5
    assert ML.masks_at_once(3, 4, 4) == 3


class SlowLoop(MaskLoop):
    """A mask loop whose every step takes `delay_s` more (a grammar that masks slowly)."""

    __slots__ = ("delay_s",)

    def consume_and_mask(self, token_ids):
        time.sleep(self.delay_s)
        return super().consume_and_mask(token_ids)


class CountingLoop(MaskLoop):
    """A mask loop whose steps take 10 ms more and count how many of them compute at once."""

    __slots__ = ()
    now = most = 0
    lock = threading.Lock()

    def consume_and_mask(self, token_ids):
        cls = type(self)
        with cls.lock:
            cls.now += 1
            cls.most = max(cls.most, cls.now)
        time.sleep(0.01)
        with cls.lock:
            cls.now -= 1
        return super().consume_and_mask(token_ids)


def test_main_pool_steps_compute_within_their_turns(grammars, byte_tokenizer, monkeypatch):
    """Six requests' steps at once on the main pool (8 threads): 2 turns let 2 compute at a time."""
    monkeypatch.setattr(ML, "_turns", ML.Turns(2))
    monkeypatch.setattr(ML, "SLOW_STEP_S", 1.0)  # a turn is never given up for waiting here
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids

    async def run():
        put, errors = [], []
        loops = [CountingLoop(grammars, compiled, lambda i, w: put.append(i), errors.append, put_from_pool=True)
                 for _ in range(6)]
        for loop in loops:
            loop.advance(ids[:1], 0)
        assert until(lambda: len(put) == 6) and not errors
        for loop in loops:
            loop.close()
    asyncio.run(run())
    assert CountingLoop.most == 2


def test_steps_go_on_without_a_turn_when_slow_steps_hold_them(grammars, byte_tokenizer, monkeypatch):
    """Both turns held by grammars slow on a step: another request's step waits SLOW_STEP_S, then computes."""
    monkeypatch.setattr(ML, "_turns", ML.Turns(2))
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids

    async def run():
        slow_put, fast_put, errors = [], [], []
        slows = [SlowLoop(grammars, compiled, lambda i, w: slow_put.append(i), errors.append, put_from_pool=True)
                 for _ in range(2)]
        for slow in slows:
            slow.delay_s = 1.0
            slow.advance(ids[:1], 0)
        assert until(lambda: all(s._running for s in slows))
        time.sleep(0.05)  # both in their step, holding the turns
        fast = MaskLoop(grammars, compiled, lambda i, w: fast_put.append(i), errors.append, put_from_pool=True)
        t0 = time.monotonic()
        fast.advance(ids[:1], 0)
        assert until(lambda: fast_put == [1], 0.5) and time.monotonic() - t0 < 0.5 and not slow_put
        for loop in (*slows, fast):
            loop.close()
    asyncio.run(run())


def test_a_slow_grammar_leaves_the_other_requests_masks_on_time(grammars, byte_tokenizer):
    assert ML.MASK_THREADS >= 2, "one slow grammar would hold up every other request's masks"
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids
    watch, slow_tokens, fast_tokens = MaskWatch(period_s=0.0002), [], []

    async def run():
        slow_put, fast_put, errors = [], [], []
        slow = SlowLoop(grammars, compiled, lambda i, w: slow_put.append(i), errors.append, put_from_pool=True)
        slow.delay_s = 1.0
        fast = MaskLoop(grammars, compiled, lambda i, w: fast_put.append(i), errors.append, put_from_pool=True)
        watch.watch(slow, lambda start: slow_tokens[start:])
        watch.watch(fast, lambda start: fast_tokens[start:])
        slow_tokens.append(ids[0])
        assert until(lambda: slow._running)
        t0 = time.monotonic()
        for n, token in enumerate(ids):
            fast_tokens.append(token)
            assert until(lambda: len(fast_put) == n + 1, 0.5)
        assert time.monotonic() - t0 < 0.9 and not slow_put  # all of them while the slow one's first step ran
        assert until(lambda: slow_put == [1]) and not errors
        slow.close()
        fast.close()
    asyncio.run(run())


def test_a_mask_step_over_the_limit_ends_its_request_clearly(grammars, byte_tokenizer, monkeypatch):
    """The poller's check (every heartbeat_check_s) of a step that has run too long: the request ends with an
    error saying so, and the step delivers nothing when it ends."""
    monkeypatch.setattr(ML, "MASK_STEP_LIMIT_S", 0.2)
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids

    async def run():
        put, errors = [], []
        stuck = SlowLoop(grammars, compiled, lambda i, w: put.append(i), errors.append, put_from_pool=True)
        stuck.delay_s = 0.6
        stuck.advance([ids[0]])
        assert not stuck.fail_if_overdue(time.monotonic())
        await asyncio.sleep(0.3)
        assert stuck.fail_if_overdue(time.monotonic()) and stuck.closed
        await asyncio.sleep(0.01)  # the error is the event loop's to deliver
        assert errors == ["computing the grammar's token mask took over 0.2 s (this server's limit per token)"]
        await asyncio.sleep(0.5)
        assert not put and len(errors) == 1  # the step that overran delivers nothing when it ends
    asyncio.run(run())


def test_the_native_wait_feeds_masks_from_a_real_ring_and_never_spins_on_a_stale_slot(grammars, byte_tokenizer,
                                                                                        ring_pair):
    """The C wait (GIL released) watches the response words: a slot still holding an earlier request's counters
    (seq not yet this request's) is no news, so the watcher waits instead of spinning; once the engine takes the
    request, each token's mask follows with the event loop blocked."""
    from gateway.streaming.stream_round import c_compiler
    from gateway.structured.mask_watch import TokenSource, native_wait

    if c_compiler() is None:
        pytest.skip("no C compiler: the watcher polls from Python (covered above)")
    assert native_wait() is not None
    producer, consumer = ring_pair
    old = producer.submit(RequestSpec(1, [5], 3))
    consumer.take_new()
    consumer.publish(old, [40, 41, 42])  # produced = 3 stays in the slot's words after it ends
    consumer.finish(old, FinishReason.LENGTH)
    producer.poll(old)
    producer.release(old)
    compiled = grammars.compile_sync(Constraint("regex", "hello world", "r"))
    ids = byte_tokenizer.encode("hello world").ids

    class CountingWatch(MaskWatch):
        wakes = 0  # returns from the C wait to Python

        def _wait_native(self, wait):
            CountingWatch.wakes += 1
            return super()._wait_native(wait)
    watch = CountingWatch()

    async def run():
        put = []
        slot = producer.submit(RequestSpec(2, [5], 20))
        assert slot == old
        seq, _ = producer.position(slot)
        loop = MaskLoop(grammars, compiled, lambda i, w: put.append(i), put.append, put_from_pool=True)
        watch.watch(loop, TokenSource(lambda start: producer.peek_tokens(slot, seq, start),
                                      producer.response_view(slot), seq))
        time.sleep(0.3)  # not taken yet: the stale produced = 3 is not this request's
        # Python wakes once per NATIVE_TIMEOUT_S (50 ms), not per look at the ring
        assert not put and CountingWatch.wakes < 30, CountingWatch.wakes
        consumer.take_new()
        for n, token in enumerate(ids):
            consumer.publish(slot, [token])
            assert until(lambda: len(put) == n + 1), f"no mask for token {n}"
        assert put == list(range(1, len(ids) + 1))
        loop.close()
        consumer.finish(slot, FinishReason.STOP)
        assert until(lambda: watch.num_watched == 0)
    asyncio.run(run())


def test_the_step_clock_naps_finely_only_where_tokens_are_due():
    """News every 7 ms (an engine's steps): after two intervals the wait naps coarsely until LEAD_S before the
    next step is due and finely from there to LEAD_S after it; a step with no news moves the window one period
    on; many such and the period is forgotten (coarse naps until news)."""
    from gateway.structured import mask_watch as MW

    clock, ms = MW.StepClock(), 1_000_000
    t0 = 1_000 * ms
    assert clock.plan(t0)[0] == clock.plan(t0)[2]  # nothing known: no fine window before the deadline
    for k in (0, 1, 2, 4):  # step 3 had no news (an interval of two steps)
        clock.news(t0 + 7 * ms * k)
        clock.news(t0 + 7 * ms * k + ms // 10)  # the same step's other tokens: one burst
    clock.news(t0 + 35 * ms - ms // 2)  # seen early (the last burst was seen late)
    clock.news(t0 + 35 * ms + ms // 10)
    assert clock.period_ns == 7 * ms  # the median: neither 6.5 nor 14
    clock.news(t0 + 42 * ms)
    last = t0 + 42 * ms
    fine_from, fine_until, deadline = clock.plan(last + 2 * ms)
    lead = int(MW.LEAD_S * 1e9)
    assert fine_until == last + int(MW.TAIL_S * 1e9)
    assert (fine_from, deadline) == (last + 7 * ms - lead, last + 7 * ms + lead)
    assert clock.plan(last + 7 * ms + lead + 1)[0] == last + 14 * ms - lead  # a step without news: the next one
    far = clock.plan(last + 7 * ms * (MW.MISSED_STEPS + 1))
    assert far[0] == far[2] and clock.period_ns is None


def test_the_watcher_steps_a_lone_proved_request_itself_and_leaves_several_to_the_pool(grammars, byte_tokenizer,
                                                                                      monkeypatch):
    """Scans by hand (the watcher's thread sleeps), a pool of two turns: a request runs its first
    INLINE_AFTER_STEPS steps on the pool; after that, while it is the only one watched, its news is stepped on the
    scanning thread. Once another is watched, its news goes to the pool's threads, alone too (a step there may take
    milliseconds, and the other request's tokens would wait for the watcher meanwhile), and so does news for both at
    once (one thread would serialize their masks)."""
    monkeypatch.setattr(ML, "_turns", ML.Turns(2))
    compiled = grammars.compile_sync(Constraint("regex", "[a-z ]+", "r"))
    ids = byte_tokenizer.encode("hello world and again and again").ids
    assert len(ids) >= 2 * ML.INLINE_AFTER_STEPS + 3
    watch = MaskWatch(period_s=60.0, native=False)

    async def run():
        tokens, puts = ([], []), ([], [])
        loops = [MaskLoop(grammars, compiled, lambda i, w, k=k: puts[k].append(threading.current_thread().name),
                          pytest.fail, put_from_pool=True) for k in (0, 1)]
        watch.watch(loops[0], lambda start: tokens[0][start:])
        for n in range(ML.INLINE_AFTER_STEPS + 1):  # the one request's news
            tokens[0].append(ids[n])
            assert watch.scan() == 1 and until(lambda: len(puts[0]) == n + 1)
        assert all(name.startswith("grammar-mask") for name in puts[0][:-1]), puts[0]
        assert puts[0][-1] == threading.current_thread().name  # proved fast: stepped by the scan itself
        watch.watch(loops[1], lambda start: tokens[1][start:])
        first = ML.INLINE_AFTER_STEPS + 1
        tokens[0].append(ids[first])  # news for the proved request alone, another one watched
        assert watch.scan() == 1 and until(lambda: len(puts[0]) == first + 1)
        first += 1
        for n in range(first):  # both requests' news in each scan
            tokens[0].append(ids[first + n])
            tokens[1].append(ids[n])
            assert watch.scan() == 2 and until(lambda: len(puts[0]) == first + n + 1 and len(puts[1]) == n + 1)
        assert all(name.startswith("grammar-mask") for name in puts[0][first - 1:] + puts[1]), puts
        for loop in loops:
            loop.close()
    asyncio.run(run())


def test_with_one_turn_the_watcher_steps_every_proved_request_itself(grammars, byte_tokenizer, monkeypatch):
    """A pool of one turn serializes the masks anyway: the watcher steps every request whose steps proved fast,
    several at once and several watched, and leaves a new request's first steps to the pool."""
    monkeypatch.setattr(ML, "_turns", ML.Turns(1))
    compiled = grammars.compile_sync(Constraint("regex", "[a-z ]+", "r"))
    ids = byte_tokenizer.encode("hello world and again and again").ids
    watch = MaskWatch(period_s=60.0, native=False)

    async def run():
        tokens, puts = ([], []), ([], [])
        loops = [MaskLoop(grammars, compiled, lambda i, w, k=k: puts[k].append(threading.current_thread().name),
                          pytest.fail, put_from_pool=True) for k in (0, 1)]
        for k in (0, 1):
            watch.watch(loops[k], lambda start, k=k: tokens[k][start:])
        for n in range(ML.INLINE_AFTER_STEPS + 3):  # both requests' news in each scan
            for k in (0, 1):
                tokens[k].append(ids[n])
            assert watch.scan() == 2 and until(lambda: len(puts[0]) == len(puts[1]) == n + 1)
        here = threading.current_thread().name
        for k in (0, 1):
            assert all(name.startswith("grammar-mask") for name in puts[k][:ML.INLINE_AFTER_STEPS]), puts
            assert puts[k][ML.INLINE_AFTER_STEPS:] == [here] * 3, puts  # proved fast: stepped by the scan itself
        for loop in loops:
            loop.close()
    asyncio.run(run())


class _WatchedLoop:
    """A mask loop the watcher feeds (the poller's side of it only): records what the poller hands over."""

    def __init__(self, watched: bool):
        self.watched, self.advanced, self.closed = watched, [], False

    def advance(self, tokens, first_index):
        self.advanced.append((list(tokens), first_index))

    def close(self):
        self.closed = True

    def fail_if_overdue(self, now_s, limit_s=None):
        return False


def test_the_poller_does_not_spin_for_tokens_the_mask_watcher_feeds():
    """A constrained request's tokens reach its grammar through the watcher: the poller still delivers them
    (and hands them to the loop, which skips those it has), but they re-arm no spin, which would hold the GIL
    and a core the mask path needs; a plain request's tokens and an unwatched loop's (tcp) still do."""
    from gateway.backends.backend import Backend
    from gateway.config import GatewayConfig
    from protocols.messages import BackendInfo

    geometry = RingGeometry(num_slots=3, max_prompt_len=16, max_output_len=8, max_stop_ids=2)
    ring = create_ring(f"blink-nospin-{os.getpid()}", geometry, "fp")
    info = BackendInfo(addr="test", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                       vocab_size=100, eos_token_ids=(0,), engine_mode="test", ring_name=ring.name, geometry=geometry)
    backend = Backend(info, ShmProducer(attach_ring(ring.name)), GatewayConfig(slot_wait_s=5.0))

    async def main():
        engine = RingConsumer(ring)
        watched, plain, unwatched = [await backend.submit(RequestSpec(i, [1, 2], 4)) for i in range(3)]
        watched.mask_loop, unwatched.mask_loop = _WatchedLoop(True), _WatchedLoop(False)
        slots = {t.spec.request_id: t.slot for t in engine.take_new()}
        engine.publish(slots[0], [7])
        assert backend.poller._poll_once() == 0  # news, but none worth a spin
        assert watched.mask_loop.advanced == [([7], 0)] and (await watched.next()).tokens == [7]
        engine.publish(slots[1], [8])
        assert backend.poller._poll_once() == 1
        engine.publish(slots[2], [9])
        assert backend.poller._poll_once() == 1 and unwatched.mask_loop.advanced == [([9], 0)]
        await backend.close()

    try:
        asyncio.run(main())
    finally:
        ring.close()
