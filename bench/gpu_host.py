"""The GPU engine against the hardware: bucket-graph replay vs the HBM floor, and the cost of the host.

    python bench/gpu_host.py [--model random:llama-3-8b] [--out bench/results]

On a GPU host, in one process:
1. copy bandwidth of the card (a 1 GiB device-to-device copy; bytes read + written);
2. load the model (random bf16 weights with real shapes), build the GpuRunner (KV sized from free memory,
   one graph per token bucket);
3. bare graph replay of decode steps at batch B (B sequences, one token each, context L each): step time,
   tokens/s, and achieved GB/s = (weight bytes + KV bytes read) / step time, against the copy bandwidth;
4. the host engine (`EngineLoop` + `GpuRunner`, fed through a real shm ring) decoding the same shapes:
   its step time minus the bare replay is the host in the loop; its CPU time per generated token is
   `time.thread_time()` of the engine's thread around `loop.step()` only (the ring producer's polling in
   the same thread is left out);
5. the persistent engine (the GPU-resident loop) on the same runner and shapes: its step time is the
   loop's own commit-to-commit time over back-to-back all-decode steps (`LoopCtl.busy_ns`), minus the
   bare replay = the loop's overhead; its CPU per token is this whole process's CPU time over the window
   (the main thread sleeps meanwhile and nothing polls the ring) divided by the tokens the loop made.
With --tensor-parallel-size N the model is split over the first N GPUs (gpu_backend/parallel/): a bare step
replays each follower's graph, then the leader's; the floor is the leader's weight and KV bytes at the copy
bandwidth, and "floor + all-reduces" adds 2 x layers all-reduces of the batch's hidden states, each timed alone
(back-to-back launches on every rank).
Writes a JSON file (commit, GPU, driver, torch) and prints a table.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink.bench.collectors import thread_run_ns, threads_cpu_s  # noqa: E402
from blink.bench.results import bench_out, commit, write_summary  # noqa: E402
from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig  # noqa: E402
from gpu_backend.engine.graph_variant import GraphVariant  # noqa: E402
from gpu_backend.engine.loop import EngineConfig, EngineLoop  # noqa: E402
from gpu_backend.engine.persistent import PersistentEngine  # noqa: E402
from gpu_backend.models import load_model  # noqa: E402
from kernels._common import pdl_mode  # noqa: E402
from protocols.ring import FinishReason, RequestSpec, RingGeometry  # noqa: E402
from protocols.shm import attach_ring, create_ring  # noqa: E402
from protocols.shm_consumer import RingConsumer  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402
from tests.gpu_backend.reference_scheduler import Batch, ScheduledSeq, Sequence, step_of  # noqa: E402


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / statistics.median(times) / 1e9


def decode_batch(runner: GpuRunner, batch_size: int, ctx_len: int) -> Batch:
    """B sequences, each with ctx_len - 1 tokens cached, feeding one token (blocks laid out in order)."""
    per_seq = -(-ctx_len // runner.config.block_size)
    entries = []
    for i in range(batch_size):
        spec = RequestSpec(i, [1] * ctx_len, 1, temperature=0.0)
        seq = Sequence(slot=i, seq=i + 1, spec=spec, arrival=i, rng_seed=i, token_ids=[1] * ctx_len,
                       prompt_len=ctx_len, num_computed=ctx_len - 1,
                       block_table=list(range(i * per_seq, (i + 1) * per_seq)))
        entries.append(ScheduledSeq(seq, 1, True))
    return Batch(entries)


def _graph_for(runner: GpuRunner, batch: Batch) -> torch.cuda.CUDAGraph:
    """`batch` written into the runner's step buffer; the bucket graph that runs it."""
    step = step_of(runner, batch)
    runner.bufs.upload(step.num_seqs)
    return runner.graphs[(step.bucket, GraphVariant.sampling(step.all_greedy))]


class _Replay:
    """The step of `batch` as a replay: the bucket graph, and under tensor parallelism each follower's first."""

    def __init__(self, runner, batch: Batch):
        self.graph = _graph_for(runner, batch)
        bucket = step_of(runner, batch).bucket
        self.followers = [(f.device, f.graphs[(bucket, GraphVariant.SAMPLE)]) for f in getattr(runner, "followers", ())]

    def replay(self) -> None:
        for device, graph in self.followers:
            with torch.cuda.device(device):
                graph.replay()
        self.graph.replay()


def allreduce_us(runner, batch_size: int, per_graph: int = 64, reps: int = 20) -> float:
    """One all-reduce of [batch, hidden] bf16 over the ranks: `per_graph` of them captured back to back in a
    graph per rank, the ranks' graphs replayed together; the leader's time per all-reduce."""
    ranks = runner.ranks
    graphs = []
    for r in ranks:
        x = torch.zeros(batch_size, runner.cfg.hidden_size, dtype=torch.bfloat16, device=r.device)
        with torch.cuda.device(r.device):
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(r.device)
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(per_graph):
                    r.tp.all_reduce_(x, stream.cuda_stream)
            graphs.append((r.device, graph, x))

    def once() -> None:
        for device, graph, _ in reversed(graphs):  # the leader last, as a step
            with torch.cuda.device(device):
                graph.replay()
    once()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        once()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps / per_graph * 1e3


def bare_replay_ms(runner: GpuRunner, batch: Batch, reps: int = 50) -> float:
    from kernels.device_check import replay_ms

    return replay_ms(_Replay(runner, batch), reps, warmup=5)


def replay_gap_us(runner: GpuRunner, batch: Batch, reps: int = 30) -> float:
    """Median time between two back-to-back host replays of the bucket graph: the last kernel of one replay
    ending -> the first kernel of the next starting (CUPTI's kernel records through torch.profiler; a
    replay's kernels share its launch's correlation id). The loop's counterpart is its `gap_us`."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    graph = _Replay(runner, batch)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    spans: dict[int, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel" and "correlation" in e.get("args", {}):
            span = spans.setdefault(e["args"]["correlation"], [float("inf"), 0.0])
            span[0] = min(span[0], e["ts"])
            span[1] = max(span[1], e["ts"] + e["dur"])
    ordered = sorted(spans.values())
    gaps = [b[0] - a[1] for a, b in zip(ordered, ordered[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def mechanism_replay_ms(runner: GpuRunner, batch: Batch, reps: int = 50, mode: int = 0,
                        stamp_bucket: int = -1) -> float:
    """The same replay run the way the loop runs a step (mode 0: a graph that tail-launches itself from the
    device, kernels/csrc/persistent_loop.cu, no scheduling), or (mode 1) instantiated as the loop's bucket
    graphs are and launched from the host back to back; with the stamp kernels of `stamp_bucket` when >= 0
    (bench/loop_ab.py --stamps)."""
    from kernels import persistent_loop

    graph = _graph_for(runner, batch)
    torch.cuda.synchronize()
    ns = ctypes.c_double()
    plain_edges = persistent_loop.LoopOptions.from_env().plain_edges  # as the loop's graphs are built
    persistent_loop.check(persistent_loop.load(bench=True).blink_loop_bench_mechanism(
        graph.raw_cuda_graph(), reps, mode, stamp_bucket, int(plain_edges), ctypes.byref(ns)), "the mechanism's replay")
    return ns.value / 1e6


def prefill_steps(runner: GpuRunner, batch_size: int, prompt_len: int) -> int:
    """Steps until every stream has prefilled (decode goes first, so prefill gets the budget's rest)."""
    budget = runner.config.max_num_batched_tokens
    return -(-batch_size * prompt_len // max(budget - batch_size, 1)) + 2


def engine_config(runner: GpuRunner) -> EngineConfig:
    c = runner.config
    return EngineConfig(block_size=c.block_size, max_num_batched_tokens=c.max_num_batched_tokens,
                        max_num_seqs=c.max_num_seqs)


def submit_streams(prod: ShmProducer, batch_size: int, prompt_len: int, new_tokens: int, **changes) -> list[int]:
    """Greedy streams; `changes` go into each RequestSpec (bench/persistent_extensions.py: the extensions)."""
    return [prod.submit(RequestSpec(i, [7 + i] * prompt_len, new_tokens, temperature=0.0, ignore_eos=True, **changes))
            for i in range(batch_size)]


def host_engine(runner: GpuRunner, cfg, batch_size: int, prompt_len: int, decode_steps_wanted: int) -> dict:
    """`batch_size` streams through the ring, long enough that all of them decode together for about
    `decode_steps_wanted` steps after every prefill; times those all-decode steps only."""
    new_tokens = prefill_steps(runner, batch_size, prompt_len) + decode_steps_wanted
    ring = create_ring(f"blink-bench-host-{os.getpid()}", RingGeometry(max(batch_size, 16), 4096, 1024), "bench")
    try:
        prod = ShmProducer(attach_ring(ring.name))
        loop = EngineLoop(runner, cfg, RingConsumer(ring), engine_config(runner), context_len=runner.config.context_len)
        slots = submit_streams(prod, batch_size, prompt_len, new_tokens)
        live, produced = set(slots), 0
        step_s, cpu_s, decode_steps, tokens_in_decode, ctx = [], 0.0, 0, 0, []
        while live:
            sched = loop.scheduler
            num_tokens = sched.a["num_tokens"][sched.running]
            decoding = len(num_tokens) == batch_size and bool(
                (sched.a["num_computed"][sched.running] == num_tokens - 1).all())
            if decoding:
                ctx.append(float(num_tokens.mean()))
            w0, c0 = time.perf_counter(), time.thread_time()
            loop.step()
            w1, c1 = time.perf_counter(), time.thread_time()
            if decoding:
                step_s.append(w1 - w0)
                cpu_s += c1 - c0
                decode_steps += 1
            for s in list(live):
                upd = prod.poll(s)
                produced += len(upd.tokens)
                if decoding:
                    tokens_in_decode += len(upd.tokens)
                if upd.finish is not FinishReason.NONE:
                    live.discard(s)
                    prod.release(s)
        assert produced == batch_size * new_tokens, f"{produced} tokens, expected {batch_size * new_tokens}"
        return {"decode_steps": decode_steps, "step_ms_median": 1e3 * statistics.median(step_s),
                "ctx_len_median": int(statistics.median(ctx)),
                "cpu_us_per_token": 1e6 * cpu_s / max(tokens_in_decode, 1),
                "cpu_us_per_step": 1e6 * cpu_s / max(decode_steps, 1)}
    finally:
        ring.close()


def persistent_new_tokens(runner: GpuRunner, batch_size: int, prompt_len: int, decode_steps_wanted: int) -> int:
    """Tokens each persistent-loop stream asks for: enough that none ends in the timed window (the loop runs on
    while the host watches: 4x the window), but no more than the KV cache holds for the whole batch. Past it
    the loop preempts and recomputes, and the window would time that (Qwen3-32B at batch 64 on an H100, with
    ~10 GB of KV: 48.5 ms steps against 29.6 bare)."""
    prefill = prefill_steps(runner, batch_size, prompt_len)
    want, need = prefill + 4 * decode_steps_wanted, prefill + decode_steps_wanted + 8
    block = runner.config.block_size
    room = runner.num_blocks // batch_size * block - prompt_len - block  # a block of slack per stream
    if room < need:
        print(f"warning: the KV cache ({runner.num_blocks} blocks of {block}) holds {room} new tokens a stream at "
              f"batch {batch_size}, under the {need} the persistent window needs: expect preemption in it",
              file=sys.stderr, flush=True)
    return max(min(want, room), 1)


def persistent_engine(runner: GpuRunner, cfg, batch_size: int, prompt_len: int, decode_steps_wanted: int,
                      window=None, **changes) -> dict:
    """`batch_size` streams through the GPU-resident loop; times `decode_steps_wanted` all-decode steps
    (`window(True)` / `window(False)`, when given, is called as that window opens and closes)."""
    new_tokens = persistent_new_tokens(runner, batch_size, prompt_len, decode_steps_wanted)
    masked = changes.get("token_mask") is not None  # constrained streams: this thread writes each next mask
    geometry = RingGeometry(max(batch_size, 16), 4096, 4096,
                            mask_words=len(changes["token_mask"]) // 4 if masked else 0)
    ring = create_ring(f"blink-bench-pers-{os.getpid()}", geometry, "bench")
    engine = None
    try:
        prod = ShmProducer(attach_ring(ring.name))
        engine = PersistentEngine(runner, cfg, ring, engine_config(runner), context_len=runner.config.context_len,
                                  tp=runner if getattr(runner, "followers", None) else None)
        slots = submit_streams(prod, batch_size, prompt_len, new_tokens, **changes)
        engine.start()
        ctl = engine.ctl
        deadline, started = time.monotonic() + 300, set()
        read = dict.fromkeys(slots, 0)  # tokens read per slot (masked: mask `read` is the one written last)

        def read_all() -> set[int]:
            """Poll every stream; a masked one gets its next mask (all tokens allowed) as its token is read, as
            the gateway's mask loop would with a free grammar."""
            fresh = set()
            for s in slots:
                got = len(prod.poll(s).tokens)
                if got:
                    fresh.add(s)
                    read[s] += got
                    if masked:
                        prod.put_mask(s, read[s], changes["token_mask"])
            return fresh
        while len(started) < batch_size:  # every stream has its first token: all of them decode from here
            assert time.monotonic() < deadline, "the loop made no progress"
            started |= read_all()
            time.sleep(0.001)
        s0 = {k: getattr(ctl, k) for k in ("steps", "tokens", "busy_ns", "busy_steps", "sched_ns", "commit_ns",
                                           "schedule_ns", "fill_ns", "spec_hits", "spec_misses", "spec_ns", "gap_ns", "gap_steps")}
        t0 = thread_run_ns(os.getpid())  # read before the window: /proc reads cost ~2 ms of this thread's CPU
        c0, w0 = time.process_time(), time.perf_counter()
        if window is not None:
            window(True)
        while ctl.steps < s0["steps"] + decode_steps_wanted:
            if changes.get("num_logprobs") is None and not masked:
                time.sleep(0.25)  # the backend's own watcher wakes this often
                continue
            read_all()  # logprob streams go on as they are read; masked ones wait for their masks
            time.sleep(0.0002 if masked else 0.0005)  # (busy time counts back-to-back steps only)
        s1 = {k: getattr(ctl, k) for k in s0}
        c1, w1 = time.process_time(), time.perf_counter()
        t1 = thread_run_ns(os.getpid())
        if window is not None:
            window(False)
        d = {k: s1[k] - s0[k] for k in s0}
        tokens_mid = (s0["tokens"] + s1["tokens"]) / 2 / batch_size
        return {"decode_steps": d["steps"], "step_ms_mean": d["busy_ns"] / max(d["busy_steps"], 1) / 1e6,
                **{f"{k[:-3]}_us_per_step": d[k] / max(d["steps"], 1) / 1e3  # the loop kernel, then its phases
                   for k in ("sched_ns", "commit_ns", "schedule_ns", "fill_ns", "spec_ns")},
                "spec_hits": d["spec_hits"], "spec_misses": d["spec_misses"],
                # a taken speculation: its tokens seen (take kernel) -> the next step's kernels start
                "gap_us": d["gap_ns"] / max(d["gap_steps"], 1) / 1e3,
                "ctx_len_mid": int(prompt_len + tokens_mid), "tokens": d["tokens"],
                "tok_s": d["tokens"] / (w1 - w0), "cpu_s": c1 - c0,
                "cpu_us_per_token": 1e6 * (c1 - c0) / max(d["tokens"], 1),
                "cpu_s_by_thread": {k: v for k, v in threads_cpu_s(t0, t1).items() if v >= 1e-5}}
    finally:
        if engine is not None:
            engine.shutdown()
        ring.close()


def profile(runner: GpuRunner, batch: Batch, top: int = 24) -> dict:
    """Kernel time of one eager step of `batch` (the bucket's ops run without its graph), by kernel name, averaged
    over 5 steps: printed (the `top` largest) and returned for the run's JSON."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step = step_of(runner, batch)
    bucket, greedy = step.bucket, GraphVariant.sampling(step.all_greedy)
    runner.bufs.upload(step.num_seqs)
    with torch.inference_mode():
        runner._step(bucket, greedy)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner._step(bucket, greedy)
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 5, e.count // 5) for e in prof.key_averages()),
                  key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"batch {len(batch.entries)}: kernel time per eager step {total / 1e3:.3f} ms")
    for key, us, count in rows[:top]:
        print(f"  {us:8.1f} us  x{count:<4d} {key[:100]}")
    return {"batch": len(batch.entries), "kernel_ms": total / 1e3,
            "kernels": [{"name": key[:160], "us": round(us, 2), "launches": count} for key, us, count in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--prompt-len", type=int, default=384, help="prompt tokens per stream")
    ap.add_argument("--decode-steps", type=int, default=64, help="all-decode steps timed per batch size")
    ap.add_argument("--profile", nargs="?", const="1", default="",
                    help="also break an eager step down by kernel at these batch sizes (comma-separated; bare "
                         "--profile: batch 1), printed and kept in the JSON")
    ap.add_argument("--quantization", choices=("fp8", "fp8-partial"), default=None, help="FP8 weights (models/fp8.py)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="split the model over the first N GPUs")
    ap.add_argument("--no-persistent", action="store_true", help="host engine and bare steps only")
    ap.add_argument("--bare-only", action="store_true",
                    help="bare steps only (no host engine, no persistent loop; context = prompt + half the decode "
                         "steps): quick, for A/Bs of kernels at large batches")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {gbps:.0f} GB/s", flush=True)
    t0 = time.perf_counter()
    largest = max(map(int, args.batches.split(",")))  # past 256 rows (saturation's batches): a larger runner
    runner_config = GpuRunnerConfig(max_num_batched_tokens=max(512, largest), max_num_seqs=max(256, largest),
                                    context_len=4096, kv_cache_dtype=args.kv_cache_dtype)
    tp = args.tensor_parallel_size
    if tp > 1:
        from gpu_backend.parallel.runner import TpRunner
        from gpu_backend.parallel.shard import load_rank_models, local_config

        devices = [torch.device("cuda", r) for r in range(tp)]
        cfg, models, _ = load_rank_models(args.model, devices, args.quantization)
        runner = TpRunner(models, local_config(cfg, tp), runner_config, devices, keep_graphs=True)
    else:
        cfg, model, _ = load_model(args.model, device="cuda", quantization=args.quantization)
        runner = GpuRunner(model, cfg, runner_config, keep_graphs=True)
    setup_s = time.perf_counter() - t0
    weight_bytes = runner.weights.num_bytes
    kv_token_bytes = runner.kv_block_bytes // runner.config.block_size
    profiles = [profile(runner, decode_batch(runner, int(b), args.prompt_len))
                for b in args.profile.split(",") if b] if tp == 1 else []
    rows = []
    for bsz in map(int, args.batches.split(",")):
        if args.bare_only:
            host = {k: float("nan") for k in ("step_ms_median", "cpu_us_per_token")}
            host["ctx_len_median"] = args.prompt_len + args.decode_steps // 2
        else:
            host = host_engine(runner, cfg, bsz, args.prompt_len, args.decode_steps)
        ctx_len = host["ctx_len_median"]
        ms = bare_replay_ms(runner, decode_batch(runner, bsz, ctx_len))
        # what a step reads: the embedding table's bsz rows only (issue 22's floor) and, for MoE, only the experts
        # a batch of bsz chooses (uniform-routing estimate)
        moved = (cfg.decode_weight_bytes(bsz, runner.dtype) // tp if cfg.is_moe
                 else weight_bytes - cfg.unread_embedding_params(bsz) * runner.weights.embed.element_size()) \
            + bsz * ctx_len * kv_token_bytes
        ar_ms = 2 * cfg.num_layers * allreduce_us(runner, bsz) / 1e3 if tp > 1 else 0.0
        if args.no_persistent or args.bare_only:
            pers = {k: float("nan") for k in ("step_ms_mean", "sched_us_per_step", "commit_us_per_step", "spec_us_per_step",
                                              "schedule_us_per_step", "fill_us_per_step", "gap_us", "cpu_us_per_token")}
            pers.update(spec_hits=0, spec_misses=0, ctx_len_mid=ctx_len)
        else:
            pers = persistent_engine(runner, cfg, bsz, args.prompt_len, args.decode_steps)
        at_mid = decode_batch(runner, bsz, pers["ctx_len_mid"])
        rounds = [(bare_replay_ms(runner, at_mid, 100),
                   mechanism_replay_ms(runner, at_mid, 100) if tp == 1 and not args.bare_only else float("nan"))
                  for _ in range(3)]
        pers_bare = statistics.median(b for b, _ in rounds)  # alternated: the clocks drift by ~0.3% between runs
        pers_mech = statistics.median(m for _, m in rounds)
        rows.append({"batch": bsz, "ctx_len": ctx_len, "bare_step_ms": ms, "bare_tok_s": bsz / ms * 1e3,
                     "achieved_gbps": moved / ms / 1e6, "floor_ms": moved / gbps / 1e6,
                     "allreduce_ms": ar_ms, "floor_with_allreduce_ms": moved / gbps / 1e6 + ar_ms,
                     "host": host, "host_overhead_us": 1e3 * (host["step_ms_median"] - ms),
                     "persistent": pers, "persistent_bare_step_ms": pers_bare,
                     "persistent_overhead_us": 1e3 * (pers["step_ms_mean"] - pers_bare),
                     "mechanism_step_ms": pers_mech,  # the replay relaunched from the device, no scheduling
                     "persistent_over_mechanism_us": 1e3 * (pers["step_ms_mean"] - pers_mech)})
        r = rows[-1]
        print(f"B={bsz:4d} bare {ms:7.3f} ms ({r['achieved_gbps']:6.0f} GB/s, floor {r['floor_ms']:.3f} ms, "
              f"+ all-reduces {r['floor_with_allreduce_ms']:.3f} ms) | host "
              f"{host['step_ms_median']:7.3f} ms (+{r['host_overhead_us']:6.0f} us), "
              f"CPU {host['cpu_us_per_token']:8.1f} us/token | persistent {pers['step_ms_mean']:7.3f} ms vs bare "
              f"{pers_bare:7.3f} (+{r['persistent_overhead_us']:5.1f} us, loop kernel "
              f"{pers['sched_us_per_step']:.1f} us = commit {pers['commit_us_per_step']:.1f} + schedule "
              f"{pers['schedule_us_per_step']:.1f} + fill {pers['fill_us_per_step']:.1f} + rest; speculation "
              f"taken {pers['spec_hits']} / missed {pers['spec_misses']}, spec kernel {pers['spec_us_per_step']:.1f} us "
              f"beside the graph; tokens seen -> next step's kernels {pers['gap_us']:.1f} us), "
              f"CPU {pers['cpu_us_per_token']:.3f} us/token; the replay relaunched from the device "
              f"alone {pers_mech:7.3f} ms (loop step +{r['persistent_over_mechanism_us']:.1f} us over it)", flush=True)
    # last: once CUPTI is on, it stays on in this process and slows device-launched graphs (seen: +200 us a step)
    for r in rows:
        if args.bare_only:
            r["host_replay_gap_us"] = r["gap_over_host_replay_us"] = float("nan")
            continue
        # back-to-back host replays: last kernel's end -> next replay's first kernel (CUPTI's own cost included)
        r["host_replay_gap_us"] = replay_gap_us(runner, decode_batch(runner, r["batch"], r["persistent"]["ctx_len_mid"]))
        r["gap_over_host_replay_us"] = r["persistent"]["gap_us"] - r["host_replay_gap_us"]
        print(f"B={r['batch']:4d} host replays' gap {r['host_replay_gap_us']:.1f} us (CUPTI), the loop's "
              f"{r['persistent']['gap_us']:.1f} us", flush=True)
    result = {"bench": "gpu_host", "commit": commit(short=True) or "unknown", "gpu": torch.cuda.get_device_name(),
              "driver": torch.cuda.get_device_properties(0).name, "torch": torch.__version__,
              "host": platform.node(), "model": args.model, "weight_bytes": weight_bytes, "tensor_parallel_size": tp,
              "gpus": [torch.cuda.get_device_name(i) for i in range(tp)],
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "kv_blocks": runner.num_blocks, "graphs": len(runner.graphs), "capture_s": runner.capture_s,
              "setup_s": setup_s, "copy_gbps": gbps, "pdl": pdl_mode(), "rows": rows, "profiles": profiles}
    # the model in the name: runs of several models in one folder (one device call) must not overwrite each other
    model = args.model.split(":")[-1].rstrip("/").split("/")[-1]
    variant = "".join(f"-{v}" for v in (model, args.quantization and "fp8w", args.kv_cache_dtype != "auto" and "fp8kv",
                                        tp > 1 and f"tp{tp}",
                                        {"1": "pdl", "0": "nopdl"}.get(pdl_mode())) if v)
    path = write_summary(bench_out(args.out) / f"gpu_host-{result['commit']}{variant}.json", result)
    print(f"wrote {path}")
    print("| batch | bare step ms | floor ms | GB/s | % copy | host step ms | host adds us | host CPU us/token "
          "| persistent step ms | persistent adds us | over device relaunch alone us | tokens seen -> next step us "
          "| host replays' gap us | loop kernel us | persistent CPU us/token |")
    for r in rows:
        p = r["persistent"]
        print(f"| {r['batch']} | {r['bare_step_ms']:.3f} | {r['floor_ms']:.3f} | {r['achieved_gbps']:.0f} | "
              f"{100 * r['achieved_gbps'] / gbps:.0f}% | {r['host']['step_ms_median']:.3f} | "
              f"{r['host_overhead_us']:.0f} | {r['host']['cpu_us_per_token']:.1f} | {p['step_ms_mean']:.3f} | "
              f"{r['persistent_overhead_us']:.1f} | {r['persistent_over_mechanism_us']:.1f} | {p['gap_us']:.1f} | "
              f"{r['host_replay_gap_us']:.1f} | {p['sched_us_per_step']:.1f} | {p['cpu_us_per_token']:.3f} |")


if __name__ == "__main__":
    main()
