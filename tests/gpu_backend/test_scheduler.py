"""The reference scheduler: batching, chunked prefill, priorities, preemption and block accounting."""
import random

import pytest

from reference_scheduler import BlockManager, Scheduler, SchedulerConfig, Status
from protocols.ring import ErrorCode, FinishReason, RequestSpec

EOS = 0


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, context_len=256):
    cfg = SchedulerConfig(budget, max_seqs, context_len, (EOS,))
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def add(s, prompt_len, max_tokens=8, priority=0, slot=None, **kw):
    spec = RequestSpec(request_id=1, prompt_ids=list(range(1, prompt_len + 1)), max_tokens=max_tokens,
                       priority=priority, **kw)
    assert s.check(spec) is ErrorCode.NONE
    return s.add(slot if slot is not None else s._arrivals, s._arrivals + 1, spec, rng_seed=0)


def step(s, token=7, room=lambda seq: 1 << 30):
    batch = s.schedule(room)
    sampled = {id(e.seq): token for e in batch.entries if e.samples}
    return batch, *s.update(batch, sampled)


def blocks_in_use(s):
    return sum(len(q.block_table) for q in s.all_sequences())


def test_decode_first_then_prefill_within_budget():
    s = make(budget=10)
    a = add(s, 3)
    step(s)  # a prefills (3 tokens) and samples its first token
    b = add(s, 20)
    batch, _, _ = step(s)
    assert [(e.seq, e.q_len) for e in batch.entries] == [(a, 1), (b, 9)]
    assert batch.num_tokens == 10


def test_chunked_prefill_feeds_whole_prompt_across_steps():
    s = make(budget=8)
    seq = add(s, 21, max_tokens=1)
    chunks = []
    while seq.status is not Status.FINISHED:
        batch, _, finished = step(s)
        chunks.append(batch.entries[0].q_len)
        assert [e.samples for e in batch.entries] == [seq.num_computed == 21]
    assert chunks == [8, 8, 5]
    assert s.blocks.num_free == s.blocks.num_blocks


def test_strict_priority_then_fcfs():
    s = make(budget=4)
    low = add(s, 4, priority=1, max_tokens=1)
    first = add(s, 4, priority=0, max_tokens=1)
    second = add(s, 4, priority=0, max_tokens=1)
    order = []
    for _ in range(3):
        batch, _, _ = step(s)
        order += [e.seq for e in batch.entries]
    assert order == [first, second, low]


def test_stops_on_eos_stop_ids_and_max_tokens_and_frees_blocks():
    s = make()
    eos = add(s, 5, max_tokens=10)
    _, new, finished = step(s, token=EOS)
    assert new == [] and [(f.seq, f.reason) for f in finished] == [(eos, FinishReason.STOP)]
    stop = add(s, 5, stop_ids=(42,))
    _, new, finished = step(s, token=42)
    assert finished[0].reason is FinishReason.STOP and new == []
    length = add(s, 5, max_tokens=3)
    tokens = []
    while length.status is not Status.FINISHED:
        _, new, finished = step(s)
        tokens += [t for _, t in new]
    assert len(tokens) == 3 and finished[0].reason is FinishReason.LENGTH
    assert s.blocks.num_free == s.blocks.num_blocks


def test_ignore_eos_keeps_generating():
    s = make()
    seq = add(s, 5, max_tokens=4, ignore_eos=True)
    n = 0
    while seq.status is not Status.FINISHED:
        _, new, _ = step(s, token=EOS)
        n += len(new)
    assert n == 4


def test_admission_waits_for_blocks():
    s = make(num_blocks=4, block_size=4, budget=64)
    a = add(s, 16, max_tokens=1)  # takes all 4 blocks
    b = add(s, 4, max_tokens=1)
    batch, _, _ = step(s)
    assert [e.seq for e in batch.entries] == [a] and b.status is Status.WAITING
    batch, _, _ = step(s)  # a finished and freed its blocks last step
    assert [e.seq for e in batch.entries] == [b]


def test_preemption_by_recompute_keeps_tokens_and_never_leaks():
    s = make(num_blocks=8, block_size=4, budget=64)
    a = add(s, 8, max_tokens=20)
    b = add(s, 8, max_tokens=20)
    step(s)  # both prefilled: 2 + 2 blocks (+ room for the first token)
    preempted = []
    for _ in range(12):
        batch, _, _ = step(s)
        preempted += batch.preempted
        assert blocks_in_use(s) + s.blocks.num_free == s.blocks.num_blocks
        assert len({b for q in s.all_sequences() for b in q.block_table}) == blocks_in_use(s)
    assert b in preempted  # the later arrival gave way
    assert b.num_preemptions >= 1 and len(b.token_ids) > b.prompt_len  # its generated tokens stay
    while s.num_unfinished:
        step(s)
    assert s.blocks.num_free == s.blocks.num_blocks
    assert a.num_generated == 20 and b.num_generated == 20


def test_backpressure_skips_a_sequence_with_a_full_output_buffer():
    s = make()
    a = add(s, 4)
    b = add(s, 4)
    step(s)
    batch, _, _ = step(s, room=lambda seq: 0 if seq is a else 5)
    assert [e.seq for e in batch.entries] == [b]
    assert a.status is Status.RUNNING


def test_check_refuses_what_can_never_run():
    s = make(num_blocks=4, block_size=4, context_len=64)
    too_long = RequestSpec(1, list(range(64)), 1)
    assert s.check(too_long) is ErrorCode.PROMPT_TOO_LONG
    too_big = RequestSpec(1, list(range(10)), 30)
    assert s.check(too_big) is ErrorCode.NO_KV_CAPACITY


def test_random_workload_conserves_blocks_and_finishes_everything():
    rng = random.Random(0)
    s = make(num_blocks=24, block_size=4, budget=12, max_seqs=5)
    seqs = []
    for i in range(200):
        if rng.random() < 0.3 and len(seqs) < 40:
            seqs.append(add(s, rng.randint(1, 30), max_tokens=rng.randint(1, 20), priority=rng.randint(0, 1)))
        if rng.random() < 0.05 and s.num_unfinished:
            victim = rng.choice(list(s.all_sequences()))
            s.finish(victim, FinishReason.CANCELLED)
        batch, _, _ = step(s, token=rng.randint(1, 99))
        assert blocks_in_use(s) + s.blocks.num_free == s.blocks.num_blocks
        assert batch.num_tokens <= 12
        for e in batch.entries:
            if e.seq.status is not Status.FINISHED:
                assert len(e.seq.block_table) * 4 >= e.seq.num_computed
    while s.num_unfinished:
        step(s)
    assert s.blocks.num_free == s.blocks.num_blocks
    assert all(q.status is Status.FINISHED for q in seqs)
