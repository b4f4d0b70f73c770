"""Token masks through the shm ring (version 3): mask 0 with the request, put_mask after, the engine's read
validated by mask_seq, and the checks on both ends."""
import os

import numpy as np
import pytest

from protocols import ring as R
from protocols.ring import RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

VOCAB = 70
GEOM = RingGeometry(num_slots=4, max_prompt_len=32, max_output_len=8, max_stop_ids=4, mask_words=-(-VOCAB // 32))


def mask_of(allowed, words=GEOM.mask_words) -> np.ndarray:
    """[words] uint32 with bit t % 32 of word t // 32 set for each allowed token t."""
    out = np.zeros(words, dtype=np.uint32)
    for t in allowed:
        out[t // 32] |= np.uint32(1 << (t % 32))
    return out


@pytest.fixture
def ring():
    r = create_ring(f"blink-mask-{os.getpid()}", GEOM, "fp-test")
    yield r
    r.close()


def constrained(allowed=(5, 64), **kw) -> RequestSpec:
    return RequestSpec(request_id=7, prompt_ids=[1, 2, 3], max_tokens=5, token_mask=mask_of(allowed), **kw)


def test_the_geometry_places_one_mask_area_per_slot_after_the_block_hashes():
    assert GEOM.block_hashes_offset == GEOM.logprobs_offset + GEOM.num_slots * GEOM.logprob_bytes
    assert GEOM.masks_offset == GEOM.block_hashes_offset + GEOM.num_slots * GEOM.block_hash_bytes
    assert GEOM.mask_bytes == 64 + 64 and GEOM.mask_seq_offset == 64  # 3 words, then mask_seq on its own line
    assert GEOM.total_bytes == GEOM.masks_offset + GEOM.num_slots * GEOM.mask_bytes
    plain = RingGeometry(num_slots=4)
    assert plain.mask_bytes == 0 and plain.total_bytes == plain.masks_offset


def test_mask_0_travels_with_the_request_and_marks_it_constrained(ring):
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    slot = prod.submit(constrained())
    [taken] = cons.take_new()
    assert taken.spec.flags & R.FLAG_CONSTRAINED
    assert taken.spec.token_mask == mask_of((5, 64)).tobytes()
    assert cons.mask(slot, 0).tolist() == mask_of((5, 64)).tolist()
    assert cons.mask(slot, 1) is None  # not written yet: the row would wait


def test_put_mask_round_trip_and_only_the_current_index_reads(ring):
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    slot = prod.submit(constrained())
    cons.take_new()
    prod.put_mask(slot, 1, mask_of((0, 31, 32, 69)).tobytes())  # bytes or an array: the same words
    assert cons.mask(slot, 0) is None and cons.mask(slot, 2) is None
    assert cons.mask(slot, 1).tolist() == mask_of((0, 31, 32, 69)).tolist()
    prod.put_mask(slot, 2, mask_of((9,)))
    assert cons.mask(slot, 2).tolist() == mask_of((9,)).tolist()


def test_an_unconstrained_request_has_no_flag_and_no_mask(ring):
    prod, cons = ShmProducer(attach_ring(ring.name)), RingConsumer(ring)
    prod.submit(RequestSpec(request_id=1, prompt_ids=[1], max_tokens=2))
    [taken] = cons.take_new()
    assert not taken.spec.flags & R.FLAG_CONSTRAINED and taken.spec.token_mask is None


def test_bad_masks_are_refused_naming_the_field(ring):
    prod = ShmProducer(attach_ring(ring.name))
    with pytest.raises(ValueError, match="token_mask: 8 bytes"):
        prod.submit(RequestSpec(request_id=1, prompt_ids=[1], max_tokens=2, token_mask=mask_of((1,), 2)))
    slot = prod.submit(constrained())
    with pytest.raises(ValueError, match="put_mask: words"):
        prod.put_mask(slot, 1, mask_of((1,), 4))
    with pytest.raises(ValueError, match="token_index"):
        prod.put_mask(slot, -1, mask_of((1,)))
    with pytest.raises(KeyError):
        prod.put_mask((slot + 1) % GEOM.num_slots, 1, mask_of((1,)))


def test_a_ring_without_masks_refuses_constrained_requests_and_the_engine_sees_the_flag():
    """The producer refuses by name; a producer that did not check (another machine) reaches the engine, whose
    admission (blink_admit.h) gets the flag as written and refuses it (test_ring_fuzz_admit:
    constrained_without_masks)."""
    geometry = RingGeometry(num_slots=2, max_prompt_len=8, max_output_len=4)
    r = create_ring(f"blink-nomask-{os.getpid()}", geometry, "fp-test")
    try:
        prod, cons = ShmProducer(attach_ring(r.name)), RingConsumer(r)
        with pytest.raises(ValueError, match="takes no token masks"):
            prod.submit(RequestSpec(request_id=1, prompt_ids=[1], max_tokens=2, token_mask=b"\1\0\0\0"))
        slot = prod.submit(RequestSpec(request_id=1, prompt_ids=[1], max_tokens=2))
        flags_word = (r.req(slot) + R.REQ_FLAGS) // 4
        r.u32[flags_word] |= R.FLAG_CONSTRAINED  # a producer that did not check
        [taken] = cons.take_new()
        assert np.frombuffer(taken.words, dtype=R.REQUEST_DTYPE)[0]["flags"] & R.FLAG_CONSTRAINED
    finally:
        r.close()


def test_mask_words_is_in_the_header_and_checked_on_attach(ring):
    assert attach_ring(ring.name).geometry.mask_words == GEOM.mask_words
    assert int(ring.header["mask_words"]) == GEOM.mask_words
