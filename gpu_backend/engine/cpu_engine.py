"""The `cpu` engine: torch on the CPU behind the same ring and the same scheduler as the GPU engines.

One loop, three verbs (nano-vllm's shape): `schedule()` -> `run()` -> `postprocess()`. Between steps it
takes new requests from the ring, honours cancels, and bumps the heartbeat.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from gpu_backend.engine.sampler import SamplingRow, sample
from gpu_backend.engine.scheduler import Batch, BlockManager, Finished, Scheduler, SchedulerConfig, Sequence
from gpu_backend.models import AttnBatch, ModelConfig, allocate_kv_cache
from protocols.ring import EngineState, ErrorCode, FinishReason
from protocols.shm import RingConsumer, TakenRequest

log = logging.getLogger("blink.engine")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derive from kv_cache_mb
    kv_cache_mb: int = 1024
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    idle_sleep_max_s: float = 0.002  # longest poll interval while idle (the first few polls spin shorter)

    def num_blocks_for(self, model_cfg: ModelConfig, context_len: int) -> int:
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = self.block_size * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 4
        blocks = self.kv_cache_mb * (1 << 20) // per_block
        return max(blocks, -(-context_len // self.block_size))  # at least one full-context sequence


class CpuEngine:
    def __init__(self, model: torch.nn.Module, model_cfg: ModelConfig, consumer: RingConsumer,
                 config: EngineConfig, context_len: int):
        self.model, self.model_cfg, self.consumer, self.config = model, model_cfg, consumer, config
        num_blocks = config.num_blocks_for(model_cfg, context_len)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, context_len,
                            tuple(model_cfg.eos_token_ids)),
            self.blocks,
        )
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] float32, cpu
        self.kv_cache = allocate_kv_cache(model_cfg, num_blocks, config.block_size, torch.float32, "cpu")
        self.stop_event = threading.Event()
        self.steps = 0
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB)", num_blocks, config.block_size,
                 self.kv_cache.numel() * 4 / (1 << 20))

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        self.consumer.set_state(EngineState.SERVING)
        idle_s = 0.0
        while not self.stop_event.is_set():
            if self.step():
                idle_s = 0.0
                continue
            idle_s = min(max(idle_s * 2, 50e-6), self.config.idle_sleep_max_s)
            time.sleep(idle_s)
        self.shutdown()

    def step(self) -> bool:
        """One iteration: admit, cancel, schedule, run, postprocess. Returns whether a batch ran."""
        self.consumer.beat()
        self._admit(self.consumer.take_new())
        self._apply_cancels()
        batch = self.scheduler.schedule(room=lambda s: self.consumer.room(s.slot))
        if batch:
            sampled = self._run(batch)
            self._postprocess(batch, sampled)
            self.steps += 1
        self._publish_stats()
        return bool(batch)

    def _admit(self, taken: list[TakenRequest]) -> None:
        for t in taken:
            error = self.scheduler.check(t.spec)
            if error is not ErrorCode.NONE:
                self.consumer.finish(t.slot, FinishReason.ERROR, error)
                continue
            seed = t.spec.seed if t.spec.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.scheduler.add(t.slot, t.seq, t.spec, seed)

    def _apply_cancels(self) -> None:
        for seq in self.scheduler.all_sequences():
            if self.consumer.cancelled(seq.slot, seq.seq):
                self._report(self.scheduler.finish(seq, FinishReason.CANCELLED))

    # ---- model -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, batch: Batch) -> dict[int, int]:
        input_ids, positions, slots, sample_rows, rows = [], [], [], [], []
        bs = self.config.block_size
        for entry in batch.entries:
            seq, start = entry.seq, entry.seq.num_computed
            pos = range(start, start + entry.q_len)
            input_ids += seq.token_ids[start : start + entry.q_len]
            positions += pos
            slots += [seq.block_table[p // bs] * bs + p % bs for p in pos]
            if entry.samples:
                sample_rows.append(len(input_ids) - 1)
                rows.append(self._sampling_row(seq))
        attn = AttnBatch(
            q_lens=[e.q_len for e in batch.entries],
            ctx_lens=[e.seq.num_computed + e.q_len for e in batch.entries],
            block_tables=[e.seq.block_table for e in batch.entries],
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                            attn, self.kv_cache)
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])  # [n, V] float32
        tokens = sample(logits, rows)
        sampling = [e.seq for e in batch.entries if e.samples]
        return {id(seq): tok for seq, tok in zip(sampling, tokens)}

    @staticmethod
    def _sampling_row(seq: Sequence) -> SamplingRow:
        spec = seq.spec
        return SamplingRow(spec.temperature, spec.top_p, spec.top_k, spec.min_p, seq.rng_seed, len(seq.token_ids))

    # ---- results -----------------------------------------------------------------------------------
    def _postprocess(self, batch: Batch, sampled: dict[int, int]) -> None:
        new_tokens, finished = self.scheduler.update(batch, sampled)
        now_ns = time.monotonic_ns()
        for seq, token in new_tokens:
            self.consumer.publish(seq.slot, [token], now_ns)
        for done in finished:
            self._report(done)

    def _report(self, done: Finished) -> None:
        self.consumer.finish(done.seq.slot, done.reason, done.error)

    def _publish_stats(self) -> None:
        s = self.scheduler
        self.consumer.set_stats(self.blocks.num_free, self.blocks.num_blocks, len(s.running), len(s.waiting))

    def shutdown(self) -> None:
        """Report every unfinished request as failed (never dropped silently), then mark STOPPED."""
        self.consumer.set_state(EngineState.STOPPING)
        for t in self.consumer.take_new():
            self.consumer.finish(t.slot, FinishReason.ERROR, ErrorCode.ENGINE_STOPPING)
        for seq in self.scheduler.all_sequences():
            self._report(self.scheduler.finish(seq, FinishReason.ERROR, ErrorCode.ENGINE_STOPPING))
        self._publish_stats()
        self.consumer.set_state(EngineState.STOPPED)
