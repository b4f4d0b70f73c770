"""The persistent engine's last word on the ring, without a GPU: after the loop ends, nothing submitted is
left unanswered. Requests the loop never took fail with ENGINE_STOPPING; if the loop died, requests it
had taken and not finished fail with INTERNAL; finished ones keep their own finish reason."""
import os

from gpu_backend.engine.persistent import PersistentEngine
from protocols.ring import ErrorCode, FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer


def _engine_over(ring) -> PersistentEngine:
    engine = PersistentEngine.__new__(PersistentEngine)  # only the ring side: no runner, no CUDA
    engine.ring, engine.geometry = ring, ring.geometry
    return engine


def _finish(prod, slot):
    upd = prod.poll(slot)
    return upd.finish, upd.error_code


def test_sweep_answers_every_request_the_loop_left():
    ring = create_ring(f"blink-sweep-test-{os.getpid()}", RingGeometry(8, 64, 16), "test")
    try:
        prod = ShmProducer(attach_ring(ring.name))
        taken, done = (prod.submit(RequestSpec(i, [1, 2, 3], 4)) for i in range(2))
        loop_side = RingConsumer(ring)  # what the loop did before it died: took both, finished one
        assert [t.slot for t in loop_side.take_new()] == [taken, done]
        loop_side.finish(done, FinishReason.LENGTH)
        queued = prod.submit(RequestSpec(2, [1, 2, 3], 4))  # after the loop's last look
        engine = _engine_over(ring)
        engine._sweep(RingConsumer(ring), died=True)
        assert _finish(prod, taken) == (FinishReason.ERROR, ErrorCode.INTERNAL)
        assert _finish(prod, done) == (FinishReason.LENGTH, ErrorCode.NONE)
        assert _finish(prod, queued) == (FinishReason.ERROR, ErrorCode.ENGINE_STOPPING)
    finally:
        ring.close()
