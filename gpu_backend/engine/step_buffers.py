"""The step buffer the bucket graphs read, and how a host-scheduled step fills it (`fill_step`).

One step's inputs live in one fixed byte buffer (`StepBuffers`), pinned on the host and mirrored on the
device, so that a graph captured over it serves every batch of its bucket. The GPU-resident loop fills the
device copy itself with the same layout (`blink_step_layout` in kernels/csrc/include/blink_sched.h).
No device work here beyond allocating the two copies.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_backend.engine.scheduler import Batch

if TYPE_CHECKING:
    from gpu_backend.engine.gpu_runner import GpuRunnerConfig


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `max_tokens` (the last bucket need not be a power of two)."""
    out, n = [], 1
    while n < max_tokens:
        out.append(n)
        n *= 2
    return (*out, max_tokens)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= num_tokens:
            return b
    raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")


class StepBuffers:
    """One step's inputs as a single byte buffer, pinned on the host and mirrored on the device.

    Fields (T = max tokens, S = max sequences, MB = blocks per sequence), in this order so that a step
    copies only the prefix it uses (the block tables come last, copied for the live rows only):
      input_ids [T] i32, positions [T] i64, slot_mapping [T] i64 (-1: padding), seq_ids [T] i32 (-1),
      sample_rows [S] i64, temperature [S] f32, top_k [S] i32, top_p [S] f32, min_p [S] f32,
      seeds [S] i64, sample_pos [S] i64, q_start [S+1] i32, ctx_lens [S] i32, num_seqs [1] i32,
      block_tables [S, MB] i32.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        t, s = max_tokens, max_seqs
        spec = [("input_ids", torch.int32, (t,)), ("positions", torch.int64, (t,)),
                ("slot_mapping", torch.int64, (t,)), ("seq_ids", torch.int32, (t,)),
                ("sample_rows", torch.int64, (s,)), ("temperature", torch.float32, (s,)),
                ("top_k", torch.int32, (s,)), ("top_p", torch.float32, (s,)), ("min_p", torch.float32, (s,)),
                ("seeds", torch.int64, (s,)), ("sample_pos", torch.int64, (s,)),
                ("q_start", torch.int32, (s + 1,)), ("ctx_lens", torch.int32, (s,)),
                ("num_seqs", torch.int32, (1,)), ("block_tables", torch.int32, (s, max_blocks))]
        self.offsets: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        off = 0
        for name, dtype, shape in spec:
            off = -(-off // 8) * 8
            self.offsets[name] = (off, dtype, shape)
            off += int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        self.num_bytes = -(-off // 8) * 8
        self.max_blocks = max_blocks
        self.host = torch.zeros(self.num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
        self.h = {n: self._np(n) for n in self.offsets}           # numpy views of the pinned buffer
        self.d = {n: self._view(self.dev, n) for n in self.offsets}  # device views the graphs read

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        off, dtype, shape = self.offsets[name]
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return buf[off: off + size].view(dtype).view(shape)

    def _np(self, name: str) -> np.ndarray:
        return self._view(self.host, name).numpy()

    def upload(self, num_seqs: int) -> None:
        """Copy the used prefix (block tables of `num_seqs` rows) to the device, asynchronously."""
        end = self.offsets["block_tables"][0] + 4 * num_seqs * self.max_blocks
        self.dev[:end].copy_(self.host[:end], non_blocking=True)


def fill_step(bufs: StepBuffers, batch: Batch, config: GpuRunnerConfig, buckets: tuple[int, ...]) -> tuple[int, bool, int]:
    """Write `batch` into the pinned buffer (padding rows: seq id and KV slot -1).

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
