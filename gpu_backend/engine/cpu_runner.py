"""The `cpu` engine's model runner: torch on the CPU, float32, over the paged KV cache.

A runner turns one scheduled step into one sampled token per sampled row; the loop (`engine/loop.py`) is
the same for every mode, and so is the step: the scheduler's C fill writes it into this runner's step
buffer (`StepBuffers`, host memory only here), the very layout the GPU runner's graphs read. So is the
model: `models/llama_forward.decoder_layers`, here with the torch ops. Attention's plan is built here, per
step, on the host: fine on the CPU, and exactly what the GPU runners must not do.
"""
from __future__ import annotations

import numpy as np
import torch

from gpu_backend.engine.sampler import PromptCache, sample_step
from gpu_backend.engine.sched_native import StepGeometry
from gpu_backend.engine.step_buffers import ScheduledStep, StepBuffers, token_buckets
from gpu_backend.models import AttnBatch, ModelConfig, allocate_kv_cache
from gpu_backend.models.llama_forward import decoder_layers, lm_head_logits
from gpu_backend.models.torch_ops import TorchOps
from protocols.ring import TokenLogprob


class CpuRunner:
    sampling_extensions = True  # penalties, logit bias and logprobs (engine/sampler.py)

    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, num_blocks: int, block_size: int, *,
                 context_len: int, max_num_batched_tokens: int, max_num_seqs: int):
        self.model, self.cfg, self.block_size, self.num_blocks = model, model_cfg, block_size, num_blocks
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] float32, cpu
        self.kv_cache = allocate_kv_cache(model_cfg, num_blocks, block_size, torch.float32, "cpu")
        max_seqs = min(max_num_seqs, max_num_batched_tokens)  # a sequence feeds at least one token a step
        self.step_geometry = StepGeometry(max_num_batched_tokens, max_seqs, token_buckets(max_num_batched_tokens))
        self.bufs = StepBuffers(max_num_batched_tokens, max_seqs, -(-context_len // block_size), torch.device("cpu"))
        self.last_logprobs: list[TokenLogprob | None] = []  # of the last `run`, in its row order
        self._prompts = PromptCache()

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> list[int]:
        """Tokens sampled for the step's sampled rows, in row order."""
        h, n, w = self.bufs.h, step.num_tokens, self.model.decoder_weights()
        ops = TorchOps(self._attn_batch(step), torch.from_numpy(h["positions"][:n]), self.model.rotary, self.kv_cache,
                       self.cfg.head_dim ** -0.5, w.embed.dtype)
        x, residual = decoder_layers(ops, w, self.cfg, torch.from_numpy(h["input_ids"][:n]).long())  # [n, hidden]
        self.last_logprobs = []
        if not step.num_sampled:
            return []
        rows = torch.from_numpy(h["sample_rows"][: step.num_sampled])
        logits = lm_head_logits(ops, w, self.cfg, x[rows], residual[rows])  # [num_sampled, V] float32
        tokens, self.last_logprobs = sample_step(logits, self._prompts.rows(step.sampled))
        return tokens

    def _attn_batch(self, step: ScheduledStep) -> AttnBatch:
        h, s = self.bufs.h, step.num_seqs
        ctx_lens = h["ctx_lens"][:s].tolist()
        num_blocks = [-(-c // self.block_size) for c in ctx_lens]
        return AttnBatch(q_lens=np.diff(h["q_start"][: s + 1]).tolist(), ctx_lens=ctx_lens,
                         block_tables=[h["block_tables"][i, :nb].tolist() for i, nb in enumerate(num_blocks)],
                         slot_mapping=torch.from_numpy(h["slot_mapping"][: step.num_tokens]))
