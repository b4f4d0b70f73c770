"""The GPU model runner: a Llama-family step over the paged KV cache in bf16, one CUDA graph per
token-count bucket. The one engine module that touches device memory.

Every dynamic quantity of a step lives in one fixed device buffer (`StepBuffers`): token ids,
positions, KV slots, per-sequence query offsets, context lengths, block tables, the rows to sample and
their sampling parameters. A graph captured over those buffers serves every batch of its bucket, so the
host's work per step is: fill the pinned twin of the buffer, one copy, one replay, one copy back. The
GPU-resident loop (`engine/persistent.py`) fills the same buffer from the device and launches the same
graphs as children of its own.

The model is the one forward both runners call (`models/llama_forward.decoder_layers`), here with the
Triton kernels over the step buffer (`engine/gpu_ops.TritonOps`). Per layer: fused residual add + RMSNorm
-> qkv GEMM -> [per-head q/k RMSNorm] -> RoPE fused with the KV-cache write -> paged attention (mixed
prefill/decode, one launch) -> o GEMM -> add + RMSNorm -> gate_up GEMM -> SwiGLU -> down GEMM, or in a
mixture-of-experts layer the router GEMM and kernels/moe.py's fused experts (routing never leaves the GPU). Then the final norm, the LM head over the
sampled rows only, and sampling (argmax for all-greedy steps; the full sampler otherwise: two graphs per
bucket, the host picks one). What each captured graph runs is its `GraphVariant` (engine/graph_variant.py).

The sampling extensions (logit bias, repetition/frequency/presence penalties, logprobs) take a third path,
only in steps where some sampled row asks for one: a third graph per bucket (`LOGITS`) stops at the LM
head and leaves float32 logits [S, V] in a static buffer; then, eagerly on the GPU, the bias and penalties
of the rows that have them (`sampler.LogitAdjustments`: (row, token id) index tensors built on the host
once per step while the graph runs, about 25 ns per history token of a repetition-penalized row, its prompt
kept as an array between steps by `sampler.PromptCache`), the same sampling kernels as the other two
graphs, and the logprobs (`sampler.token_logprobs`, one copy back).
Rows without extensions in such a step see the very logits and kernels of the plain path, so they get
its tokens; so does a seeded row whose extensions leave its logits as they are (logprobs only). Steps
without extensions run exactly as before. The third graph costs capture time (three graphs per bucket
instead of two: about half as much again), the static buffer (max_num_seqs x V x 4 bytes: 131 MB at 256
sequences and Llama 3's 128,256 tokens), almost no pool memory (the graphs share one pool and run one at
a time), and KV blocks for the eager part's temporaries, measured at start-up with every row using every
extension (`_extension_peak`); these are estimates from the shapes, `bench/gpu_extensions.py` measures
them and the step time. With `use_graphs=False` the LOGITS step runs eagerly like the others.
`GpuRunnerConfig.sampling_extensions=False` has none of this: no third graph, no buffer, no memory set aside
for the eager part (the engines then refuse such requests).

For the persistent loop (`keep_graphs`) the extensions run inside the loop's graph, with no host work: each
step buffer gets its LOGITS graphs and four more variants per bucket (POST_VARIANTS), `POST` and `POST_GREEDY`:
the plain path's sampler (or argmax) over the adjusted logits, then each row's logprobs (log-softmax and the best
LOOP_LOGPROBS alternatives) into that buffer's `loop_logprobs`; and the same two without the logprobs, for steps
where no row asked for them (token masks, penalties, a logit bias alone). The loop runs LOGITS -> its own adjust
kernel (kernels/csrc/include/blink_loop_ext.cuh, which reads `ext_scratch`) -> a POST. That costs more capture
(seven graphs per bucket and buffer instead of two; the POST ones are small), `ext_scratch` (another
max_num_seqs x V x 4 bytes) and the POST step's temporaries, measured at start-up like the eager part's.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from gpu_backend.engine.gpu_ops import TritonOps
from gpu_backend.engine.graph_variant import GraphVariant
from gpu_backend.engine.sampler import (LogitAdjustments, PromptCache, SampledSeq, SamplingRow, apply_masks,
                                        await_masks, token_logprobs, top_logprobs)
from gpu_backend.engine.sched_native import StepGeometry
from gpu_backend.engine.step_buffers import ScheduledStep, StepBuffers, token_buckets
from gpu_backend.models import ModelConfig, allocate_kv_cache
from gpu_backend.models.fp8 import release_dense_projections_
from gpu_backend.models.llama_forward import decoder_layers, fuse_weights, lm_head_logits
from gpu_backend.models.rope import rope_inv_freq
from kernels._common import pdl_step
from protocols.ring import TokenLogprob

log = logging.getLogger("blink.gpu_runner")

_GiB = 1 << 30
LOGITS, POST, POST_GREEDY = GraphVariant.LOGITS, GraphVariant.POST, GraphVariant.POST_GREEDY
# the persistent loop's POST graphs: with the logprobs, then the sampling alone (steps where no row asked for them)
POST_VARIANTS = tuple(GraphVariant.post(greedy, logprobs) for logprobs in (True, False) for greedy in (False, True))
LOOP_LOGPROBS = 20  # alternatives per row that POST computes (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class GpuRunnerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    block_size: int = 16
    context_len: int = 8192
    gpu_memory_fraction: float = 0.9
    num_kv_blocks: int = 0  # 0: size the cache from free memory and gpu_memory_fraction
    use_graphs: bool = True
    # penalties, logit bias, logprobs: a third graph per bucket, the logits buffer, memory for the eager part
    sampling_extensions: bool = True
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: e4m3, unscaled (vLLM's default scale 1.0)
    # a one-token step runs every projection through kernels/gemv.py (cuBLAS streams narrow matrices well under
    # the copy bandwidth), with the tile kernels/gemv.gemv_config picks by shape; here (name, (BLOCK_N, BLOCK_K,
    # num_warps)) pairs override it per projection (qkv, o, gate_up, down, lm_head, router) for experiments
    gemv_projections: tuple[tuple[str, tuple[int, int, int]], ...] = ()

    def __post_init__(self) -> None:
        if not 0.05 <= self.gpu_memory_fraction <= 0.99:
            raise ValueError(f"gpu_memory_fraction {self.gpu_memory_fraction} is outside 0.05..0.99")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("max_num_seqs must be <= max_num_batched_tokens (a sequence feeds >= 1 token)")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.context_len // self.block_size)

    def seqs_in(self, bucket: int) -> int:
        """Sequence rows of a bucket's graph: a step of T tokens holds at most T sequences."""
        return min(bucket, self.max_num_seqs)


class GpuRunner:
    """`run(batch)` -> sampled tokens; everything the GPU needs is allocated and captured in __init__."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, config: GpuRunnerConfig,
                 device: torch.device | str = "cuda", progress: bool = True, keep_graphs: bool = False,
                 tp=None):
        """`tp`: this rank's `kernels.tp_comm.RankComm` under tensor parallelism (gpu_backend/parallel/), with
        `cfg` the rank's shape. The leader (rank 0) runs the whole step and announces each step's buffer to
        the followers; a follower's graphs wait for it and run the decoder layers only (no head, no sampling,
        one graph per bucket and step buffer)."""
        from kernels import paged_attention, rmsnorm, sampling, swiglu  # triton: GPU hosts only

        from kernels import fp8_gemm, fp8_quant, gemv, moe, prefetch

        self._k = dict(attn=paged_attention.paged_attention, rmsnorm=rmsnorm.rmsnorm, gemv=gemv.gemv,
                       gemv_config=gemv.gemv_config, fp8_quant=fp8_quant.quantize_tokens,
                       fp8_w8a16=fp8_gemm.fp8_weight_only_mm,
                       add_rmsnorm=rmsnorm.add_rmsnorm,
                       swiglu=swiglu.swiglu, sample=sampling.sample, moe=moe.fused_moe,
                       moe_one_token=moe.moe_one_token, l2_prefetch=prefetch.l2_prefetch)
        self.tp, self.follower = tp, tp is not None and not tp.is_leader
        if self.follower:
            config = dataclasses.replace(config, sampling_extensions=False)
        self.cfg, self.config, self.device = cfg, config, torch.device(device)
        # keep each graph's cudaGraph_t (raw_cuda_graph()) for the persistent loop, which clones them; it
        # also needs a second step buffer with its own graphs (it fills step n+1 while step n runs)
        self.keep_graphs = keep_graphs
        self._gemv = dict(config.gemv_projections)
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the GPU runner needs bf16 or fp16 weights, got {self.dtype}")
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        self.weights = fuse_weights(model)  # q/k/v and gate/up fused; the model's Linear weights become views
        if getattr(model, "quantization", None):
            release_dense_projections_(model, self.weights)  # the FP8 copies are what the steps read
            torch.cuda.empty_cache()
        self.buckets = token_buckets(config.max_num_batched_tokens)
        self.buffer_sets = [StepBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                        config.max_blocks_per_seq, self.device) for _ in range(1 + keep_graphs)]
        self.bufs = self.buffer_sets[0]  # the step buffer run() fills and the graphs of `graphs` read
        freqs = torch.arange(config.context_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        self.cos = freqs.cos().to(self.device)                        # [context_len, D/2] float32
        self.sin = freqs.sin().to(self.device)
        self.tokens_dev = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.tokens_host = torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=True)
        self.sampling_extensions = config.sampling_extensions  # the engine loop admits such requests when set
        # [S, V] float32: the LOGITS graphs' output, adjusted in place by the extensions
        self.logits_dev = torch.zeros(config.max_num_seqs, cfg.vocab_size, dtype=torch.float32, device=self.device) \
            if self.sampling_extensions else None
        self.last_logprobs: list[TokenLogprob | None] = []  # of the last `run`; empty when no row asked
        loop_ext = self.sampling_extensions and keep_graphs
        # the persistent loop's: [S, V] int32 zeroed scratch of its adjust kernel; per step buffer, POST's
        # logprobs of each row's token [2, S] f32 and its best LOOP_LOGPROBS alternatives [2, S, K] (i32, f32)
        s, n = config.max_num_seqs, len(self.buffer_sets)
        self.ext_scratch = torch.zeros(s, cfg.vocab_size, dtype=torch.int32, device=self.device) if loop_ext else None
        self.loop_logprobs = dict(
            chosen=torch.zeros(n, s, dtype=torch.float32, device=self.device),
            ids=torch.zeros(n, s, LOOP_LOGPROBS, dtype=torch.int32, device=self.device),
            vals=torch.zeros(n, s, LOOP_LOGPROBS, dtype=torch.float32, device=self.device)) if loop_ext else None
        self._set = 0  # the step buffer (index into buffer_sets) that self.bufs is
        self._prompts = PromptCache()
        self._done = torch.cuda.Event()
        self._logits_done = torch.cuda.Event()  # a step's LOGITS part: the last chance for its token masks
        self.num_blocks = self._size_kv_cache()
        self.kv_cache = allocate_kv_cache(cfg, self.num_blocks, config.block_size, self.kv_dtype, self.device)
        self.graphs: dict[tuple[int, GraphVariant], torch.cuda.CUDAGraph] = {}
        self.set_graphs = [self.graphs] + [{} for _ in self.buffer_sets[1:]]  # graphs over each step buffer
        self.capture_s = self._capture(progress) if config.use_graphs else 0.0

    # ---- memory --------------------------------------------------------------------------------------
    @property
    def kv_block_bytes(self) -> int:
        c = self.cfg
        return self.config.block_size * c.num_layers * 2 * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize

    @torch.inference_mode()
    def _size_kv_cache(self) -> int:
        """Blocks that fit in gpu_memory_fraction of the card after weights and a max-bucket step."""
        need = self.config.max_blocks_per_seq
        if self.config.num_kv_blocks:
            return max(self.config.num_kv_blocks, need)
        probe = allocate_kv_cache(self.cfg, need, self.config.block_size, self.kv_dtype, self.device)
        self.kv_cache = probe
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        bucket, seqs = self.buckets[-1], self.config.seqs_in(self.buckets[-1])
        self._fill_dummy(bucket, seqs)
        self._step(bucket, GraphVariant.SAMPLE)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - probe.numel() * probe.element_size()
        if self.sampling_extensions:
            peak += self._extension_peak(bucket, seqs)
        del self.kv_cache, probe
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_now = torch.cuda.mem_get_info(self.device)[0]
        graph_reserve = _GiB // 2  # pool fragments across buckets, cuBLAS workspaces
        budget = min(int(total * self.config.gpu_memory_fraction) - peak - graph_reserve, free_now - graph_reserve)
        blocks = budget // self.kv_block_bytes
        if blocks < need:
            raise RuntimeError(f"KV cache: room for {max(blocks, 0)} blocks, one {self.config.context_len}-token "
                               f"sequence needs {need}; lower --context-len or raise --gpu-memory-fraction")
        log.info("KV cache: %d blocks of %d tokens, %.1f GiB (weights %.1f GiB, step peak %.2f GiB)", blocks,
                 self.config.block_size, blocks * self.kv_block_bytes / _GiB, self.weights.num_bytes / _GiB,
                 (peak - self.weights.num_bytes) / _GiB)
        return int(blocks)

    def _extension_peak(self, bucket: int, num_seqs: int) -> int:
        """Bytes the extensions' eager part needs for every row with every extension: it runs beside the
        graph pool, so it counts on top of a step's peak."""
        self._step(bucket, LOGITS)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._sample_extended(self.logits_dev[:num_seqs], False, _probe_rows(num_seqs, self.cfg.vocab_size))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        if self.loop_logprobs is not None:  # the loop's POST step instead
            torch.cuda.reset_peak_memory_stats(self.device)
            self._step(bucket, POST)
            torch.cuda.synchronize(self.device)
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - base)
        return peak

    # ---- the step ------------------------------------------------------------------------------------
    def _step(self, num_tokens: int, variant: GraphVariant) -> None:
        """The part of a model step for a bucket of `num_tokens` that `variant` names (what its graph
        captures): the whole step into tokens_dev (SAMPLE, GREEDY), the whole step up to the sampled rows'
        logits into logits_dev (LOGITS), or the part after them (POST, POST_GREEDY: the persistent loop's
        extended branch). Its kernels launch with programmatic dependent launch where `pdl_step` says."""
        with pdl_step(num_tokens):
            self._step_kernels(num_tokens, variant)

    def _step_kernels(self, num_tokens: int, variant: GraphVariant) -> None:
        s = self.config.seqs_in(num_tokens)
        if variant.is_post:
            greedy = variant in (POST_GREEDY, GraphVariant.POST_GREEDY_NO_LOGPROBS)
            self._post(s, greedy, logprobs=variant in (POST, POST_GREEDY))
            return
        if self.tp is not None:
            self._tp_start(num_tokens)
            if self.follower:  # the decoder layers only: the leader has the head
                decoder_layers(self._ops(num_tokens), self.weights, self.cfg, self.bufs.d["input_ids"][:num_tokens])
                return
        if variant is LOGITS:  # straight into logits_dev: a float32 copy of [s, V] less (~20 us at s = 64, H100)
            self._sampled_logits(num_tokens, out=self.logits_dev[:s])
        else:
            self._sample(self._sampled_logits(num_tokens), variant is GraphVariant.GREEDY)

    def _tp_start(self, num_tokens: int) -> None:
        """A tensor-parallel step's first kernel: the leader pushes the step buffer to the followers and
        announces it; a follower waits for that (kernels/tp_comm.py)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self.follower:
            self.tp.wait(stream)
        else:
            self.tp.announce(self._set, self.buckets.index(num_tokens), stream)

    def _sampled_logits(self, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer, then the head over the sampled rows: [seqs_in(num_tokens), V] float32 (into `out`)."""
        d, s = self.bufs.d, self.config.seqs_in(num_tokens)
        ops = self._ops(num_tokens)
        x, residual = decoder_layers(ops, self.weights, self.cfg, d["input_ids"][:num_tokens])
        rows = torch.index_select(x, 0, d["sample_rows"][:s])                 # [s, hidden], before the last add
        return lm_head_logits(ops, self.weights, self.cfg, rows, torch.index_select(residual, 0, d["sample_rows"][:s]),
                              out)

    def _sample(self, logits: torch.Tensor, greedy: bool) -> None:
        """[s, V] float32 -> tokens_dev[:s]: argmax when every row is greedy, else the full sampler."""
        d, s = self.bufs.d, logits.shape[0]
        if greedy:
            self.tokens_dev[:s].copy_(logits.argmax(dim=-1))
        else:
            self._k["sample"](logits, d["temperature"][:s], d["top_k"][:s], d["top_p"][:s], d["min_p"][:s],
                              d["seeds"][:s], d["sample_pos"][:s], out=self.tokens_dev[:s])

    def _post(self, s: int, greedy: bool, logprobs: bool = True) -> None:
        """The persistent loop's POST: sampling over the adjusted logits_dev[:s] as `_step_extended` does,
        then (`logprobs`) every row's logprobs as `token_logprobs` computes them, into loop_logprobs[this step
        buffer] (the loop publishes the rows that asked). Without them a step's POST is the sampler alone: the
        log-softmax and top-20 over [s, V] cost 0.12-0.28 ms a step on an H100 (bench/RESULTS.md)."""
        logits, temperature = self.logits_dev[:s], self.bufs.d["temperature"][:s]
        self._sample(logits, greedy)
        if not logprobs:
            return
        temps = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        lps = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)          # [s, V]
        out = {name: t[self._set] for name, t in self.loop_logprobs.items()}
        out["chosen"][:s].copy_(lps.gather(1, self.tokens_dev[:s].unsqueeze(1)).squeeze(1))
        vals, ids = top_logprobs(lps, LOOP_LOGPROBS)
        out["vals"][:s].copy_(vals)
        out["ids"][:s].copy_(ids)

    def _step_extended(self, num_tokens: int, greedy: bool,
                       sampled: tuple[SampledSeq, ...]) -> tuple[list[TokenLogprob | None], dict[int, int]]:
        """A step whose sampled rows (`sampled`, in order) include some with extensions: the LOGITS graph (or
        its eager twin), then, while it runs, their rows (a token mask not there yet is awaited until the logits
        are done: `sampler.await_masks`), then the extensions and sampling, eagerly. Writes tokens_dev; returns
        the logprobs
        and the rows that sample no token (`sampler.apply_masks`)."""
        if self.config.use_graphs:
            self.graphs[(num_tokens, LOGITS)].replay()
        else:
            self._step(num_tokens, LOGITS)
        self._logits_done.record()
        rows = await_masks(self._prompts.rows(sampled), sampled, self._logits_done.query)
        return self._sample_extended(self.logits_dev[:self.config.seqs_in(num_tokens)], greedy, rows)

    def _sample_extended(self, logits: torch.Tensor, greedy: bool,
                         rows: list[SamplingRow]) -> tuple[list[TokenLogprob | None], dict[int, int]]:
        """Bias and penalties, then token masks, in place on `logits` [s, V] (rows past len(rows): padding),
        the plain path's sampling, then the logprobs of the rows that ask."""
        adjustments = LogitAdjustments.build(rows, logits.shape[1], self.device)  # host work while the GPU runs
        if adjustments is not None:
            adjustments.apply_(logits)
        _, no_token = apply_masks(logits, rows, inplace=True)
        self._sample(logits, greedy)
        return token_logprobs(logits, rows, self.tokens_dev[:len(rows)]), no_token

    def _ops(self, num_tokens: int) -> TritonOps:
        """The Triton kernels bound to the current step buffer for a bucket of `num_tokens`."""
        c = self.cfg
        attn_out = torch.empty((num_tokens, c.num_heads, c.head_dim), dtype=self.dtype, device=self.device)
        return TritonOps(self._k, self.bufs.d, num_tokens, self.config.seqs_in(num_tokens), (self.cos, self.sin),
                         self.kv_cache, attn_out, c.head_dim ** -0.5, self._gemv, tp=self.tp)

    @torch.inference_mode()
    def _capture(self, progress: bool) -> float:
        """Capture (bucket, SAMPLE/GREEDY) graphs over each step buffer, and with the extensions (bucket, LOGITS)
        ones (and for the persistent loop (bucket, POST_VARIANTS) ones), largest first, sharing one memory
        pool."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        pool = self._graph_pool = torch.cuda.graph_pool_handle()
        variants = (GraphVariant.SAMPLE,) if self.follower else (GraphVariant.SAMPLE, GraphVariant.GREEDY) \
            + ((LOGITS,) if self.sampling_extensions else ()) + (POST_VARIANTS if self.loop_logprobs is not None else ())
        keys = [(i, b, g) for i in range(len(self.buffer_sets)) for b in reversed(self.buckets) for g in variants]
        stream = torch.cuda.Stream(self.device)
        for index, bucket, variant in tqdm(keys, desc="capturing CUDA graphs", disable=not progress, unit="graph"):
            self.bufs, self._set = self.buffer_sets[index], index
            self._fill_dummy(bucket, self.config.seqs_in(bucket))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(bucket, variant)                                   # compiles, warms cuBLAS
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph(keep_graph=self.keep_graphs)
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._step(bucket, variant)
            self.set_graphs[index][(bucket, variant)] = graph
        self.bufs, self._set = self.buffer_sets[0], 0
        torch.cuda.synchronize(self.device)
        log.info("captured %d graphs (buckets %s, %d step buffers) in %.1f s", len(keys), self.buckets,
                 len(self.buffer_sets), time.perf_counter() - t0)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def sampler_graphs(self) -> list[torch.cuda.CUDAGraph]:
        """The sampling part of each kept (bucket, SAMPLE/GREEDY) graph captured alone, in the order the persistent
        loop lists its branches (step buffer, bucket, greedy). The loop counts their nodes to find where a
        step graph's logits are done (it waits for the tokens from there, not from the graph's start).
        Captured over the first step buffer only: the other buffer's graphs have the same nodes. Dropped
        once counted, never replayed: so they share the step graphs' memory pool (each in a pool of its own
        held a sampler's workspace, about 1.5 GiB at 1,024 rows of a 128k vocabulary, and together they ran an
        H100 out of memory at `--max-num-seqs 1024`)."""
        logits = self.logits_dev if self.logits_dev is not None else torch.zeros(
            self.config.max_num_seqs, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        pool = getattr(self, "_graph_pool", None) or torch.cuda.graph_pool_handle()
        once = []
        stream = torch.cuda.Stream(self.device)
        for bucket in self.buckets:
            for greedy in (False, True):
                graph = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._sample(logits[:self.config.seqs_in(bucket)], greedy)
                once.append(graph)
        torch.cuda.synchronize(self.device)
        return once * len(self.buffer_sets)

    def _fill_dummy(self, num_tokens: int, num_seqs: int) -> None:
        """A valid batch for warm-up and capture: `num_seqs` sequences sharing the tokens, blocks 0.."""
        h = self.bufs.h
        per = np.full(num_seqs, num_tokens // num_seqs)
        per[: num_tokens % num_seqs] += 1
        h["q_start"][: num_seqs + 1] = np.concatenate([[0], np.cumsum(per)])
        h["ctx_lens"][:num_seqs] = per
        h["num_seqs"][0] = num_seqs
        h["seq_ids"][:num_tokens] = np.repeat(np.arange(num_seqs), per)
        h["input_ids"][:num_tokens] = 1
        h["positions"][:num_tokens] = 0
        h["slot_mapping"][:num_tokens] = -1                                   # write nothing
        h["block_tables"][:num_seqs] = 0
        h["sample_rows"][:num_seqs] = np.cumsum(per) - 1
        h["temperature"][:num_seqs], h["top_k"][:num_seqs] = 1.0, 0
        h["top_p"][:num_seqs], h["min_p"][:num_seqs] = 1.0, 0.0
        h["seeds"][:num_seqs], h["sample_pos"][:num_seqs] = 0, 0
        self.bufs.upload(num_seqs)

    # ---- per step, on the host -------------------------------------------------------------------------
    @property
    def step_geometry(self) -> StepGeometry:
        """The step buffer the graphs were captured over, for the scheduler's fill."""
        return StepGeometry(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.buckets)

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> list[int]:
        """Tokens sampled for the step's sampled rows, in row order; `last_logprobs` for the rows that asked
        (empty when none did). The step is already in the pinned step buffer (`bufs.host`, the scheduler's C
        fill). Without `sampling_extensions` the engine loop has refused such rows."""
        self.bufs.upload(step.num_seqs)
        self.last_logprobs, no_token = [], {}
        if self.sampling_extensions and any(s.spec.uses_sampling_extensions for s in step.sampled):
            self.last_logprobs, no_token = self._step_extended(step.bucket, step.all_greedy, step.sampled)
        elif self.config.use_graphs:
            self.graphs[(step.bucket, GraphVariant.sampling(step.all_greedy))].replay()
        else:
            self._step(step.bucket, GraphVariant.sampling(step.all_greedy))
        self.tokens_host.copy_(self.tokens_dev, non_blocking=True)
        self._done.record()
        self._done.synchronize()
        tokens = self.tokens_host[:step.num_sampled].tolist()
        for row, outcome in no_token.items():  # TOKEN_WAIT, TOKEN_MASK_EMPTY: what was drawn does not count
            tokens[row] = outcome
        return tokens

    @torch.inference_mode()
    def logits(self, step: ScheduledStep) -> torch.Tensor:
        """Eager step returning float32 logits for every fed token, [num_tokens, V] (teacher-forcing tests)."""
        self.bufs.upload(step.num_seqs)
        if self.tp is not None:
            self._tp_start(step.bucket)
        ops = self._ops(step.bucket)
        x, residual = decoder_layers(ops, self.weights, self.cfg, self.bufs.d["input_ids"][:step.bucket])
        n = step.num_tokens
        return lm_head_logits(ops, self.weights, self.cfg, x[:n], residual[:n])

    @torch.inference_mode()
    def sampled_logits(self, step: ScheduledStep) -> torch.Tensor:
        """Eager step returning the sampled rows' float32 logits [num_sampled, V] as the LOGITS graph computes
        them, before bias and penalties (tests hold the extensions against the sampler's math on these)."""
        self.bufs.upload(step.num_seqs)
        self._step(step.bucket, LOGITS)
        return self.logits_dev[:step.num_sampled].clone()


def _probe_rows(num_rows: int, vocab: int) -> list[SamplingRow]:
    """Sampled rows with every extension (20 logprobs, a token mask), for measuring the extension path's memory."""
    mask = np.full(-(-vocab // 32), 0xFFFFFFFF, dtype=np.uint32)
    row = SamplingRow(1.0, 1.0, 0, 0.0, seed=0, position=2, presence_penalty=0.5, frequency_penalty=0.5,
                      repetition_penalty=1.1, logit_bias=((0, 1.0),), prompt_ids=(0,), output_ids=(0,),
                      num_logprobs=20, constrained=True, token_mask=mask)
    return [row] * num_rows
