"""The host side of the GPU runner, without a GPU: bucket choice and the step buffer a graph reads."""
import numpy as np
import pytest
import torch

from gpu_backend.engine.gpu_runner import GpuRunnerConfig
from gpu_backend.engine.step_buffers import StepBuffers, bucket_for, token_buckets
from reference_scheduler import BlockManager, Scheduler, SchedulerConfig, fill_step
from protocols.ring import RequestSpec


def test_buckets_cover_every_token_count():
    buckets = token_buckets(48)
    assert buckets == (1, 2, 4, 8, 16, 32, 48)
    assert [bucket_for(n, buckets) for n in (1, 3, 17, 33, 48)] == [1, 4, 32, 48, 48]
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        bucket_for(49, buckets)


def test_config_rejects_bad_limits():
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        GpuRunnerConfig(gpu_memory_fraction=1.5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        GpuRunnerConfig(max_num_batched_tokens=8, max_num_seqs=16)


def _mixed_batch(block_size=4):
    """One decoding sequence (7 tokens cached) and one prompt of 10 split into a chunk."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=4, context_len=64),
                      BlockManager(32, block_size))
    a = sched.add(0, 1, RequestSpec(1, list(range(10, 17)), max_tokens=5, temperature=0.0), rng_seed=3)
    batch = sched.schedule()
    sched.update(batch, {id(a): 99})                       # a: prompt done, one token sampled
    b = sched.add(1, 2, RequestSpec(2, list(range(40, 50)), max_tokens=5, temperature=0.8, top_k=5,
                                    seed=2**64 - 5), rng_seed=2**64 - 5)
    return sched.schedule(), a, b


def test_fill_writes_a_mixed_batch_and_pads_the_bucket():
    config = GpuRunnerConfig(max_num_batched_tokens=8, max_num_seqs=4, block_size=4, context_len=64)
    bufs = StepBuffers(8, 4, config.max_blocks_per_seq, torch.device("cpu"))
    for arr in bufs.h.values():
        arr.fill(77)                                        # poison: every used field must be written
    batch, a, b = _mixed_batch()
    assert [(e.seq, e.q_len, e.samples) for e in batch.entries] == [(a, 1, True), (b, 6, False)]
    bucket, greedy, num_sampled = fill_step(bufs, batch, config, token_buckets(8))
    h = bufs.h
    assert (bucket, greedy, num_sampled) == (8, True, 1)
    assert h["input_ids"][:7].tolist() == [99, 40, 41, 42, 43, 44, 45]
    assert h["input_ids"][7] == 0 and h["seq_ids"][7] == -1 and h["slot_mapping"][7] == -1
    assert h["positions"][:7].tolist() == [7, 0, 1, 2, 3, 4, 5]
    ta, tb = a.block_table, b.block_table
    assert h["slot_mapping"][0] == ta[1] * 4 + 3
    assert h["slot_mapping"][1:7].tolist() == [tb[p // 4] * 4 + p % 4 for p in range(6)]
    assert h["seq_ids"][:7].tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert h["q_start"][:5].tolist() == [0, 1, 7, 7, 7] and h["num_seqs"][0] == 2
    assert h["ctx_lens"][:2].tolist() == [8, 6]
    assert h["block_tables"][0, :len(ta)].tolist() == ta and h["block_tables"][1, :len(tb)].tolist() == tb
    assert h["sample_rows"][:4].tolist() == [0, 0, 0, 0]
    assert h["sample_pos"][0] == 8 and h["seeds"][0] == 3 and h["temperature"][0] == 0.0


def test_fill_sampling_row_carries_the_full_64_bit_seed():
    config = GpuRunnerConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, context_len=64)
    bufs = StepBuffers(16, 4, config.max_blocks_per_seq, torch.device("cpu"))
    sched = Scheduler(SchedulerConfig(16, 4, 64), BlockManager(32, 4))
    seq = sched.add(0, 1, RequestSpec(1, [5, 6, 7], max_tokens=4, temperature=0.7, top_p=0.9, min_p=0.05,
                                      top_k=3, seed=2**64 - 5), rng_seed=2**64 - 5)
    bucket, greedy, num_sampled = fill_step(bufs, sched.schedule(), config, token_buckets(16))
    h = bufs.h
    assert (bucket, greedy, num_sampled) == (4, False, 1)
    assert h["seeds"].view(np.uint64)[0] == 2**64 - 5 and h["sample_rows"][0] == 2
    assert h["top_k"][0] == 3 and np.isclose(h["top_p"][0], 0.9) and np.isclose(h["min_p"][0], 0.05)
    assert h["sample_pos"][0] == len(seq.token_ids) == 3
