"""The step buffer the bucket graphs read, and how a host-scheduled step fills it (`fill_step`).

One step's inputs live in one fixed byte buffer (`StepBuffers`), pinned on the host and mirrored on the
device, so that a graph captured over it serves every batch of its bucket. The GPU-resident loop fills the
device copy itself with the same layout (declared once in kernels/step_decl.py; `blink_step_layout` in
kernels/csrc/include/blink_sched.h).
No device work here beyond allocating the two copies.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_backend.engine.scheduler import Batch
from kernels.step_layout import STEP_ALIGN, STEP_ARRAYS
from protocols.layout.views import carve

if TYPE_CHECKING:
    from gpu_backend.engine.gpu_runner import GpuRunnerConfig


_TORCH_DTYPES = {"<i4": torch.int32, "<i8": torch.int64, "<f4": torch.float32}


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

    Fields (T = max tokens, S = max sequences, MB = blocks per sequence): kernels/step_decl.py, in an
    order such that a step copies only the prefix it uses (the block tables come last, copied for the
    live rows only).
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        # the arrays of kernels/step_decl.py (the C fill's layout too), placed by the same rule
        placed, self.num_bytes = carve(STEP_ARRAYS, {"T": max_tokens, "S": max_seqs, "MB": max_blocks}, STEP_ALIGN)
        self.offsets: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {
            name: (off, _TORCH_DTYPES[dtype.str], shape) for name, (off, dtype, shape) in placed.items()}
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
