"""The C++ scheduler (kernels/csrc/include/blink_sched.h, host build; what every engine runs) against the
Python reference (tests/gpu_backend/reference_scheduler.py) on randomized request traces: arrivals, cancels, sampled tokens (EOS and stop ids
included), small block pools that force preemption, full output buffers. Step by step: the same batch
entries (slot, q_len, samples), the same preemptions, the same published tokens and finishes, the same
block tables, free list (block ids and order) and queue order; every block back in the pool at the end.
With the prefix cache on (shared prefixes, gateway hash chains, some cut short or crafted), also the same
hash table, reference counts, evictable list and counters, and every reference given back at the end.
A second pass fills the step buffer from both (the reference's fill_step) and compares it byte for byte."""
import dataclasses
import random

import numpy as np
import pytest

from reference_scheduler import BlockManager, Scheduler, SchedulerConfig, fill_step
from kernels import sched_host
from kernels.sched_layout import TOKEN_MASK_EMPTY, TOKEN_WAIT
from protocols.prefix_hash import block_hashes
from protocols.ring import ErrorCode, FinishReason, RequestSpec

if sched_host.host_compiler() is None:
    pytest.skip("no C++ compiler on PATH (set CXX or install g++): the native scheduler cannot be built",
                allow_module_level=True)

from gpu_backend.engine.sched_native import NativeScheduler, StepGeometry  # noqa: E402

EOS = 0
MAX_SLOTS = 12


def random_setup(rng: random.Random, caching: bool = False):
    budget = rng.choice([4, 8, 16, 33])
    cfg = SchedulerConfig(budget, rng.randint(1, min(8, budget)), rng.choice([16, 40, 128]), (EOS, 1), caching)
    return cfg, rng.choice([4, 6, 10, 24, 64]), rng.choice([1, 2, 4, 8])


def random_prompt(rng: random.Random, cfg: SchedulerConfig, shared: list[list[int]] | None) -> list[int]:
    """Random tokens; with `shared` (caching traces), mostly a prefix of one of a few shared documents
    (system prompts, earlier turns) and a random tail."""
    n = rng.randint(1, cfg.context_len + 2)
    if not shared or rng.random() < 0.2:
        return [rng.randint(2, 99) for _ in range(n)]
    head = rng.choice(shared)[: rng.randint(0, n)]
    return head + [rng.randint(2, 99) for _ in range(n - len(head))]


def random_hashes(rng: random.Random, prompt: list[int], block_size: int, salt: str) -> tuple[int, ...]:
    """The gateway's chain, sometimes cut short; rarely a crafted one (repeats, a zero, past the blocks)."""
    hashes = block_hashes(prompt, block_size, "model", salt, limit=rng.choice([None, None, None, 1, 3]))
    r = rng.random()
    if r < 0.03 and hashes:
        return tuple(hashes[:1] * 3)
    if r < 0.05 and hashes:
        return (hashes[0], 0, *hashes[1:])
    if r < 0.07:
        return tuple(hashes) + (12345,)
    return tuple(hashes)


def random_spec(rng: random.Random, cfg: SchedulerConfig, shared: list[list[int]] | None = None,
                block_size: int = 1) -> RequestSpec:
    prompt = random_prompt(rng, cfg, shared)
    hashes = random_hashes(rng, prompt, block_size, rng.choice(["", "", "tenant-b"])) if shared else ()
    return RequestSpec(
        request_id=rng.randrange(1 << 30), prompt_ids=prompt, block_hashes=hashes,
        max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 0.7, 1.0, 1.0, -1.0 if rng.random() < 0.05 else 1.0]),
        top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 1, 5]), min_p=rng.choice([0.0, 0.1]),
        stop_ids=tuple(rng.sample(range(2, 100), rng.randint(0, 3))), ignore_eos=rng.random() < 0.2,
        priority=rng.randint(0, 2))


def sampled_token(rng: random.Random, spec: RequestSpec, masks: bool = False) -> int:
    if masks and spec.priority == 1:  # the constrained requests of a trace: their masks come late, now and then
        r = rng.random()
        if r < 0.3:
            return TOKEN_WAIT
        if r < 0.31:
            return TOKEN_MASK_EMPTY
    r = rng.random()
    if r < 0.08:
        return rng.choice([EOS, 1])
    if r < 0.12 and spec.stop_ids:
        return rng.choice(spec.stop_ids)
    return rng.randint(2, 99)


def assert_same_state(py: Scheduler, nat: NativeScheduler) -> None:
    blocks = py.blocks
    assert nat.num_free == blocks.num_free and nat.num_available == blocks.num_available
    assert nat.free_list() == list(blocks._free)
    assert nat.evictable() == list(blocks.lru)
    assert nat.a["block_ref"].tolist() == blocks.ref
    assert nat.a["block_hash"].tolist() == blocks.block_hash
    assert nat.prefix_cache_stats() == (len(blocks.cached), blocks.queries, blocks.hits)
    table = nat.a["hash_table"]
    assert sorted(table[table >= 0].tolist()) == sorted(blocks.cached.values())
    assert nat.running == [s.slot for s in py.running]
    assert nat.waiting == [s.slot for s in py.waiting]
    for s in py.all_sequences():
        assert nat.block_table(s.slot) == s.block_table
        assert nat.a["num_computed"][s.slot] == s.num_computed
        assert nat.a["status"][s.slot] == s.status.value
        assert nat.token_ids(s.slot) == s.token_ids
        assert nat.cached_tokens(s.slot) == s.cached_tokens and s.cached_tokens % blocks.block_size == 0


class Trace:
    """One randomized trace run on both schedulers at once."""

    def __init__(self, seed: int, filler=None, caching: bool = False, masks: bool = False):
        self.rng = rng = random.Random(seed)
        self.masks, self.waits, self.errors = masks, 0, 0
        self.cfg, num_blocks, self.block_size = random_setup(rng, caching)
        block_size = self.block_size
        self.py = Scheduler(self.cfg, BlockManager(num_blocks, block_size, caching))
        self.shared = [[rng.randint(2, 99) for _ in range(self.cfg.context_len)] for _ in range(3)] if caching else None
        step = filler.geometry(self.cfg, block_size, rng) if filler else None
        self.nat = NativeScheduler(self.cfg, num_blocks, block_size, MAX_SLOTS, max_stop_ids=4, step=step)
        self.filler, self.free_slots, self.by_slot = filler, list(range(MAX_SLOTS)), {}
        self.steps = self.preemptions = self.finishes = self.stalls = self.evictions = 0
        self.last_batch_len = 0

    def arrive(self) -> None:
        for _ in range(self.rng.choice([0, 0, 1, 2])):
            spec = random_spec(self.rng, self.cfg, self.shared, self.block_size)
            error = self.py.check(spec)
            assert self.nat.check(spec) is error
            if error is not ErrorCode.NONE or not self.free_slots:
                continue
            slot = self.free_slots.pop(self.rng.randrange(len(self.free_slots)))
            seed = self.rng.randrange(1 << 64)
            self.by_slot[slot] = self.py.add(slot, self.steps, spec, seed)
            self.nat.add(slot, spec, seed)

    def cancel(self) -> None:
        if self.by_slot and self.rng.random() < 0.05:
            slot = self.rng.choice(sorted(self.by_slot))
            self.py.finish(self.by_slot[slot], None)
            self.nat.finish(slot)
            self._release(slot)

    def _release(self, slot: int) -> None:
        del self.by_slot[slot]
        self.free_slots.append(slot)
        self.finishes += 1

    def step(self) -> None:
        room = np.array([0 if self.rng.random() < 0.15 else self.rng.randint(1, 50) for _ in range(MAX_SLOTS)], np.int32)
        self.cached_before = len(self.py.blocks.cached)
        batch = self.py.schedule(lambda s: int(room[s.slot]))
        entries = self.nat.schedule(room)
        assert [(e.slot, e.q_len, e.samples) for e in entries] == [(e.seq.slot, e.q_len, e.samples) for e in batch.entries]
        assert self.nat.preempted == [s.slot for s in batch.preempted]
        self.preemptions += len(batch.preempted)
        self.last_batch_len = len(entries)
        if self.filler:
            self.filler.compare(batch, self.nat, self.rng)
        self.evictions += max(0, self.cached_before - len(self.py.blocks.cached))
        sampling = [e.seq for e in batch.entries if e.samples]
        tokens = [sampled_token(self.rng, s.spec, self.masks) for s in sampling]
        self.waits += tokens.count(TOKEN_WAIT)
        new_py, done_py = self.py.update(batch, {id(s): t for s, t in zip(sampling, tokens)})
        new_nat, done_nat = self.nat.update(tokens)
        assert new_nat == [(s.slot, t) for s, t in new_py]
        assert done_nat == [(f.seq.slot, f.reason) for f in done_py]
        self.errors += sum(reason is FinishReason.ERROR for _, reason in done_nat)
        for slot, _ in done_nat:
            self._release(slot)
        assert_same_state(self.py, self.nat)
        self.steps += 1

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.arrive()
            self.cancel()
            self.step()
        idle = 0
        while self.py.num_unfinished and idle < 30:  # drain: no more arrivals
            self.step()
            idle = 0 if self.last_batch_len else idle + 1
        if self.py.num_unfinished:  # no progress in 30 steps: a stall (counted; the test requires none)
            self.stalls += 1
            for slot in sorted(self.by_slot):
                self.py.finish(self.by_slot[slot], None)
                self.nat.finish(slot)
                self._release(slot)
            assert_same_state(self.py, self.nat)
        assert not self.py.num_unfinished
        blocks, nb = self.py.blocks, self.nat.h.cfg.num_blocks
        assert self.nat.num_available == nb == blocks.num_available  # no block leaked
        assert sorted(self.nat.free_list() + self.nat.evictable()) == list(range(nb))  # none freed twice
        assert not self.nat.a["block_ref"].any() and not any(blocks.ref)  # every reference given back
        assert self.nat.running == [] and self.nat.waiting == []


NUM_TRACES, NUM_STEPS = 60, 300


def test_native_scheduler_matches_reference_on_random_traces():
    totals = {"steps": 0, "preemptions": 0, "finishes": 0, "stalls": 0}
    for seed in range(NUM_TRACES):
        trace = Trace(seed)
        trace.run(NUM_STEPS)
        totals = {k: v + getattr(trace, k) for k, v in totals.items()}
    print(f"{NUM_TRACES} traces: {totals}")
    assert totals["preemptions"] > 50 and totals["finishes"] > 1000  # the traces reach the hard cases
    assert totals["stalls"] == 0


NUM_CACHE_TRACES = 60


def test_prefix_cache_matches_reference_on_random_traces():
    """Shared prefixes, preemption, cancellation and eviction, with the cache on: same decisions, same block
    ids, the same cache (hash table, reference counts, LRU order, counters), no leak at the end."""
    totals = {"steps": 0, "preemptions": 0, "finishes": 0, "stalls": 0, "evictions": 0}
    hits = queries = 0
    for seed in range(5000, 5000 + NUM_CACHE_TRACES):
        trace = Trace(seed, caching=True)
        trace.run(NUM_STEPS)
        totals = {k: v + getattr(trace, k) for k, v in totals.items()}
        hits, queries = hits + trace.py.blocks.hits, queries + trace.py.blocks.queries
    print(f"{NUM_CACHE_TRACES} cached traces: {totals}, hit {hits} of {queries} tokens")
    assert totals["preemptions"] > 50 and totals["finishes"] > 1000 and totals["evictions"] > 100
    assert 0.05 < hits / queries < 0.95 and totals["stalls"] == 0


def test_rows_that_wait_for_their_mask_or_get_an_empty_one_match_the_reference():
    """Constrained rows (a trace's priority-1 requests) sample no token 30% of the time (their mask had not
    come: the same position runs again) and an empty mask 1% (ERROR): both schedulers agree step by step."""
    waits = errors = 0
    for seed in range(NUM_TRACES // 2):
        trace = Trace(1000 + seed, masks=True)
        trace.run(NUM_STEPS // 2)
        waits += trace.waits
        errors += trace.errors
    assert waits > 500 and errors > 5


def test_a_waiting_row_runs_its_last_position_again_and_publishes_nothing():
    cfg = SchedulerConfig(8, 4, 64, (EOS,))
    nat = NativeScheduler(cfg, 16, 4, MAX_SLOTS, max_stop_ids=4)
    nat.add(3, RequestSpec(request_id=1, prompt_ids=[5, 6, 7], max_tokens=4), 0)
    nat.add(4, RequestSpec(request_id=2, prompt_ids=[8], max_tokens=4), 0)
    room = np.full(MAX_SLOTS, 8, np.int32)
    assert [(e.slot, e.q_len) for e in nat.schedule(room)] == [(3, 3), (4, 1)]
    assert nat.update([TOKEN_WAIT, 9]) == ([(4, 9)], [])  # slot 3: no token, its prompt's last row again
    assert nat.a["num_computed"][3] == 2 and nat.token_ids(3) == [5, 6, 7]
    assert [(e.slot, e.q_len, e.samples) for e in nat.schedule(room)] == [(3, 1, True), (4, 1, True)]
    assert nat.update([11, TOKEN_MASK_EMPTY]) == ([(3, 11)], [(4, FinishReason.ERROR)])
    assert nat.token_ids(3) == [5, 6, 7, 11] and nat.a["num_computed"][3] == 3
    assert nat.num_free == 16 - 1  # slot 4's block went back the same step


def test_check_and_free_slot_errors():
    nat = NativeScheduler(SchedulerConfig(16, 8, 64, (EOS,)), 4, 4, 2)
    assert nat.check(RequestSpec(1, list(range(64)), 1)) is ErrorCode.PROMPT_TOO_LONG
    assert nat.check(RequestSpec(1, [1], 1, top_p=0.0)) is ErrorCode.INVALID_PARAMS
    assert nat.check(RequestSpec(1, list(range(10)), 30)) is ErrorCode.NO_KV_CAPACITY
    nat.add(0, RequestSpec(1, [5], 3), 0)
    with pytest.raises(ValueError, match="slot 0"):
        nat.add(0, RequestSpec(1, [5], 3), 0)


class StepFiller:
    """Fills gpu_runner's StepBuffers from the reference batch (fill_step) and from the native state."""

    def __init__(self):
        torch = pytest.importorskip("torch")
        from gpu_backend.engine import gpu_runner
        self.torch, self.gr = torch, gpu_runner
        self.compared = 0

    def geometry(self, cfg: SchedulerConfig, block_size: int, rng: random.Random) -> StepGeometry:
        budget = cfg.max_num_batched_tokens
        self.runner_cfg = rc = self.gr.GpuRunnerConfig(
            max_num_batched_tokens=budget, max_num_seqs=rng.randint(cfg.max_num_seqs, budget),
            block_size=block_size, context_len=cfg.context_len)
        self.buckets = self.gr.token_buckets(budget)
        self.bufs = self.gr.StepBuffers(budget, rc.max_num_seqs, rc.max_blocks_per_seq, self.torch.device("cpu"))
        return StepGeometry(budget, rc.max_num_seqs, self.buckets)

    def check_layout(self, nat: NativeScheduler) -> None:
        rc, offsets = self.runner_cfg, np.zeros(15, np.uint64)
        total = nat.lib.blink_sched_step_layout(rc.max_num_batched_tokens, rc.max_num_seqs, rc.max_blocks_per_seq,
                                                offsets.ctypes.data)
        assert offsets.tolist() == [off for off, _, _ in self.bufs.offsets.values()] and total == self.bufs.num_bytes

    def compare(self, batch, nat: NativeScheduler, rng: random.Random) -> None:
        if not batch:
            return
        self.bufs.host.zero_()
        bucket, greedy, num_sampled = fill_step(self.bufs, batch, self.runner_cfg, self.buckets)
        mine = np.zeros(self.bufs.num_bytes, np.uint8)
        assert nat.fill(mine, nthreads=rng.choice([1, 3, 32])) == bucket
        assert (nat.h.all_greedy, nat.h.num_sampled) == (greedy, num_sampled)
        assert np.array_equal(mine, self.bufs.host.numpy())
        self.compared += 1


NUM_FILL_TRACES, NUM_FILL_STEPS = 15, 150


def test_native_step_buffer_matches_fill_step_byte_for_byte():
    filler = StepFiller()
    for seed in range(1000, 1000 + NUM_FILL_TRACES):
        trace = Trace(seed, filler, caching=seed % 3 == 0)  # cached admissions start mid-prompt
        filler.check_layout(trace.nat)
        trace.run(NUM_FILL_STEPS)
    print(f"{filler.compared} step buffers compared")
    assert filler.compared > 1000


def test_no_stall_when_partial_prefills_hold_every_block():
    """Both schedulers once stalled here for ever (prefill never preempted); now the later one yields."""
    cfg = SchedulerConfig(4, 2, 64, (EOS,))
    py = Scheduler(cfg, BlockManager(8, 1))
    nat = NativeScheduler(cfg, 8, 1, 2)
    specs = [RequestSpec(1, [5] * 6, 1), RequestSpec(2, [6] * 6, 1)]
    seqs = [py.add(slot, slot, spec, 0) for slot, spec in enumerate(specs)]
    for slot, spec in enumerate(specs):
        nat.add(slot, spec, 0)
    for room in ([1, 1], [0, 1]):  # A prefills 4 of 6; A's last chunk waits for room while B takes 4 blocks
        batch = py.schedule(lambda s: room[s.slot])
        py.update(batch, {id(e.seq): 7 for e in batch.entries if e.samples})
        nat.schedule(np.array(room, np.int32))
        nat.update([7] * nat.h.num_sampled)
    assert py.blocks.num_free == nat.num_free == 0 and [s.num_computed for s in seqs] == [4, 4]
    progress = (bool(py.schedule(lambda s: 100)), bool(nat.schedule(np.array([100, 100], np.int32))))
    assert progress == (True, True)
    assert py.blocks.num_free == nat.num_free and seqs[1].num_computed == 0 and seqs[1].num_preemptions == 1


def test_decode_blocks_get_the_gateways_hash_chain():
    """Past the request's hashes the scheduler extends the chain over the sequence's own tokens with the
    gateway's function: a later prompt holding this prompt and its answer hashes to the same blocks."""
    bs = 4
    cfg = SchedulerConfig(16, 2, 64, (EOS,), enable_prefix_caching=True)
    nat = NativeScheduler(cfg, 16, bs, 2)
    prompt = [5, 6, 7, 8, 9, 10]  # one full block: the gateway sends one hash
    nat.add(0, RequestSpec(1, prompt, 20, block_hashes=tuple(block_hashes(prompt, bs, "m", "salt"))), 0)
    generated = []
    for step in range(12):
        nat.schedule(np.array([100, 100], np.int32))
        token = 20 + step
        generated += [token]
        nat.update([token])
    tokens = prompt + generated
    computed = int(nat.a["num_computed"][0])  # the last sampled token is not fed yet
    want = block_hashes(tokens[:computed], bs, "m", "salt")
    assert nat.a["num_hashes"][0] == len(want) == computed // bs == 4
    assert nat.a["seq_hashes"][0, : len(want)].tolist() == want
    assert nat.prefix_cache_stats()[0] == 4  # the prompt's block and the three its decoding filled
