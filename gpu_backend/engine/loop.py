"""The engine loop, the same in every host-driven mode: `schedule()` -> `runner.run()` -> `postprocess()`.

The scheduler is the native one (`engine/sched_native.py`: the C++ step the GPU-resident loop runs, built
for the host), and it fills the runner's step buffer with the one C fill. Between steps the loop takes new
requests from the ring, honours cancels, and bumps the heartbeat. The model side is a runner: `CpuRunner`
(torch on the CPU, `engine/cpu_runner.py`) or `GpuRunner` (bucketed CUDA graphs, `engine/gpu_runner.py`,
the `host` mode). A runner has `num_blocks`, `bufs` (its `StepBuffers`), `step_geometry`, and
`run(step) -> tokens`. A runner with `sampling_extensions` set (both of these; not a GpuRunner built for the
persistent loop) applies penalties and logit bias and token masks and computes logprobs, and keeps
`last_logprobs` of its last run (per sampled row, or empty when none asked); the loop refuses such requests
(INVALID_PARAMS) for the others. A constrained row's "token" may be TOKEN_WAIT (its mask had not come: the
scheduler runs that position again, nothing is published) or TOKEN_MASK_EMPTY (ERROR, INVALID_PARAMS).

Prefix caching (on unless `EngineConfig.enable_prefix_caching` is off): the scheduler starts a request on the
cached blocks named by its block hashes, so its prefill begins at the cached offset (chunked prefill over
earlier KV in blocks, which every runner supports); the loop reports the skipped tokens as the response's
cached_tokens before its first token, and the cache's counters in the header.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpu_backend.engine.sched_native import NativeScheduler, SchedulerConfig, StepGeometry, admit_limits
from gpu_backend.engine.step_buffers import ScheduledStep, StepBuffers
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
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt blocks (the requests' block hashes)

    def num_blocks_for(self, model_cfg: ModelConfig, context_len: int) -> int:
        """KV blocks of the cpu engine's float32 cache (the GPU runner sizes its own from free memory)."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = self.block_size * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 4
        blocks = self.kv_cache_mb * (1 << 20) // per_block
        return max(blocks, -(-context_len // self.block_size))  # at least one full-context sequence


def prefix_caching_on(config: EngineConfig, kv_block_size: int) -> bool:
    """Whether the scheduler caches: asked for, and the ring's block hashes cover the engine's blocks (a ring
    made for another block size names other token spans: its hashes are ignored, with a warning)."""
    if config.enable_prefix_caching and kv_block_size != config.block_size:
        log.warning("prefix caching off: the ring's kv_block_size %d is not the engine's block size %d",
                    kv_block_size, config.block_size)
        return False
    return config.enable_prefix_caching


class Runner(Protocol):
    num_blocks: int
    sampling_extensions: bool  # penalties, logit bias, logprobs; then also `last_logprobs`
    bufs: StepBuffers  # the step buffer the loop fills before `run`
    step_geometry: StepGeometry

    def run(self, step: ScheduledStep) -> list[int]:
        """One token per sampled row, in row order."""


class LiveSeq:
    """A request the scheduler holds, by ring slot; its tokens are read from the native state."""

    __slots__ = ("slot", "seq", "spec", "rng_seed", "prompt_len", "_sched", "_consumer", "published")

    def __init__(self, taken: TakenRequest, rng_seed: int, sched: NativeScheduler, consumer: RingConsumer):
        self.slot, self.seq, self.spec, self.rng_seed = taken.slot, taken.seq, taken.spec, rng_seed
        self.prompt_len, self._sched, self._consumer = len(taken.spec.prompt_ids), sched, consumer
        self.published = False  # a token of it reached the ring (cached_tokens is written before the first)

    @property
    def token_ids(self) -> np.ndarray:
        return self._sched.tokens(self.slot)  # [num_tokens] int32 view of the live state

    def token_mask(self) -> np.ndarray | None:
        """The ring's mask for the token sampled now (generated token i: mask_seq must be i + 1), or None."""
        return self._consumer.mask(self.slot, int(self._sched.a["num_tokens"][self.slot]) - self.prompt_len)


class EngineLoop:
    def __init__(self, runner: Runner, model_cfg: ModelConfig, consumer: RingConsumer,
                 config: EngineConfig, context_len: int):
        self.runner, self.model_cfg, self.consumer, self.config = runner, model_cfg, consumer, config
        geometry = consumer.ring.geometry
        step = runner.step_geometry
        if config.max_num_batched_tokens > step.buckets[-1]:
            raise ValueError(f"max_num_batched_tokens {config.max_num_batched_tokens} is over the runner's "
                             f"largest bucket {step.buckets[-1]}")
        if min(config.max_num_seqs, config.max_num_batched_tokens) > step.max_seqs:  # a step's entries at most
            raise ValueError(f"max_num_seqs {config.max_num_seqs} is over the runner's {step.max_seqs} sequence rows")
        self.scheduler = NativeScheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, context_len,
                            tuple(model_cfg.eos_token_ids), prefix_caching_on(config, geometry.kv_block_size)),
            runner.num_blocks, config.block_size, geometry.num_slots, geometry.max_stop_ids, step)
        if self.scheduler.step_bytes > runner.bufs.num_bytes:
            raise ValueError(f"the runner's step buffer ({runner.bufs.num_bytes} bytes) is smaller than the "
                             f"scheduler's layout ({self.scheduler.step_bytes}): context_len or block_size differ")
        self.live: dict[int, LiveSeq] = {}  # slot -> request, waiting or running
        self._room = np.zeros(geometry.num_slots, dtype=np.int32)  # [slots] int32, host
        self.extensions = runner.sampling_extensions  # penalties, logit bias, logprobs
        self._limits = admit_limits(geometry, model_cfg.vocab_size)
        self.stop_event = threading.Event()
        self.failed: str | None = None  # the engines' common face: why the engine ended on its own
        self.steps = 0

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        self.consumer.set_state(EngineState.SERVING)
        idle_s = 0.0
        try:
            while not self.stop_event.is_set():
                if self.step():
                    idle_s = 0.0
                    continue
                idle_s = min(max(idle_s * 2, 50e-6), self.config.idle_sleep_max_s)
                time.sleep(idle_s)
        except RuntimeError as exc:  # the runner's GPU failed (a tensor-parallel rank died): nothing more runs
            self.failed = str(exc)
            log.error("%s; failing the requests in flight and stopping", exc)
        self.shutdown()

    def step(self) -> bool:
        """One iteration: admit, cancel, schedule, run, postprocess. Returns whether a batch ran."""
        self.consumer.beat()
        self._admit(self.consumer.take_new())
        self._apply_cancels()
        step = self._schedule()
        if step is not None:
            tokens = self.runner.run(step)
            logprobs = self.runner.last_logprobs if self.extensions else ()
            self._postprocess(tokens, {s.slot: lp for s, lp in zip(step.sampled, logprobs) if lp is not None})
            self.steps += 1
        self._publish_stats()
        return step is not None

    def _admit(self, taken: list[TakenRequest]) -> None:
        for t in taken:
            if t.slot in self.live:  # the producer reused a live slot: its response area is the new request's now
                log.warning("slot %d resubmitted while its request %d ran; that request is dropped", t.slot,
                            self.live[t.slot].seq)
                self.scheduler.finish(t.slot)
                del self.live[t.slot]
            error = self._admission_error(t)
            if error is not ErrorCode.NONE:
                self.consumer.finish(t.slot, FinishReason.ERROR, error)
                continue
            seed = t.spec.seed if t.spec.seed is not None else int.from_bytes(os.urandom(8), "little")
            self.scheduler.add(t.slot, t.spec, seed)
            self.live[t.slot] = LiveSeq(t, seed, self.scheduler, self.consumer)

    def _admission_error(self, taken: TakenRequest) -> ErrorCode:
        """Every field the engine will use, checked before use: the ring is written by another process (or,
        over RDMA, another machine), so nothing the gateway validated is taken on trust here. The GPU loop's
        check (blink_admit.h), built for the host: every mode decides alike."""
        return self.scheduler.admission_error(self._limits, taken.words, taken.spec, self.extensions)

    def _apply_cancels(self) -> None:
        for slot, live in list(self.live.items()):
            if self.consumer.cancelled(slot, live.seq):
                self._finish(slot, FinishReason.CANCELLED)

    def _schedule(self) -> ScheduledStep | None:
        """Choose the step and fill the runner's step buffer with it; None when nothing can run."""
        room = self._room
        for slot in self.live:
            room[slot] = self.consumer.room(slot)
        entries = self.scheduler.schedule(room)
        if not entries:
            return None
        bucket = self.scheduler.fill(self.runner.bufs.host_bytes)
        h = self.scheduler.h
        sampled = tuple(self.live[e.slot] for e in entries if e.samples)
        return ScheduledStep(bucket, h.num_tokens, len(entries), h.num_sampled, bool(h.all_greedy), sampled)

    # ---- results -----------------------------------------------------------------------------------
    def _postprocess(self, tokens: list[int], logprobs: dict[int, TokenLogprob]) -> None:
        new_tokens, finished = self.scheduler.update(tokens)
        now_ns = time.monotonic_ns()
        for slot, token in new_tokens:
            entry = logprobs.get(slot)
            live = self.live[slot]
            if not live.published:
                self.consumer.set_cached_tokens(slot, self.scheduler.cached_tokens(slot))
                live.published = True
            self.consumer.publish(slot, [token], now_ns, None if entry is None else [entry])
        for slot, reason in finished:  # their blocks are already free
            del self.live[slot]
            # the one error a step ends a request with: a token mask that allowed nothing
            error = ErrorCode.INVALID_PARAMS if reason is FinishReason.ERROR else ErrorCode.NONE
            self.consumer.finish(slot, reason, error)

    def _finish(self, slot: int, reason: FinishReason, error: ErrorCode = ErrorCode.NONE) -> None:
        """End the request in `slot` now (cancel, shutdown): its blocks are freed, the ring is told."""
        self.scheduler.finish(slot)
        del self.live[slot]
        self.consumer.finish(slot, reason, error)

    def _publish_stats(self) -> None:
        s = self.scheduler  # evictable cached blocks count as free: an allocation takes them
        self.consumer.set_stats(s.num_available, s.num_blocks, s.num_running, s.num_waiting, s.prefix_cache_stats())

    def shutdown(self) -> None:
        """Report every unfinished request as failed (never dropped silently), then mark STOPPED."""
        self.consumer.set_state(EngineState.STOPPING)
        for t in self.consumer.take_new():
            self.consumer.finish(t.slot, FinishReason.ERROR, ErrorCode.ENGINE_STOPPING)
        for slot in list(self.live):
            self._finish(slot, FinishReason.ERROR, ErrorCode.ENGINE_STOPPING)
        self._publish_stats()
        self.consumer.set_state(EngineState.STOPPED)
