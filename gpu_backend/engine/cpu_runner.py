"""The `cpu` engine's model runner: torch on the CPU, float32, over the paged KV cache.

A runner turns one scheduled `Batch` into one sampled token per sampling entry; the loop
(`engine/loop.py`) is the same for every mode. Planning happens here, per step, on the host: that is
fine on the CPU, and exactly what the GPU runners must not do.
"""
from __future__ import annotations

import torch

from gpu_backend.engine.sampler import PromptCache, sample_step
from gpu_backend.engine.scheduler import Batch
from gpu_backend.models import AttnBatch, ModelConfig, allocate_kv_cache
from protocols.ring import TokenLogprob


class CpuRunner:
    sampling_extensions = True  # penalties, logit bias and logprobs (engine/sampler.py)

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, num_blocks: int, block_size: int):
        self.model, self.block_size, self.num_blocks = model, block_size, num_blocks
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] float32, cpu
        self.kv_cache = allocate_kv_cache(model_cfg, num_blocks, block_size, torch.float32, "cpu")
        self.last_logprobs: list[TokenLogprob | None] = []  # of the last `run`, in its token order
        self._prompts = PromptCache()

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        """Tokens sampled for the entries with `samples`, in batch order."""
        input_ids, positions, slots, sample_rows, sampled = [], [], [], [], []
        bs = self.block_size
        for entry in batch.entries:
            seq, start = entry.seq, entry.seq.num_computed
            pos = range(start, start + entry.q_len)
            input_ids += seq.token_ids[start : start + entry.q_len]
            positions += pos
            slots += [seq.block_table[p // bs] * bs + p % bs for p in pos]
            if entry.samples:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        attn = AttnBatch(
            q_lens=[e.q_len for e in batch.entries],
            ctx_lens=[e.seq.num_computed + e.q_len for e in batch.entries],
            block_tables=[e.seq.block_table for e in batch.entries],
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                            attn, self.kv_cache)
        self.last_logprobs = []
        if not sample_rows:
            return []
        logits = self.model.compute_logits(hidden[sample_rows])  # [n, V] float32
        tokens, self.last_logprobs = sample_step(logits, self._prompts.rows(sampled))
        return tokens
