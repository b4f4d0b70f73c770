"""The shared-memory ring: submit/take/publish/poll, wraparound, backpressure, cancel, bad attach."""
import os
import subprocess
import sys

import numpy as np
import pytest

from protocols import ring as R
from protocols.ring import ErrorCode, FinishReason, RequestSpec, RingGeometry, TokenLogprob
from protocols.shm import RingAttachError, RingFull, attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.messages import TokenUpdate
from protocols.shm_producer import ShmProducer

GEOM = RingGeometry(num_slots=4, max_prompt_len=32, max_output_len=8, max_stop_ids=4)


@pytest.fixture
def ring():
    r = create_ring(f"blink-t-{os.getpid()}", GEOM, "fp-test")
    yield r
    r.close()


def spec(n=3, **kw):
    return RequestSpec(request_id=42, prompt_ids=list(range(1, n + 1)), max_tokens=5, **kw)


def test_request_round_trips_every_field(ring):
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    sent = RequestSpec(request_id=2**63 + 5, prompt_ids=[9, 8, 7], max_tokens=77, temperature=0.5, top_p=0.9,
                       top_k=40, min_p=0.05, seed=2**64 - 1, stop_ids=(3, 4), ignore_eos=True, priority=2)
    slot = prod.submit(sent)
    [taken] = cons.take_new()
    assert taken.slot == slot and taken.seq == 1
    got = taken.spec
    assert got.request_id == sent.request_id and list(got.prompt_ids) == [9, 8, 7]
    assert (got.max_tokens, got.top_k, got.seed, got.priority, got.ignore_eos) == (77, 40, 2**64 - 1, 2, True)
    assert got.temperature == pytest.approx(0.5) and got.top_p == pytest.approx(0.9) and got.min_p == pytest.approx(0.05)
    assert tuple(got.stop_ids) == (3, 4)
    assert cons.take_new() == []


def test_version_2_fields_round_trip(ring):
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    bias = tuple((i * 7, i - 150.0) for i in range(GEOM.max_logit_bias))
    sent = spec(presence_penalty=1.5, frequency_penalty=-2.0, repetition_penalty=1.25, logit_bias=bias, num_logprobs=3)
    prod.submit(sent)
    [taken] = cons.take_new()
    assert taken.spec == RequestSpec(**{**sent.__dict__, "prompt_ids": [1, 2, 3], "stop_ids": ()})
    prod.submit(spec())
    [plain] = cons.take_new()
    assert plain.spec.num_logprobs is None and plain.spec.logit_bias == () and plain.spec.repetition_penalty == 1.0


def test_logprobs_travel_with_their_tokens_and_wrap_in_their_window(ring):
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    slot = prod.submit(spec(num_logprobs=2))
    cons.take_new()
    assert cons.room(slot) == GEOM.logprob_window == 8  # clamped to max_output_len
    received = []
    for i in range(20):
        entry = TokenLogprob(-i / 8, ((i, -i / 8), (i + 1, -i / 4)))
        cons.publish(slot, [i], logprobs=[entry])
        update = prod.poll(slot)
        assert update.tokens == [i]
        received += update.logprobs
    assert received == [TokenLogprob(-i / 8, ((i, -i / 8), (i + 1, -i / 4))) for i in range(20)]
    other = prod.submit(spec())
    cons.take_new()
    cons.publish(other, [5])
    assert prod.poll(other).logprobs == []


def test_a_logprobs_request_runs_at_most_its_window_ahead():
    geom = RingGeometry(num_slots=2, max_prompt_len=8, max_output_len=16, max_stop_ids=2, logprob_window=4)
    ring = create_ring(f"blink-t-w-{os.getpid()}", geom, "fp")
    try:
        prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
        with_lp, without = prod.submit(spec(num_logprobs=0)), prod.submit(spec())
        cons.take_new()
        assert (cons.room(with_lp), cons.room(without)) == (4, 16)
        cons.publish(with_lp, [1, 2, 3, 4], logprobs=[TokenLogprob(-1.0)] * 4)
        with pytest.raises(RingFull):
            cons.publish(with_lp, [5], logprobs=[TokenLogprob(-1.0)])
        prod.poll(with_lp)
        assert cons.room(with_lp) == 4
    finally:
        ring.close()


def test_no_seed_is_not_seed_zero(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    prod.submit(spec())
    prod.submit(spec(seed=0))
    a, b = cons.take_new()
    assert a.spec.seed is None and b.spec.seed == 0


def test_tokens_flow_and_output_buffer_wraps(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    slot = prod.submit(spec())
    cons.take_new()
    assert prod.poll(slot).tokens == [] and prod.poll(slot).started
    received = []
    for i in range(5):  # 30 tokens through an 8-token buffer
        batch = list(range(i * 6, i * 6 + 6))
        cons.publish(slot, batch)
        update = prod.poll(slot)
        received += update.tokens
        assert update == TokenUpdate(tokens=batch, prompt_len=len(spec().prompt_ids), started=True)  # and nothing else
    assert received == list(range(30))
    cons.finish(slot, FinishReason.LENGTH)
    upd = prod.poll(slot)
    assert upd.finish is FinishReason.LENGTH and upd.tokens == []
    first, last = prod.token_times_ns(slot)
    assert 0 < first <= last


def test_full_output_buffer_is_backpressure_not_overwrite(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    slot = prod.submit(spec())
    cons.take_new()
    cons.publish(slot, list(range(8)))
    assert cons.room(slot) == 0
    with pytest.raises(RingFull):
        cons.publish(slot, [99])
    assert prod.poll(slot).tokens == list(range(8))
    assert cons.room(slot) == 8


def test_full_ring_refuses_and_recovers_after_release(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    slots = [prod.submit(spec()) for _ in range(GEOM.num_slots)]
    with pytest.raises(RingFull):
        prod.submit(spec())
    cons.take_new()
    cons.finish(slots[0], FinishReason.STOP)
    with pytest.raises(RuntimeError):
        prod.release(slots[1])  # still running: releasing would be a bug
    prod.poll(slots[0])
    prod.release(slots[0])
    again = prod.submit(spec(n=5))
    assert again == slots[0]
    [taken] = cons.take_new()
    assert taken.slot == again and len(taken.spec.prompt_ids) == 5


def test_submission_queue_wraps_many_times(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    for i in range(50):
        slot = prod.submit(spec(n=1 + i % 30))
        [taken] = cons.take_new()
        assert taken.seq == i + 1 and len(taken.spec.prompt_ids) == 1 + i % 30
        cons.publish(slot, [i])
        cons.finish(slot, FinishReason.STOP)
        upd = prod.poll(slot)
        assert upd.tokens == [i] and upd.finish is FinishReason.STOP
        prod.release(slot)
    assert ring.stats()["sq_head"] == ring.stats()["sq_tail"] == 50


def test_cancel_is_seen_only_by_its_own_submission(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    slot = prod.submit(spec())
    [taken] = cons.take_new()
    assert not cons.cancelled(slot, taken.seq)
    prod.cancel(slot)
    assert cons.cancelled(slot, taken.seq)
    cons.finish(slot, FinishReason.CANCELLED)
    assert prod.poll(slot).finish is FinishReason.CANCELLED
    prod.release(slot)
    slot2 = prod.submit(spec())
    [taken2] = cons.take_new()
    assert not cons.cancelled(taken2.slot, taken2.seq)


def test_error_finish_carries_a_message(ring):
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    slot = prod.submit(spec())
    cons.take_new()
    cons.finish(slot, FinishReason.ERROR, ErrorCode.PROMPT_TOO_LONG)
    upd = prod.poll(slot)
    assert upd.finish is FinishReason.ERROR and "context" in upd.error


def test_bad_spec_is_refused_before_it_reaches_the_ring(ring):
    prod = ShmProducer(ring)
    with pytest.raises(ValueError, match="prompt_ids"):
        prod.submit(spec(n=GEOM.max_prompt_len + 1))
    with pytest.raises(ValueError, match="stop_ids"):
        prod.submit(spec(stop_ids=(1, 2, 3, 4, 5)))
    # Values that overflow an int32 word once raised after the slot was taken, leaking it.
    for bad in (spec(stop_ids=(-1,)), spec(stop_ids=(2**40,)), spec(top_k=2**63)):
        with pytest.raises(ValueError):
            prod.submit(bad)
    assert prod.free_slots == GEOM.num_slots


def test_attach_errors_are_clear(ring):
    with pytest.raises(RingAttachError, match="is the backend running"):
        attach_ring("blink-no-such-ring")
    with pytest.raises(RingAttachError, match="geometry"):
        attach_ring(ring.name, expect=RingGeometry(num_slots=8, max_prompt_len=32, max_output_len=8, max_stop_ids=4))
    with pytest.raises(RingAttachError, match="fingerprint"):
        attach_ring(ring.name, fingerprint="another-model")
    ring.u32[R.HDR_VERSION // 4] = R.RING_VERSION + 1
    with pytest.raises(RingAttachError, match="version"):
        attach_ring(ring.name)
    ring.u32[R.HDR_VERSION // 4] = R.RING_VERSION
    ring.u64[R.HDR_MAGIC // 8] = 0
    with pytest.raises(RingAttachError, match="magic"):
        attach_ring(ring.name)


def test_a_restarted_producer_cancels_what_the_old_one_left(ring):
    old, cons = ShmProducer(ring), RingConsumer(ring)
    slot = old.submit(spec())
    [taken] = cons.take_new()
    new = ShmProducer(attach_ring(ring.name))
    assert new.free_slots == GEOM.num_slots - 1 and cons.cancelled(slot, taken.seq)
    cons.finish(slot, FinishReason.CANCELLED)
    assert new.reclaim() == [slot]
    new.release(slot)
    assert new.free_slots == GEOM.num_slots


def test_two_processes_share_the_ring(ring):
    prod = ShmProducer(ring)
    slot = prod.submit(spec(n=4))
    code = f"""
from protocols.shm import attach_ring
from protocols.shm_consumer import RingConsumer
from protocols.ring import FinishReason
cons = RingConsumer(attach_ring({ring.name!r}))
[t] = cons.take_new()
cons.publish(t.slot, [x * 10 for x in t.spec.prompt_ids])
cons.finish(t.slot, FinishReason.STOP)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    upd = prod.poll(slot)
    assert upd.tokens == [10, 20, 30, 40] and upd.finish is FinishReason.STOP


def test_ready_slots_names_only_slots_with_news(ring):
    """What the gateway's poller polls: slots with unread tokens or a finish; none missed, idle ones skipped."""
    prod, cons = ShmProducer(ring), RingConsumer(ring)
    quiet, talking, done = (prod.submit(RequestSpec(request_id=i, prompt_ids=[1], max_tokens=4)) for i in range(3))
    cons.take_new()
    waiting = prod.submit(RequestSpec(request_id=3, prompt_ids=[1], max_tokens=4))  # not taken by the engine
    assert prod.ready_slots([quiet, talking, done]) == []
    cons.publish(talking, [7, 8])
    cons.finish(done, FinishReason.LENGTH)
    assert prod.ready_slots([quiet, talking, done]) == [talking, done]
    assert prod.poll(talking).tokens == [7, 8]
    assert prod.ready_slots([quiet, talking, done]) == [done]
    cons.publish(talking, [9])
    assert prod.ready_slots([talking]) == [talking]
    assert prod.ready_slots([]) == [] and prod.ready_slots([waiting]) == []
    slots = [quiet, talking]  # the same list again (a poller's, unchanged): its slots are read afresh
    assert prod.ready_slots(slots) == [talking]
    prod.poll(talking)
    assert prod.ready_slots(slots) == []


def test_block_hashes_and_cached_tokens_round_trip():
    """Ring version 3: a request's block hashes reach the engine; cached_tokens and the prefix-cache counters
    reach the gateway."""
    g = RingGeometry(num_slots=2, max_prompt_len=32, max_output_len=8, kv_block_size=4)
    assert g.max_block_hashes == 8 and g.block_hashes_offset + 2 * g.block_hash_bytes == g.total_bytes
    r = create_ring(f"blink-t3-{os.getpid()}", g, "fp-test")
    try:
        prod, cons = ShmProducer(attach_ring(r.name)), RingConsumer(r)
        hashes = (2**64 - 1, 1, 12345)
        slot = prod.submit(spec(13, block_hashes=hashes))
        [taken] = cons.take_new()
        assert taken.spec.block_hashes == hashes
        cons.set_cached_tokens(slot, 8)
        cons.publish(slot, [7])
        update = prod.poll(slot)
        assert (update.tokens, update.cached_tokens) == ([7], 8)
        cons.set_stats(10, 20, 1, 0, (3, 400, 96))
        stats = prod.engine_stats()
        assert (stats["cached_kv_blocks"], stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (3, 400, 96)
    finally:
        r.close()


@pytest.mark.parametrize("hashes, problem", [((1, 2, 3, 4), "at most 3"), ((0,), "nonzero"), ((2**64,), "nonzero")])
def test_bad_block_hashes_are_refused_by_name(hashes, problem):
    g = RingGeometry(num_slots=2, max_prompt_len=32, max_output_len=8, kv_block_size=4)
    with pytest.raises(ValueError, match=f"block_hashes: .*{problem}"):
        spec(13, block_hashes=hashes).validate(g)  # 13 tokens: 3 full blocks of 4


def test_a_hash_count_past_the_prompt_is_clipped_and_its_word_kept_for_the_admission(ring):
    """A producer that writes the count word itself (another machine over RDMA): the consumer reads no hash past
    the prompt's full blocks, and hands the engine's admission (blink_admit.h, which refuses it: test_ring_fuzz
    and test_ring_fuzz_admit) the word as it was read."""
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    real = R.RequestSpec.validate
    try:
        R.RequestSpec.validate = lambda self, g: None
        prod.submit(spec(GEOM.kv_block_size, block_hashes=(1, 2)))  # one full block, two hashes
    finally:
        R.RequestSpec.validate = real
    [bad] = cons.take_new()
    assert bad.spec.block_hashes == (1,)
    words = np.frombuffer(bad.words, dtype=R.REQUEST_DTYPE)[0]
    assert (words["num_block_hashes"], words["seq"]) == (2, bad.seq) and len(bad.words) == R.REQ_STOP_IDS
