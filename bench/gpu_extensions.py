"""What the sampling extensions (penalties, logit bias, logprobs) cost the host engine.

    python bench/gpu_extensions.py [--model random:llama-3.2-1b] [--batches 1,8,64,256] [--ctx-len 512]

On a GPU host, in one process:
1. the GpuRunner built twice, without and with `sampling_extensions`: capture time, graphs, KV blocks
   (the difference is the LOGITS graphs, the logits buffer and the eager part's memory);
2. decode steps at batch B (B sequences, one token each, context L, half of it output), timed on the host
   around `runner.run` (fill, upload, replay, extensions, read back): a plain greedy step, a step where
   every row asks for 5 logprobs, and one where every row also has repetition, frequency and presence
   penalties and a logit bias. Extension minus plain = what a step with extensions adds.
Prints a table (ms per step).
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig  # noqa: E402
from gpu_backend.models import load_model  # noqa: E402
from tests.gpu_backend.reference_scheduler import Batch, step_of  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from gpu_host import decode_batch  # noqa: E402

LOGPROBS = dict(num_logprobs=5)
EVERYTHING = dict(num_logprobs=5, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                  logit_bias=((13, 2.0), (42, -100.0)))


def build(model_name: str, extensions: bool) -> GpuRunner:
    cfg, model, _ = load_model(model_name, device="cuda")
    return GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=512, max_num_seqs=256, context_len=4096,
                                                 sampling_extensions=extensions), progress=False)


def with_history(batch: Batch, vocab: int, seed: int = 0) -> Batch:
    """Random token ids, the second half of each sequence counted as output (the penalties' history)."""
    gen = random.Random(seed)
    for e in batch.entries:
        n = len(e.seq.token_ids)
        e.seq.token_ids = [gen.randrange(vocab) for _ in range(n)]
        e.seq.prompt_len = n // 2
    return batch


def with_spec(batch: Batch, **changes) -> Batch:
    for e in batch.entries:
        e.seq.spec = dataclasses.replace(e.seq.spec, **changes)
    return batch


def step_ms(runner: GpuRunner, batch: Batch, reps: int = 30) -> float:
    for _ in range(3):
        runner.run(step_of(runner, batch))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.run(step_of(runner, batch))  # the fill in Python, as the engine's C fill's stand-in
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx-len", type=int, default=512)
    args = ap.parse_args()
    built = {}
    for extensions in (False, True):
        runner = build(args.model, extensions)
        built[extensions] = (runner.capture_s, len(runner.graphs), runner.num_blocks)
        print(f"sampling_extensions={extensions}: {len(runner.graphs)} graphs captured in {runner.capture_s:.1f} s, "
              f"{runner.num_blocks} KV blocks ({runner.num_blocks * runner.kv_block_bytes / 2**30:.2f} GiB)",
              flush=True)
        if not extensions:
            del runner
            torch.cuda.empty_cache()
    print(f"extensions cost {built[True][0] - built[False][0]:.1f} s of capture and "
          f"{built[False][2] - built[True][2]} KV blocks")
    print(f"{'batch':>6} {'plain ms':>9} {'logprobs ms':>12} {'all ext ms':>11}")
    for bsz in map(int, args.batches.split(",")):
        batch = with_history(decode_batch(runner, bsz, args.ctx_len), runner.cfg.vocab_size)
        plain = step_ms(runner, batch)
        logprobs = step_ms(runner, with_spec(batch, **LOGPROBS))
        everything = step_ms(runner, with_spec(batch, **EVERYTHING))
        print(f"{bsz:>6} {plain:>9.2f} {logprobs:>12.2f} {everything:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
