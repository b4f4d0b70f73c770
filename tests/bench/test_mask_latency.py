"""bench/traffic_engine.py's constrained mode (bench/mask_latency.py): a row samples only under the mask of the
token it is about to sample, skips the steps its mask is late for, ends on EOS, and the engine records each
mask's latency and the skipped steps."""
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import traffic_engine  # noqa: E402
from protocols.ring import FinishReason, RequestSpec  # noqa: E402
from protocols.shm import attach_ring  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def _mask(num_words: int, *allowed: int) -> np.ndarray:
    words = np.zeros(num_words, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


def test_a_row_waits_for_each_mask_and_samples_under_it(tmp_path, monkeypatch):
    monkeypatch.setattr(traffic_engine, "default_cache_dir", lambda: tmp_path)
    engine = traffic_engine.MaskTrafficEngine(f"blink-masklat-test-{os.getpid()}", f"127.0.0.1:{free_port()}",
                                              step_s=0.01)
    producer = ShmProducer(attach_ring(engine.ring.name))
    try:
        g, eos = engine.ring.geometry, engine.eos_id
        slot = producer.submit(RequestSpec(1, [5, 6], 10, token_mask=_mask(g.mask_words, 300, 301)))
        now = 1.0
        engine.step(now)  # takes the request, samples token 0 under mask 0
        engine.step(now := now + 0.01)  # mask 1 has not come: the row skips this step
        producer.put_mask(slot, 1, _mask(g.mask_words, 777))
        engine.step(now := now + 0.01)
        producer.put_mask(slot, 2, _mask(g.mask_words, eos, 900))  # EOS allowed: the engine takes it
        engine.step(now := now + 0.01)
        update = producer.poll(slot)
        assert update.tokens[0] in (300, 301) and update.tokens[1:] == [777]
        assert update.finish == FinishReason.STOP
        stats = engine.stats()
        assert stats["masks"] == 2 and stats["skipped_steps"] == 1 and stats["row_steps"] == 4
        # token 1 waited one step for its mask; tokens 0 and 2 (EOS) none
        assert stats["tokens_by_steps_waited"][:3] == [2, 1, 0] and sum(stats["tokens_by_steps_waited"]) == 3
        # the skipped step was token 1's (the request's second token)
        assert stats["skipped_by_token_index"]["<2"] == 1 and sum(stats["skipped_by_token_index"].values()) == 1
        assert stats["skipped_by_second"] == [1]  # in the run's first second
        assert 0 < stats["mask_latency_us_p50"] <= stats["mask_latency_us_max"] < 5e6
    finally:
        producer.close()
        engine.ring.close()
