"""The reference scheduler and step fill: continuous batching over a paged KV cache, in plain Python.

A test oracle, not product code: every engine runs the native scheduler (kernels/csrc/include/blink_sched.h
through gpu_backend/engine/sched_native.py, and the same header inside the GPU-resident loop).
`test_sched_native.py` diffs the two on randomized request traces (same inputs -> same batch, step by
step) and the step buffers they fill byte for byte. GPU tests that hand-build a batch fill a runner's step
buffer with `step_of` here. The state is kept in the shapes the native version uses (block tables of int
ids, a free list, per-sequence counters), so a rule reads the same in both.

Rules (DESIGN.md, "Scheduling on the GPU"):
- one step = one flat batch of at most `max_num_batched_tokens` tokens: decode tokens first, then
  prefill chunks (a long prompt is split across steps: chunked prefill);
- strict priority classes (lower `priority` first), FCFS inside a class;
- KV blocks come from a free list; a sequence is admitted only when blocks for its chunk exist;
- when a running sequence needs a block and none is free, the latest, lowest-priority running sequence
  is preempted by recompute: its blocks return to the free list, and it re-enters the waiting queue with
  its generated tokens, which are recomputed as part of its prompt; likewise when partial prefills hold
  every block and no step could run at all;
- a sequence whose output buffer in the ring is full is skipped this step (backpressure), not dropped;
- finished and cancelled sequences free their blocks in the same step;
- prefix cache (kernels/csrc/include/blink_prefix_cache.h): a waiting sequence starts on the cached blocks of
  its prompt's leading block hashes (reference-counted, at least one token left to compute), full prompt
  blocks are published as they are computed (past the request's hashes, the chain is extended over the
  sequence's own tokens: decode blocks too), unreferenced cached blocks are evicted least recently used
  first when the free list is empty.
"""
from __future__ import annotations

import enum
import hashlib
import math
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from gpu_backend.engine.sched_native import SchedulerConfig
from gpu_backend.engine.step_buffers import ScheduledStep, StepBuffers, bucket_for
from kernels.sched_layout import TOKEN_MASK_EMPTY, TOKEN_WAIT
from protocols.ring import ErrorCode, FinishReason, RequestSpec

__all__ = ["SchedulerConfig", "Scheduler", "BlockManager", "Batch", "ScheduledSeq", "Sequence", "Status",
           "Finished", "fill_step", "step_of"]


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. `token_ids` is prompt + generated; KV exists for `num_computed`."""

    slot: int
    seq: int  # the ring submission number
    spec: RequestSpec
    arrival: int  # admission order, for FCFS
    rng_seed: int  # the request's seed, or one drawn at arrival: sampling is keyed by (rng_seed, position)
    token_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # those the scheduler keeps (blink_set_hashes)
    num_published: int = 0  # leading table blocks already in the cache or passed over
    cached_tokens: int = 0  # prompt tokens the first admission took from the cache

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_remaining(self) -> int:
        """Tokens to feed the model before the next sample (1 for a decoding sequence)."""
        return len(self.token_ids) - self.num_computed

    @property
    def order(self) -> tuple[int, int]:
        return (self.spec.priority, self.arrival)


def next_block_hash(prev: int, tokens) -> int:
    """The gateway's chain step (protocols/prefix_hash.py) from the previous block's hash."""
    digest = hashlib.blake2b(prev.to_bytes(8, "little") + array("i", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class BlockManager:
    """Fixed-size KV blocks: a free list and per-sequence block tables. Block ids index the KV tensor.

    With `prefix_caching`, blocks are reference-counted and a full prompt block keeps its hash in `cached`
    (hash -> block) until evicted; `lru` holds the unreferenced cached blocks, least recently used first."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.block_hash = [0] * num_blocks
        self.cached: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.queries = self.hits = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self.lru)

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self.lru.popitem(last=False)
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = 0
        self.ref[b] = 1
        return b

    def _drop(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] > 0:
            return
        if self.block_hash[b]:
            self.lru[b] = None
        else:
            self._free.append(b)

    def probe(self, seq: Sequence) -> list[int]:
        """The cached blocks of `seq`'s leading hashes (leaving at least one token to compute; a repeated
        block ends the run)."""
        limit = min((len(seq.token_ids) - 1) // self.block_size, len(seq.block_hashes))
        hits: list[int] = []
        for h in seq.block_hashes[:limit] if self.prefix_caching else ():
            b = self.cached.get(h)
            if b is None or b in hits:
                break
            hits.append(b)
        return hits

    def take_cached(self, seq: Sequence, hits: list[int]) -> None:
        for b in hits:
            if self.ref[b] == 0:
                del self.lru[b]
            self.ref[b] += 1
        seq.block_table = list(hits)
        seq.num_published = len(hits)
        seq.num_computed = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.cached_tokens = seq.num_computed
        if self.prefix_caching:
            self.queries += len(seq.token_ids)
            self.hits += seq.num_computed

    def publish(self, seq: Sequence) -> None:
        bs, hashes = self.block_size, seq.block_hashes
        for k in range(len(hashes), seq.num_computed // bs) if hashes else ():  # extend the chain
            hashes.append(next_block_hash(hashes[-1], seq.token_ids[k * bs:(k + 1) * bs]))
        full = min(seq.num_computed // self.block_size, len(seq.block_hashes))
        for k in range(seq.num_published, full):
            h, b = seq.block_hashes[k], seq.block_table[k]
            if not self.block_hash[b] and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        seq.num_published = max(seq.num_published, full)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.extra_blocks(seq, num_tokens)
        if need > self.num_available:
            raise RuntimeError(f"grow by {need} blocks with {self.num_available} available: scheduler bug")
        seq.block_table.extend(self._take() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks: the last first with the cache on (a prompt's tail is evicted before its head)."""
        for b in reversed(seq.block_table) if self.prefix_caching else seq.block_table:
            self._drop(b)
        seq.block_table = []
        seq.num_published = 0


@dataclass
class ScheduledSeq:
    seq: Sequence
    q_len: int  # tokens fed this step
    samples: bool  # this chunk reaches the end of the sequence: a token is sampled from its last row


@dataclass
class Batch:
    entries: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.q_len for e in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


@dataclass
class Finished:
    seq: Sequence
    reason: FinishReason
    error: ErrorCode = ErrorCode.NONE


class Scheduler:
    """`add` -> `schedule` -> (model runs) -> `update` ; `cancel` and `abort_all` at any time between steps."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._arrivals = 0

    # ---- admission -------------------------------------------------------------------------------
    def check(self, spec: RequestSpec) -> ErrorCode:
        """Why a request can never run, or NONE."""
        if len(spec.prompt_ids) >= self.config.context_len:
            return ErrorCode.PROMPT_TOO_LONG
        if (not spec.prompt_ids or spec.max_tokens < 1 or not (0 <= spec.temperature < math.inf)
                or not 0 < spec.top_p <= 1 or spec.top_k < 0 or not 0 <= spec.min_p <= 1):
            return ErrorCode.INVALID_PARAMS
        if self.blocks.blocks_for(self._final_len(spec)) > self.blocks.num_blocks:
            return ErrorCode.NO_KV_CAPACITY
        return ErrorCode.NONE

    def _final_len(self, spec: RequestSpec) -> int:
        """Tokens whose KV a request may need: the last sampled token is never fed back."""
        return min(len(spec.prompt_ids) + spec.max_tokens - 1, self.config.context_len)

    def add(self, slot: int, seq_no: int, spec: RequestSpec, rng_seed: int) -> Sequence:
        seq = Sequence(slot=slot, seq=seq_no, spec=spec, arrival=self._arrivals, rng_seed=rng_seed,
                       token_ids=list(spec.prompt_ids), prompt_len=len(spec.prompt_ids))
        if self.blocks.prefix_caching:
            for h in list(spec.block_hashes)[: len(spec.prompt_ids) // self.blocks.block_size]:
                if not h:
                    break
                seq.block_hashes.append(h)
        self._arrivals += 1
        self.waiting.append(seq)
        return seq

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def all_sequences(self) -> Iterable[Sequence]:
        return [*self.running, *self.waiting]

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self, room: Callable[[Sequence], int] = lambda s: 1 << 30) -> Batch:
        """Choose this step's tokens. `room(seq)` is the free space in the sequence's output buffer.

        Liveness: when partial prefills hold every block and none can grow, nothing would ever run
        again; then the latest, lowest-priority running sequence gives its blocks back (recompute) and
        the step is chosen again."""
        batch = self._schedule_pass(room)
        if not batch and self.blocks.num_available == 0 and any(s.num_remaining > 1 for s in self.running):
            stalled = Batch(preempted=batch.preempted)
            self._preempt(max(self.running, key=lambda s: s.order), stalled)
            batch = self._schedule_pass(room)
            batch.preempted[:0] = stalled.preempted
        return batch

    def _schedule_pass(self, room: Callable[[Sequence], int]) -> Batch:
        batch, budget = Batch(), self.config.max_num_batched_tokens
        self.running.sort(key=lambda s: s.order)
        self.waiting.sort(key=lambda s: s.order)
        scheduled: set[int] = set()
        for seq in list(self.running):  # decode first
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.num_remaining != 1 or room(seq) <= 0:
                continue
            if not self._reserve(seq, seq.num_computed + 1, batch, scheduled):
                continue
            batch.entries.append(ScheduledSeq(seq, 1, True))
            scheduled.add(id(seq))
            budget -= 1
        for seq in [s for s in self.running if s.num_remaining > 1] + list(self.waiting):  # then prefill
            if budget == 0:
                break
            if id(seq) in scheduled or seq.status is Status.FINISHED:
                continue
            q_len = self._prefill_chunk(seq, budget, room)
            if q_len == 0:
                if seq.status is Status.WAITING:
                    break  # FCFS within strict priority: nobody overtakes a waiting head
                continue
            self.blocks.grow(seq, seq.num_computed + q_len)
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = Status.RUNNING
            batch.entries.append(ScheduledSeq(seq, q_len, seq.num_computed + q_len == len(seq.token_ids)))
            scheduled.add(id(seq))
            budget -= q_len
        return batch

    def _prefill_chunk(self, seq: Sequence, budget: int, room: Callable[[Sequence], int]) -> int:
        """The chunk to prefill; a waiting sequence is admitted here over its cached blocks."""
        waiting = seq.status is Status.WAITING
        if waiting and len(self.running) >= self.config.max_num_seqs:
            return 0
        hits = self.blocks.probe(seq) if waiting else []
        idle = sum(self.blocks.ref[b] == 0 for b in hits)
        computed = len(hits) * self.blocks.block_size if waiting else seq.num_computed
        held = len(hits) if waiting else len(seq.block_table)
        q_len = min(len(seq.token_ids) - computed, budget)
        fits = (held + self.blocks.num_available - idle) * self.blocks.block_size - computed
        q_len = min(q_len, fits)
        if q_len > 0 and computed + q_len == len(seq.token_ids) and room(seq) <= 0:
            return 0  # its next token would have nowhere to go
        if q_len > 0 and waiting:
            self.blocks.take_cached(seq, hits)
        return max(q_len, 0)

    def _reserve(self, seq: Sequence, num_tokens: int, batch: Batch, scheduled: set[int]) -> bool:
        """Grow `seq` to `num_tokens`, preempting later sequences if blocks run out."""
        while self.blocks.extra_blocks(seq, num_tokens) > self.blocks.num_available:
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if not victims:
                self._preempt(seq, batch)  # nothing else to take from: it waits for blocks itself
                return False
            self._preempt(max(victims, key=lambda s: s.order), batch)
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.append(seq)
        self.waiting.sort(key=lambda s: s.order)
        batch.preempted.append(seq)

    def update(self, batch: Batch, sampled: dict[int, int]) -> tuple[list[tuple[Sequence, int]], list[Finished]]:
        """Apply a step's results. `sampled` maps id(seq) -> token for entries with `samples`.

        Returns the tokens to publish (stop tokens are not published) and the sequences that finished;
        their blocks are already free.
        """
        new_tokens, finished = [], []
        for entry in batch.entries:
            seq = entry.seq
            seq.num_computed += entry.q_len
            self.blocks.publish(seq)
            if not entry.samples:
                continue
            token = sampled[id(seq)]
            if token == TOKEN_WAIT:  # its mask had not come: no token, the same position runs again
                seq.num_computed -= 1
                continue
            if token == TOKEN_MASK_EMPTY:  # its mask allowed nothing
                finished.append(self.finish(seq, FinishReason.ERROR, ErrorCode.INVALID_PARAMS))
                continue
            reason = self._stop_reason(seq, token)
            if reason is not FinishReason.STOP:
                seq.token_ids.append(token)
                new_tokens.append((seq, token))
            if reason is not FinishReason.NONE:
                finished.append(self.finish(seq, reason))
        return new_tokens, finished

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason:
        spec = self.config
        if (token in spec.eos_token_ids and not seq.spec.ignore_eos) or token in seq.spec.stop_ids:
            return FinishReason.STOP
        if seq.num_generated + 1 >= seq.spec.max_tokens or len(seq.token_ids) + 1 >= spec.context_len:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def finish(self, seq: Sequence, reason: FinishReason, error: ErrorCode = ErrorCode.NONE) -> Finished:
        """Remove `seq` wherever it is and free its blocks now."""
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        return Finished(seq, reason, error)


# ---- the step buffer ----------------------------------------------------------------------------------
def fill_step(bufs: StepBuffers, batch: Batch, config, buckets: tuple[int, ...]) -> tuple[int, bool, int]:
    """Write `batch` into the pinned buffer (padding rows: seq id and KV slot -1); `config` has `block_size`
    and `seqs_in(bucket)` (a GpuRunnerConfig).

    Returns (bucket, every sampled row greedy, number of sampled rows); sampled row r is entry order.
    Built as Python lists, then one numpy store per field: per-entry numpy calls cost more than the
    arithmetic at a few hundred sequences.
    """
    h, bs = bufs.h, config.block_size
    ids, pos, slots, seq_ids, q_start, ctx = [], [], [], [], [], []
    rows, temp, top_k, top_p, min_p, seeds, sample_pos = [], [], [], [], [], [], []
    all_greedy = True
    for i, entry in enumerate(batch.entries):
        seq, start, q_len = entry.seq, entry.seq.num_computed, entry.q_len
        table = seq.block_table
        q_start.append(len(ids))
        if q_len == 1:
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            seq_ids.append(i)
        else:
            span = range(start, start + q_len)
            ids += seq.token_ids[start: start + q_len]
            pos += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            seq_ids += [i] * q_len
        ctx.append(start + q_len)
        h["block_tables"][i, : len(table)] = table
        if entry.samples:
            spec = seq.spec
            rows.append(len(ids) - 1)
            temp.append(spec.temperature)
            top_k.append(spec.top_k)
            top_p.append(spec.top_p)
            min_p.append(spec.min_p)
            seeds.append(seq.rng_seed)
            sample_pos.append(len(seq.token_ids))
            all_greedy = all_greedy and (spec.temperature <= 0.0 or spec.top_k == 1)
    n, num_seqs, num_sampled = len(ids), len(batch.entries), len(rows)
    bucket = bucket_for(n, buckets)
    pad = bucket - n
    h["input_ids"][:bucket] = ids + [0] * pad
    h["positions"][:bucket] = pos + [0] * pad
    h["slot_mapping"][:bucket] = slots + [-1] * pad
    h["seq_ids"][:bucket] = seq_ids + [-1] * pad
    s = config.seqs_in(bucket)
    h["q_start"][: s + 1] = q_start + [n] * (s + 1 - num_seqs)
    h["ctx_lens"][:num_seqs] = ctx
    h["num_seqs"][0] = num_seqs
    h["sample_rows"][:s] = rows + [0] * (s - num_sampled)
    for name, values in (("temperature", temp), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                         ("sample_pos", sample_pos)):
        h[name][:num_sampled] = values
    h["seeds"].view(np.uint64)[:num_sampled] = seeds
    return bucket, all_greedy, num_sampled


def step_of(runner, batch: Batch) -> ScheduledStep:
    """Fill `runner.bufs` (a GpuRunner's) with a hand-built `batch` and describe it as the engine loop would."""
    bucket, greedy, num_sampled = fill_step(runner.bufs, batch, runner.config, runner.buckets)
    sampled = tuple(e.seq for e in batch.entries if e.samples)
    return ScheduledStep(bucket, batch.num_tokens, len(batch.entries), num_sampled, greedy, sampled)
