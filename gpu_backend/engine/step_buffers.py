"""The step buffer every runner reads, and `ScheduledStep`, what a runner is told about one filled step.

One step's inputs live in one fixed byte buffer (`StepBuffers`), pinned on the host and mirrored on the
device, so that a graph captured over it serves every batch of its bucket. It is filled by the one C fill
(`blink_fill_*` in kernels/csrc/include/blink_sched.h): on the host by `NativeScheduler.fill` for the `cpu`
and `host` engines, on the device by the GPU-resident loop, with the one layout declared in
kernels/step_decl.py (generated: kernels/step_layout.py, blink_step_layout.h).
No device work here beyond allocating the two copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.step_layout import STEP_ALIGN, STEP_ARRAYS
from protocols.layout.views import carve

if TYPE_CHECKING:
    from gpu_backend.engine.sampler import SampledSeq


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
        # [num_bytes] uint8: what NativeScheduler.fill writes (a view of the pinned buffer)
        self.host_bytes = self.host.numpy()
        # a CPU runner reads the host buffer itself: no second copy
        self.dev = self.host if device.type == "cpu" else torch.zeros(self.num_bytes, dtype=torch.uint8, device=device)
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
        if self.dev is self.host:
            return
        end = self.offsets["block_tables"][0] + 4 * num_seqs * self.max_blocks
        self.dev[:end].copy_(self.host[:end], non_blocking=True)


@dataclass(frozen=True)
class ScheduledStep:
    """One step, already written into the runner's step buffer (`StepBuffers.host`) by the C fill.

    Token rows [0, num_tokens) are real, [num_tokens, bucket) padding; sequence rows [0, num_seqs) in entry
    order; sampled rows [0, num_sampled) in entry order, `sampled` naming their sequences (the sampler's
    extensions read their parameters and history)."""

    bucket: int
    num_tokens: int
    num_seqs: int
    num_sampled: int
    all_greedy: bool  # every sampled row is greedy: the argmax graph serves the step
    sampled: tuple[SampledSeq, ...]
