"""The `persistent` mode: one GPU-resident loop serves the ring; the host thread only watches it.

Set-up (host, once): the GpuRunner captures its bucket graphs; the scheduler state (`blink_sched.h`,
initialised by the host build, `sched_native.py`) is copied to device memory; the ring's shared memory is
registered with CUDA (pinned, mapped); `kernels/csrc/persistent_loop.cu` makes a graph of each bucket graph
with publish -> spec kernels beside it (the spec kernel schedules step n+1 while step n runs, into the
runner's second step buffer) and a take kernel after its logits, plus a full step's graph; each launches
the next from the GPU (device graph launch). The host launches the first one, once.

After the launch the host does nothing per request or per token. `run()` wakes once a second to
see whether the loop's stream ended (a CUDA error: the loop died) and whether its heartbeat is stale (the
control plane's Health reports STALLED on its own; this logs it too). `stop_event` (SIGTERM) sets the
loop's stop flag: the loop reports every request in flight as failed (ENGINE_STOPPING) and ends. Then the
host sweeps the ring so that nothing is left unanswered: requests queued after the loop's last look are
failed, and if the loop died, so is every slot it had not finished.

Penalties, logit bias and logprobs (`runner.sampling_extensions`): the loop keeps per-slot tables (copied
from the request at admission) and runs a step where some sampled row uses one through an extended branch
(the runner's LOGITS graph, the loop's adjust kernel, the runner's POST graph: with the logprobs only when a
row of the step asked for them); it publishes the logprobs
into the ring itself (kernels/csrc/include/blink_loop_ext.cuh). A runner built without them gives a loop
that refuses such requests with INVALID_PARAMS (the gateway refuses them first: Describe says so).
Token masks (constrained requests, ring version 3) take the same extended branch: the adjust kernel reads a
row's mask from the ring (a device read of mapped memory, checked by its mask_seq) and applies it; a row whose
mask has not come samples nothing (TOKEN_WAIT) and runs again; a step with such rows is not speculated past.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time

import numpy as np
import torch

from gpu_backend import env
from gpu_backend.engine.gpu_runner import LOOP_LOGPROBS, GpuRunner
from gpu_backend.engine.graph_variant import GraphVariant
from gpu_backend.engine.loop import EngineConfig, prefix_caching_on
from gpu_backend.engine.sched_native import NativeScheduler, SchedulerConfig, _Header
from gpu_backend.models import ModelConfig
from kernels import persistent_loop as native
from protocols import ring as R
from protocols.ring import EngineState, ErrorCode, FinishReason
from protocols.shm import ShmRing
from protocols.shm_consumer import RingConsumer

log = logging.getLogger("blink.persistent")


class LoopStatsLog:
    """BLINK_LOOP_STATS_S=N (a diagnostic, off by default): every N seconds the watcher logs what the loop's
    counters (mirrored to host memory every iteration; read here, off the loop's path) moved by: steps, tokens,
    the mean commit-to-commit time of back-to-back steps, the loop kernel's share, speculations taken and
    dropped. A serving benchmark reads the GPU's own step time from it (bench/device_structured.sh)."""

    def __init__(self, ctl: native.LoopCtl, period_s: float):
        self.ctl, self.period_s = ctl, period_s
        self.last, self.last_at = native.ctl_values(ctl), time.monotonic()

    @classmethod
    def from_env(cls, ctl: native.LoopCtl | None) -> LoopStatsLog | None:
        raw = env.get("LOOP_STATS_S") or ""
        try:
            period = float(raw) if raw else 0.0
        except ValueError:
            log.warning("BLINK_LOOP_STATS_S=%r is not a number of seconds: no loop statistics", raw)
            return None
        return cls(ctl, period) if period > 0 and ctl is not None else None

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_at < self.period_s:
            return
        cur = native.ctl_values(self.ctl)
        d = {k: cur[k] - self.last[k] for k in cur}
        self.last, self.last_at = cur, now
        if d["steps"] == 0:
            return
        busy = d["busy_steps"] or 1
        log.info("loop stats: %d steps, %d tokens, back-to-back step %.1f us (%d steps), loop kernel %.1f us a step, "
                 "speculation taken %d dropped %d, mask waits %d", d["steps"], d["tokens"], d["busy_ns"] / busy / 1e3,
                 d["busy_steps"], d["sched_ns"] / d["steps"] / 1e3, d["spec_hits"], d["spec_misses"], d["mask_waits"])


class PersistentEngine:
    """`run()` launches the loop and watches it until `stop_event` is set; `num_blocks` as the other engines."""

    def __init__(self, runner: GpuRunner, model_cfg: ModelConfig, ring: ShmRing, config: EngineConfig,
                 context_len: int, watch_interval_s: float = 1.0, stale_after_s: float = 2.0,
                 loop_options: native.LoopOptions | None = None, tp=None):
        """`loop_options`: how the loop is built (default: `LoopOptions.from_env()`, the product's unless a
        BLINK_LOOP_* variable says otherwise); options for measuring load the bench build of the library.
        `tp`: the runner when it is a `parallel.runner.TpRunner`: its followers' loops start before this one
        and stop after it, and a rank that fails stops the model."""
        if not runner.config.use_graphs or not runner.keep_graphs:
            raise ValueError("the persistent loop runs the runner's bucket graphs: build it with graphs kept")
        self.runner, self.ring, self.geometry, self.context_len = runner, ring, ring.geometry, context_len
        self.tp = tp
        self.vocab = model_cfg.vocab_size  # admission refuses prompt ids past it (blink_admit.h)
        self.watch_interval_s, self.stale_after_s = watch_interval_s, stale_after_s
        self.loop_options = native.LoopOptions.from_env() if loop_options is None else loop_options
        self.lib = native.load(bench=self.loop_options.needs_bench_build)
        self.num_blocks = runner.num_blocks
        g, dev, rc = ring.geometry, runner.device, runner.config
        sched = NativeScheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, context_len,
                            tuple(model_cfg.eos_token_ids), prefix_caching_on(config, g.kv_block_size)),
            runner.num_blocks, rc.block_size, g.num_slots, g.max_stop_ids, runner.step_geometry)
        self.sched_state = torch.from_numpy(sched.state.view(np.uint8)).to(dev)
        n = g.num_slots
        self._scratch = dict(
            sampled32=torch.zeros(rc.max_num_seqs, dtype=torch.int32, device=dev),
            slot_seq=torch.zeros(n, dtype=torch.int64, device=dev),
            slot_produced=torch.zeros(n, dtype=torch.int32, device=dev),
            room=torch.zeros(n, dtype=torch.int32, device=dev),
            order=torch.zeros(n, dtype=torch.int32, device=dev),
            cancel=torch.zeros(n, dtype=torch.uint8, device=dev),
            par=torch.zeros(5 * n, dtype=torch.int32, device=dev))
        self._ext = self._ext_tables(g) if runner.sampling_extensions else None
        self.stop_event = threading.Event()
        self.ctl: native.LoopCtl | None = None
        self.failed: str | None = None
        self.final_ctl: dict[str, int] = {}
        self._loop = ctypes.c_void_p()
        self._registered = False
        self.smem_bytes = 0
        self.take_linked = 0  # bucket graphs whose take kernel starts after the logits (all, normally)

    # ---- set-up ------------------------------------------------------------------------------------
    def _ext_tables(self, g: R.RingGeometry) -> dict[str, torch.Tensor]:
        """The sampling extensions' device tables (blink_loop_ext): per slot, per step buffer."""
        if self.runner.loop_logprobs is None:
            raise ValueError("sampling extensions in the persistent loop need the runner's POST graphs "
                             "(GpuRunner(..., keep_graphs=True) with sampling_extensions)")
        if g.max_logprobs > LOOP_LOGPROBS:
            raise ValueError(f"ring max_logprobs {g.max_logprobs} is over the {LOOP_LOGPROBS} the loop computes")
        n, s, dev = g.num_slots, self.runner.config.max_num_seqs, self.runner.device
        i32, f32 = torch.int32, torch.float32
        return dict(flags=torch.zeros(n, dtype=i32, device=dev), num_logprobs=torch.zeros(n, dtype=i32, device=dev),
                    prompt_len=torch.zeros(n, dtype=i32, device=dev), num_bias=torch.zeros(n, dtype=i32, device=dev),
                    capacity=torch.zeros(n, dtype=i32, device=dev), penalties=torch.zeros(n, 3, dtype=f32, device=dev),
                    bias_ids=torch.zeros(n, g.max_logit_bias, dtype=i32, device=dev),
                    bias_vals=torch.zeros(n, g.max_logit_bias, dtype=f32, device=dev),
                    row_slot=torch.full((2, s), -1, dtype=i32, device=dev),
                    slot_row=torch.zeros(2, n, dtype=i32, device=dev),
                    mask_state=torch.zeros(2, s, dtype=i32, device=dev))

    def _ext_args(self) -> int:
        """blink_loop_ext in device memory (kept in self._ext); returns its address."""
        g, runner, t = self.geometry, self.runner, self._ext
        # the extended branches' POST graphs, in their order: with the logprobs, then without (blink_loop_ext.cuh)
        posts = [runner.set_graphs[b][(bucket, GraphVariant.post(greedy, logprobs))].raw_cuda_graph()
                 for logprobs in (True, False) for b in range(2) for bucket in runner.buckets for greedy in (False, True)]
        self._post_array = (ctypes.c_void_p * len(posts))(*posts)  # read by blink_loop_create, on the host
        lp, offs = runner.loop_logprobs, runner.buffer_sets[0].offsets
        ext = native.LoopExt(
            logits=runner.logits_dev.data_ptr(), scratch=runner.ext_scratch.data_ptr(),
            lp_chosen=lp["chosen"].data_ptr(), lp_ids=lp["ids"].data_ptr(), lp_vals=lp["vals"].data_ptr(),
            post_graphs=ctypes.addressof(self._post_array), **{name: v.data_ptr() for name, v in t.items()},
            bias_offset=g.logit_bias_offset, bias_bytes=g.logit_bias_bytes, lp_offset=g.logprobs_offset,
            lp_bytes=g.logprob_bytes, lp_ids_offset=g.logprob_top_ids_offset, lp_top_offset=g.logprob_top_offset,
            off_sample_rows=offs["sample_rows"][0], off_seq_ids=offs["seq_ids"][0],
            off_sample_pos=offs["sample_pos"][0], vocab=runner.logits_dev.shape[1], max_rows=runner.config.max_num_seqs,
            lp_k=LOOP_LOGPROBS, max_bias=g.max_logit_bias, window=g.logprob_window, max_logprobs=g.max_logprobs,
            num_buckets=len(runner.buckets), context_len=self.context_len, masks_offset=g.masks_offset,
            mask_bytes=g.mask_bytes, mask_seq_offset=g.mask_seq_offset, mask_words=g.mask_words)
        raw = bytes(ext)
        t["struct"] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(runner.device)
        return t["struct"].data_ptr()

    def _register_ring(self) -> int:
        host = self.ring.buf.ctypes.data
        nbytes = -(-self.geometry.total_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping's whole pages
        dev = ctypes.c_void_p()
        native.check(self.lib.blink_loop_register(host, nbytes, ctypes.byref(dev)), "cudaHostRegister(ring)")
        self._registered = True
        return dev.value

    def _clock_offset_ns(self) -> int:
        """CLOCK_MONOTONIC minus the GPU's %globaltimer, from the tightest of a few bracketed reads."""
        best = None
        for _ in range(5):
            gt = ctypes.c_uint64()
            t0 = time.monotonic_ns()
            native.check(self.lib.blink_loop_read_globaltimer(ctypes.byref(gt)), "read %globaltimer")
            t1 = time.monotonic_ns()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) // 2 - gt.value)
        return best[1]

    def start(self) -> None:
        """Build the loop graph and launch it; returns at once (the loop runs until stopped)."""
        g, runner, hdr = self.geometry, self.runner, self.ring
        ctl_host, ctl_dev = ctypes.c_void_p(), ctypes.c_void_p()
        native.check(self.lib.blink_loop_alloc_ctl(ctypes.byref(ctl_host), ctypes.byref(ctl_dev)), "cudaHostAlloc(ctl)")
        self.ctl = native.LoopCtl.from_address(ctl_host.value)
        ring_dev = self._register_ring()
        sc = self._scratch
        # The loop's tuning knobs are not set from here yet: they are read inside kernels/csrc/persistent_loop.cu.
        # When kernels/persistent_loop.py takes an options struct, BackendConfig carries its fields (see the
        # note in gpu_backend/config.py) and this is where they are handed to blink_loop_create.
        args = native.LoopArgs(
            ring=ring_dev, sq_offset=g.sq_offset, requests_offset=g.requests_offset,
            responses_offset=g.responses_offset, request_bytes=g.request_bytes, response_bytes=g.response_bytes,
            prompt_offset=g.prompt_offset, num_slots=g.num_slots, max_prompt_len=g.max_prompt_len,
            max_output_len=g.max_output_len, max_stop_ids=g.max_stop_ids,
            bias_offset=g.logit_bias_offset, bias_bytes=g.logit_bias_bytes, max_logit_bias=g.max_logit_bias,
            max_logprobs=g.max_logprobs, vocab=self.vocab, hash_offset=g.block_hashes_offset,
            hash_bytes=g.block_hash_bytes, max_block_hashes=g.max_block_hashes,
            sched_mem=self.sched_state.data_ptr(), step_buf=runner.buffer_sets[0].dev.data_ptr(),
            step_buf_alt=runner.buffer_sets[1].dev.data_ptr(),
            sampled=runner.tokens_dev.data_ptr(), ctl=ctl_dev.value, clock_offset_ns=self._clock_offset_ns(),
            sq_head=int(hdr.header["sq_head"]), beats=hdr.heartbeat, generated=int(hdr.header["generated_tokens"]),
            **{name: t.data_ptr() for name, t in sc.items()})
        children = [graphs[(bucket, GraphVariant.sampling(greedy))].raw_cuda_graph()  # branch 2 * (buffer * buckets + i) + greedy
                    for graphs in runner.set_graphs for bucket in runner.buckets for greedy in (False, True)]
        if self._ext is not None:  # then the extended branches, 4 * buckets + a plain one's: LOGITS graph first;
            args.ext = self._ext_args()  # twice: their POST with the logprobs, then without (8 * buckets + ...)
            children += [graphs[(bucket, GraphVariant.LOGITS)].raw_cuda_graph() for _ in (True, False)
                         for graphs in runner.set_graphs for bucket in runner.buckets for _ in (False, True)]
        child_array = (ctypes.c_void_p * len(children))(*children)
        samplers = runner.sampler_graphs()  # same order: where each graph's logits are done
        sampler_array = (ctypes.c_void_p * len(samplers))(*[g.raw_cuda_graph() for g in samplers])
        torch.cuda.synchronize(runner.device)  # every set-up copy done before the loop reads its state
        t0 = time.perf_counter()
        options = self.loop_options.to_struct()
        native.check(self.lib.blink_loop_create(ctypes.byref(args), ctypes.byref(options), child_array, sampler_array,
                                                len(children), ctypes.byref(self._loop)), "building the loop graph")
        del samplers
        self.smem_bytes = self.lib.blink_loop_smem_bytes(self._loop)
        self.take_linked = self.lib.blink_loop_take_linked(self._loop)
        log.info("loop graphs: %d bucket graphs and the full step's, instantiated for device launch in %.2f s; scheduler "
                 "state in %s; the take kernel starts after the logits in %d of them", len(children),
                 time.perf_counter() - t0,
                 f"{self.smem_bytes} B of shared memory" if self.smem_bytes else "global memory (too many slots)",
                 self.take_linked)
        if self.take_linked < len(children):
            log.warning("%d bucket graphs do not end with their sampler's nodes: their take kernel waits from the "
                        "graph's start (one SM's block slot held for the whole step)", len(children) - self.take_linked)
        consumer = RingConsumer(self.ring)
        consumer.set_stats(self.num_blocks, self.num_blocks, 0, 0)  # the loop keeps free/running/waiting current
        consumer.set_state(EngineState.SERVING)
        if self.tp is not None:
            self.tp.start_followers()  # waiting for the leader's first announce
        native.check(self.lib.blink_loop_launch(self._loop), "launching the loop")

    # ---- the host's whole job while serving -----------------------------------------------------------
    def run(self) -> None:
        try:
            self.start()
            self._watch()
        finally:  # also when the set-up failed: whatever was queued is answered
            self.shutdown()

    def _watch(self) -> None:
        beat, beat_at, stale_logged = self.ring.heartbeat, time.monotonic(), False
        stats = LoopStatsLog.from_env(self.ctl)
        while not self.stop_event.wait(self.watch_interval_s):
            if stats is not None:
                stats.maybe_log()
            status = self.lib.blink_loop_poll(self._loop)
            if status != 1:
                self.failed = (f"the GPU loop ended on its own ({native.fault_message(self.ctl.error)})" if status == 0
                               else f"the GPU loop failed: cudaError {status}")
                log.error("%s; failing the requests in flight and stopping", self.failed)
                return
            if self.tp is not None and (error := self.tp.error()):
                self.failed = error
                log.error("%s; failing the requests in flight and stopping", error)
                return
            now, current = time.monotonic(), self.ring.heartbeat
            if current != beat:
                beat, beat_at, stale_logged = current, now, False
            elif now - beat_at > self.stale_after_s and not stale_logged:
                log.error("the GPU loop's heartbeat has not moved for %.1f s (Health reports STALLED)", now - beat_at)
                stale_logged = True

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the loop (it fails what is in flight), then make sure no request is left unanswered."""
        consumer = RingConsumer(self.ring)
        consumer.set_state(EngineState.STOPPING)
        running = self._loop.value is not None and self.lib.blink_loop_poll(self._loop) == 1
        if running:
            self.ctl.stop = 1
            deadline = time.monotonic() + timeout_s
            while (status := self.lib.blink_loop_poll(self._loop)) == 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            running = status == 1
            if status not in (0, 1):
                self.failed = f"the GPU loop failed while stopping: cudaError {status}"
        if self.tp is not None:
            self.tp.stop_followers()
        if self.ctl is not None:
            self.final_ctl = native.ctl_values(self.ctl)
        if running:
            log.error("the GPU loop did not stop within %.0f s; leaving it to the process exit", timeout_s)
        died = self.failed is not None
        self._sweep(consumer, died)
        consumer.set_state(EngineState.STOPPED)
        if running or died:  # still spinning, or the CUDA context is unusable: the process exit cleans up
            return
        if self._loop.value is not None:
            native.check(self.lib.blink_loop_destroy(self._loop), "destroying the loop")
            self._loop = ctypes.c_void_p()
        if self._registered:
            native.check(self.lib.blink_loop_unregister(self.ring.buf.ctypes.data), "cudaHostUnregister(ring)")
            self._registered = False

    def _sweep(self, consumer: RingConsumer, died: bool) -> None:
        """Fail what the loop never answered: requests queued after its last look, and, if it died, every
        slot whose response still belongs to its request and has no finish reason."""
        ring = self.ring
        if died:
            for slot in range(self.geometry.num_slots):
                seq, resp = int(ring.request_fields(slot)["seq"]), ring.response_fields(slot)
                if seq and int(resp["seq"]) == seq and int(resp["finish_reason"]) == FinishReason.NONE:
                    consumer.finish(slot, FinishReason.ERROR, ErrorCode.INTERNAL)
        for taken in consumer.take_new():
            consumer.finish(taken.slot, FinishReason.ERROR, ErrorCode.ENGINE_STOPPING)

    # ---- for tests and benchmarks (after the loop ended) -----------------------------------------------
    def scheduler_header(self) -> _Header:
        """The device scheduler's header (free blocks, running, waiting), copied back to the host."""
        host = self.sched_state[: ctypes.sizeof(_Header)].cpu().numpy().copy()
        return _Header.from_buffer_copy(host.tobytes())
