"""The rdma transport. Its producer logic (mirror, write order, re-read on finish, wrap, failure) runs
here against a shared-memory ring through an in-memory link; the verbs path needs an RDMA device and
skips where there is none (there is none on the machines this was developed on)."""
import mmap
import os

import pytest

from protocols import ring as R
from protocols.rdma import RdmaLinkError, RdmaProducer
from protocols.ring import FinishReason, RequestSpec, RingGeometry
from protocols.shm import ShmRing, attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

GEOM = RingGeometry(num_slots=4, max_prompt_len=32, max_output_len=8, max_stop_ids=4)


class MemoryLink:
    """A RingLink whose 'remote' ring is a shm ring in this process: WRITE and READ are copies."""

    def __init__(self, remote: ShmRing):
        self.geometry, self.remote = remote.geometry, remote
        self.mirror = ShmRing("mirror", mmap.mmap(-1, self.geometry.total_bytes), self.geometry, owner=False)
        self.writes: list[int] = []  # offsets, in posting order
        self.broken = False

    def write(self, offset, nbytes):
        self._check()
        self.writes.append(offset)
        self.remote.buf[offset:offset + nbytes] = self.mirror.buf[offset:offset + nbytes]

    def read(self, offset, nbytes):
        self._check()
        self.mirror.buf[offset:offset + nbytes] = self.remote.buf[offset:offset + nbytes]

    def flush(self):
        self._check()

    def close(self):
        self.mirror.close()

    def _check(self):
        if self.broken:
            raise RdmaLinkError("work request 7 failed with status 12")


@pytest.fixture
def ring():
    r = create_ring(f"blink-rdma-{os.getpid()}", GEOM, "fp")
    yield r
    r.close()


def spec(n=3, **kw):
    return RequestSpec(request_id=9, prompt_ids=list(range(1, n + 1)), max_tokens=30, **kw)


def test_requests_and_tokens_cross_the_link_with_wraparound(ring):
    link = MemoryLink(ring)
    prod, engine = RdmaProducer(link), RingConsumer(ring)
    sent = spec(5, stop_ids=(7,), seed=3, temperature=0.5)
    slot = prod.submit(sent)
    [taken] = engine.take_new()
    assert taken.slot == slot and taken.spec == RequestSpec(**{**sent.__dict__, "prompt_ids": [1, 2, 3, 4, 5]})
    received = []
    for i in range(4):  # 24 tokens through an 8-token buffer: room comes back only via the consumed WRITE
        assert engine.room(slot) == 8
        engine.publish(slot, list(range(i * 6, i * 6 + 6)))
        received += prod.poll(slot).tokens
    engine.finish(slot, FinishReason.LENGTH)
    last = prod.poll(slot)
    assert received == list(range(24)) and last.finish == FinishReason.LENGTH and last.prompt_len == 5
    prod.release(slot)
    assert prod.free_slots == GEOM.num_slots


def test_logit_bias_and_logprobs_cross_the_link(ring):
    link = MemoryLink(ring)
    prod, engine = RdmaProducer(link), RingConsumer(ring)
    sent = spec(2, logit_bias=((3, -5.0), (4, 7.5)), num_logprobs=1, presence_penalty=0.5)
    slot = prod.submit(sent)
    [taken] = engine.take_new()
    assert taken.spec.logit_bias == ((3, -5.0), (4, 7.5)) and taken.spec.num_logprobs == 1
    assert taken.spec.presence_penalty == 0.5
    engine.publish(slot, [6], logprobs=[R.TokenLogprob(-0.25, ((6, -0.25),))])
    assert prod.poll(slot).logprobs == [R.TokenLogprob(-0.25, ((6, -0.25),))]


def test_block_hashes_and_cached_tokens_cross_the_link(ring):
    link = MemoryLink(ring)
    prod, engine = RdmaProducer(link), RingConsumer(ring)
    hashes = (2**64 - 1, 77)
    slot = prod.submit(spec(2 * GEOM.kv_block_size, block_hashes=hashes))
    [taken] = engine.take_new()
    assert taken.spec.block_hashes == hashes
    engine.set_cached_tokens(slot, GEOM.kv_block_size)
    engine.publish(slot, [6])
    assert prod.poll(slot).cached_tokens == GEOM.kv_block_size


def test_payload_then_sequence_word_then_queue_entry(ring):
    link = MemoryLink(ring)
    prod = RdmaProducer(link)
    link.writes.clear()
    slot = prod.submit(spec())
    base = ring.req(slot)
    assert link.writes == [base + 8, ring.resp(slot) + R.RESP_CONSUMED, base + R.REQ_SEQ, GEOM.sq_offset, R.HDR_SQ_TAIL]


def test_a_finish_is_read_twice_so_the_last_tokens_are_not_lost(ring):
    class StaleFirstRead(MemoryLink):
        """The first READ of a response line sees the finish but an old `produced` (torn read)."""
        torn = True

        def read(self, offset, nbytes):
            super().read(offset, nbytes)
            if self.torn and nbytes == 64 and self.mirror.u32[(offset + R.RESP_FINISH_REASON) // 4]:
                self.torn = False
                self.mirror.u32[(offset + R.RESP_PRODUCED) // 4] = 1
    link = StaleFirstRead(ring)
    prod, engine = RdmaProducer(link), RingConsumer(ring)
    slot = prod.submit(spec())
    engine.take_new()
    engine.publish(slot, [4, 5, 6])
    engine.finish(slot, FinishReason.STOP)
    update = prod.poll(slot)
    assert update.tokens == [4, 5, 6] and update.finish == FinishReason.STOP


def test_cancel_and_adoption_of_an_earlier_producers_slots(ring):
    engine = RingConsumer(ring)
    ShmProducer(attach_ring(ring.name)).submit(spec())  # a gateway that died with this running
    [old] = engine.take_new()
    prod = RdmaProducer(MemoryLink(ring))
    assert engine.cancelled(old.slot, old.seq) and prod.free_slots == GEOM.num_slots - 1
    slot = prod.submit(spec())
    [new] = engine.take_new()
    prod.cancel(slot)
    assert engine.cancelled(new.slot, new.seq)
    for s in (old.slot, new.slot):
        engine.finish(s, FinishReason.CANCELLED)
    assert sorted(prod.reclaim()) == sorted([old.slot, new.slot])


def test_a_broken_link_fails_requests_instead_of_hanging(ring):
    link = MemoryLink(ring)
    prod = RdmaProducer(link)
    slot = prod.submit(spec())
    link.broken = True
    update = prod.poll(slot)
    assert update.finish == FinishReason.ERROR and "lost the rdma link" in update.error
    assert not prod.connected and prod.free_slots == 0
    prod.release(slot)


def test_verbs_loopback_on_a_real_device(ring):
    from protocols.rdma_verbs import Device, RcQueuePair, VerbsLink, device_names
    if not device_names():
        pytest.skip("no RDMA device (or no pyverbs) on this machine: the verbs path is untested here")
    from gpu_backend.rdma_export import export_shm_ring
    export = export_shm_ring(ring)
    qp = RcQueuePair(Device())
    remote = export.connect(qp.local)
    qp.connect(remote)
    prod, engine = RdmaProducer(VerbsLink(qp, remote, GEOM)), RingConsumer(ring)
    slot = prod.submit(spec())
    [taken] = engine.take_new()
    engine.publish(taken.slot, [1, 2])
    engine.finish(taken.slot, FinishReason.LENGTH)
    assert prod.poll(slot).tokens == [1, 2]
    prod.close()
    export.close()


def test_the_gateway_backend_runs_on_the_rdma_producer(ring):
    """`Backend` uses the rdma producer exactly as it uses the shm one (same interface)."""
    import asyncio

    from gateway.backends.backend import Backend
    from protocols.messages import BackendInfo
    from gateway.config import GatewayConfig

    async def main():
        info = BackendInfo(addr="rdma-test", model_name="m", model_dir="", model_fingerprint="fp", context_len=64,
                           vocab_size=100, eos_token_ids=(0,), engine_mode="test", ring_name=ring.name,
                           geometry=GEOM, transport="rdma")
        backend = Backend(info, RdmaProducer(MemoryLink(ring)), GatewayConfig(heartbeat_check_s=0.02))
        backend.start()
        engine = RingConsumer(ring)
        handle = await backend.submit(spec())
        [taken] = engine.take_new()
        engine.beat()
        engine.publish(taken.slot, [3, 4])
        engine.finish(taken.slot, FinishReason.STOP)
        update = await asyncio.wait_for(handle.next(), 2)
        assert update.tokens == [3, 4] and update.finish == FinishReason.STOP
        await asyncio.sleep(0.05)
        assert backend.free_slots == GEOM.num_slots and backend.heartbeat == 1
        await backend.close()
    asyncio.run(main())


def test_masks_cross_the_link_words_before_mask_seq():
    geometry = RingGeometry(num_slots=2, max_prompt_len=8, max_output_len=4, mask_words=2)
    remote = create_ring(f"blink-rdma-mask-{os.getpid()}", geometry, "fp")
    try:
        link = MemoryLink(remote)
        prod, engine = RdmaProducer(link), RingConsumer(remote)
        slot = prod.submit(spec(2, token_mask=b"\x02\0\0\0\0\0\0\x80"))
        [taken] = engine.take_new()
        assert taken.spec.token_mask == b"\x02\0\0\0\0\0\0\x80" and engine.mask(slot, 0).tolist() == [2, 1 << 31]
        link.writes.clear()
        prod.put_mask(slot, 1, [0, 5])
        base = remote.mask(slot)
        assert link.writes == [base, base + geometry.mask_seq_offset]  # the words, then the word validating them
        assert engine.mask(slot, 1).tolist() == [0, 5] and engine.mask(slot, 0) is None
    finally:
        remote.close()
