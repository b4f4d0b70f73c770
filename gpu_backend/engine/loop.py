"""The engine loop, the same in every host-driven mode: `schedule()` -> `runner.run()` -> `postprocess()`.

Between steps it takes new requests from the ring, honours cancels, and bumps the heartbeat. The model
side is a runner: `CpuRunner` (torch on the CPU, `engine/cpu_runner.py`) or `GpuRunner` (bucketed CUDA
graphs, `engine/gpu_runner.py`, the `host` mode). A runner has `num_blocks` and `run(batch) -> tokens`.
A runner with `sampling_extensions` set (both of these; not a GpuRunner built for the persistent loop)
applies penalties and logit bias and computes logprobs, and keeps `last_logprobs` of its last run (per
sampled entry, or empty when none asked); the loop refuses such requests (INVALID_PARAMS) for the others.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from gpu_backend.engine.scheduler import Batch, BlockManager, Finished, Scheduler, SchedulerConfig
from gpu_backend.models import ModelConfig
from protocols.ring import EngineState, ErrorCode, FinishReason, TokenLogprob
from protocols.shm_consumer import RingConsumer, TakenRequest

log = logging.getLogger("blink.engine")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derive from kv_cache_mb (cpu) or the free GPU memory (host)
    kv_cache_mb: int = 1024
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    idle_sleep_max_s: float = 0.002  # longest poll interval while idle (the first few polls spin shorter)

    def num_blocks_for(self, model_cfg: ModelConfig, context_len: int) -> int:
        """KV blocks of the cpu engine's float32 cache (the GPU runner sizes its own from free memory)."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = self.block_size * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 4
        blocks = self.kv_cache_mb * (1 << 20) // per_block
        return max(blocks, -(-context_len // self.block_size))  # at least one full-context sequence


class Runner(Protocol):
    num_blocks: int
    sampling_extensions: bool  # penalties, logit bias, logprobs; then also `last_logprobs`

    def run(self, batch: Batch) -> list[int]:
        """One token per entry with `samples`, in batch order."""


class EngineLoop:
    def __init__(self, runner: Runner, model_cfg: ModelConfig, consumer: RingConsumer,
                 config: EngineConfig, context_len: int):
        self.runner, self.model_cfg, self.consumer, self.config = runner, model_cfg, consumer, config
        self.blocks = BlockManager(runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, context_len,
                            tuple(model_cfg.eos_token_ids)),
            self.blocks,
        )
        self.extensions = runner.sampling_extensions  # penalties, logit bias, logprobs
        self.stop_event = threading.Event()
        self.failed: str | None = None  # the engines' common face: why the engine ended on its own (never, here)
        self.steps = 0

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
            tokens = self.runner.run(batch)
            sampling = [e.seq for e in batch.entries if e.samples]
            logprobs = self.runner.last_logprobs if self.extensions else ()
            self._postprocess(batch, {id(seq): tok for seq, tok in zip(sampling, tokens)},
                              {id(seq): lp for seq, lp in zip(sampling, logprobs) if lp is not None})
            self.steps += 1
        self._publish_stats()
        return bool(batch)

    def _admit(self, taken: list[TakenRequest]) -> None:
        for t in taken:
            error = self.scheduler.check(t.spec)
            if error is ErrorCode.NONE and t.spec.uses_sampling_extensions and not self.extensions:
                error = ErrorCode.INVALID_PARAMS
            if error is not ErrorCode.NONE:
                self.consumer.finish(t.slot, FinishReason.ERROR, error)
                continue
            seed = t.spec.seed if t.spec.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.scheduler.add(t.slot, t.seq, t.spec, seed)

    def _apply_cancels(self) -> None:
        for seq in self.scheduler.all_sequences():
            if self.consumer.cancelled(seq.slot, seq.seq):
                self._report(self.scheduler.finish(seq, FinishReason.CANCELLED))

    # ---- results -----------------------------------------------------------------------------------
    def _postprocess(self, batch: Batch, sampled: dict[int, int], logprobs: dict[int, TokenLogprob]) -> None:
        new_tokens, finished = self.scheduler.update(batch, sampled)
        now_ns = time.monotonic_ns()
        for seq, token in new_tokens:
            entry = logprobs.get(id(seq))
            self.consumer.publish(seq.slot, [token], now_ns, None if entry is None else [entry])
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
