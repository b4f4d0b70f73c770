"""Prefix caching on a CUDA GPU (run on the device machine, skipped elsewhere): the host and the persistent
engines give the same greedy tokens with the cache on and off, bit for bit, for requests that share a system
prompt and repeat a whole prompt, sent in waves (a wave after the one before finished, so that its blocks are
published); the cached waves report cached_tokens (multiples of the block size) and the ring's counters."""
from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

from test_gpu_runner import _peaky_model  # noqa: E402
from gpu_backend.engine.loop import EngineConfig, EngineLoop  # noqa: E402
from protocols.prefix_hash import block_hashes  # noqa: E402
from protocols.ring import FinishReason, RequestSpec, RingGeometry  # noqa: E402
from protocols.shm import attach_ring, create_ring  # noqa: E402
from protocols.shm_consumer import RingConsumer  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402

BLOCK, CONTEXT = 16, 512
ON = EngineConfig(block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8)
OFF = dataclasses.replace(ON, enable_prefix_caching=False)


def _waves() -> list[list[RequestSpec]]:
    gen = random.Random(5)
    system = [gen.randrange(3, 512) for _ in range(70)]  # 4 full blocks and a part
    prompts = [system + [gen.randrange(3, 512) for _ in range(n)] for n in (12, 30, 45, 7)]
    specs = [RequestSpec(i, p, 20, temperature=0.0, ignore_eos=True,
                         block_hashes=tuple(block_hashes(p, BLOCK, "gpu-test"))) for i, p in enumerate(prompts)]
    return [specs[:1], specs[1:3], [specs[3], dataclasses.replace(specs[0], request_id=9)]]


def _runner(model, cfg, keep_graphs: bool):
    from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig

    return GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=BLOCK,
                                                 context_len=CONTEXT, num_kv_blocks=96, sampling_extensions=False),
                     progress=False, keep_graphs=keep_graphs)


def _serve_waves(prod: ShmProducer, step) -> tuple[list[list[int]], list[int]]:
    """Each wave submitted once the one before finished; returns tokens and cached_tokens per request."""
    tokens, cached = [], []
    for wave in _waves():
        slots = [prod.submit(s) for s in wave]
        got, first, done = {s: [] for s in slots}, {}, {}
        deadline = time.monotonic() + 60
        while len(done) < len(slots):
            step()
            for s in (s for s in slots if s not in done):
                upd = prod.poll(s)
                got[s] += upd.tokens
                if upd.tokens:
                    first.setdefault(s, upd.cached_tokens)
                if upd.finish is not FinishReason.NONE:
                    done[s] = upd.finish
            assert time.monotonic() < deadline, "no progress"
        for s in slots:
            assert done[s] is FinishReason.LENGTH
            tokens.append(got[s])
            cached.append(first[s])
            prod.release(s)
    return tokens, cached


def _host(runner, cfg, config: EngineConfig):
    ring = create_ring(f"blink-pc-host-{os.getpid()}", RingGeometry(16, 256, 256, kv_block_size=BLOCK), "test")
    try:
        loop = EngineLoop(runner, cfg, RingConsumer(ring), config, context_len=CONTEXT)
        out = _serve_waves(ShmProducer(attach_ring(ring.name)), loop.step)
        assert loop.scheduler.num_available == runner.num_blocks and not loop.scheduler.a["block_ref"].any()
        return (*out, ring.stats())
    finally:
        ring.close()


def _persistent(runner, cfg, config: EngineConfig):
    from gpu_backend.engine.persistent import PersistentEngine

    ring = create_ring(f"blink-pc-loop-{os.getpid()}", RingGeometry(16, 256, 256, kv_block_size=BLOCK), "test")
    engine = PersistentEngine(runner, cfg, ring, config, context_len=CONTEXT)
    try:
        engine.start()
        out = _serve_waves(ShmProducer(attach_ring(ring.name)), lambda: time.sleep(0.0005))
        time.sleep(0.05)  # a heartbeat after the last finish: the header's counters are current
        return (*out, ring.stats())
    finally:
        engine.shutdown()
        ring.close()


def _check(on, off) -> None:
    (tok_on, cached_on, stats_on), (tok_off, cached_off, stats_off) = on, off
    assert tok_on == tok_off and all(len(t) == 20 for t in tok_on)
    assert cached_off == [0] * 5 and stats_off["prefix_cache_hits"] == 0
    assert cached_on[0] == 0 and all(c % BLOCK == 0 for c in cached_on) and min(cached_on[1:]) >= 4 * BLOCK
    assert stats_on["prefix_cache_hits"] == sum(cached_on) and stats_on["cached_kv_blocks"] > 0


def test_host_mode_caching_on_and_off_give_the_same_greedy_tokens():
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg, keep_graphs=False)
    _check(_host(runner, cfg, ON), _host(runner, cfg, OFF))


def test_persistent_mode_caching_on_and_off_give_the_same_greedy_tokens_as_the_host_engine():
    cfg, model = _peaky_model()
    model = model.to(device="cuda", dtype=torch.bfloat16)
    host = _host(_runner(model, cfg, keep_graphs=True), cfg, ON)
    on = _persistent(_runner(model, cfg, keep_graphs=True), cfg, ON)  # one loop per runner, as test_persistent
    off = _persistent(_runner(model, cfg, keep_graphs=True), cfg, OFF)
    _check(on, off)
    assert on[0] == host[0]
