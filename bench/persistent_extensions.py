"""What the sampling extensions (penalties, logit bias, logprobs) cost the persistent engine.

    python bench/persistent_extensions.py [--model random:llama-3.2-1b] [--batches 1,8,64] [--prompt-len 256]

On a GPU host, in one process: the GpuRunner built for the loop (graphs kept) without and with
`sampling_extensions` (capture time, graphs, KV blocks), then with extensions, all-decode steps of B greedy
streams through the GPU-resident loop (bench/gpu_host.py's persistent_engine: the loop's own counters,
commit-to-commit time of back-to-back steps): plain streams (the plain branches), streams that ask for 5
logprobs (extended branches: LOGITS graph, adjust kernel with nothing to adjust, sampler, logprobs), constrained
streams whose masks (every token allowed) this process writes as soon as it reads the token before each (the
adjust kernel reads the mask from the ring; no speculation past such a step; a late mask reruns the row) and
streams with every extension (repetition/frequency/presence penalties over prompt + output, a logit bias, 5 logprobs).
Prints a table (ms per step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig  # noqa: E402
from gpu_backend.models import load_model  # noqa: E402
from gpu_host import persistent_engine  # noqa: E402

VARIANTS = {"plain": {}, "logprobs": dict(num_logprobs=5), "masked": dict(token_mask=b""),
            "everything": dict(num_logprobs=5, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                               logit_bias=((13, 2.0), (42, -100.0)))}


def build(model_name: str, extensions: bool, max_tokens: int, max_seqs: int, memory: float = 0.9):
    cfg, model, _ = load_model(model_name, device="cuda")
    runner = GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                                                   context_len=4096, sampling_extensions=extensions,
                                                   gpu_memory_fraction=memory),
                       progress=False, keep_graphs=True)
    return runner, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="the KV cache's share (an 8B model's sampler graphs need room left: 0.8)")
    args = ap.parse_args()
    built = {}
    for extensions in (False, True):
        runner, cfg = build(args.model, extensions, args.max_num_batched_tokens, args.max_num_seqs,
                             args.gpu_memory_utilization)
        built[extensions] = (runner.capture_s, len(runner.graphs), runner.num_blocks)
        print(f"sampling_extensions={extensions}: {sum(map(len, runner.set_graphs))} graphs captured in "
              f"{runner.capture_s:.1f} s, {runner.num_blocks} KV blocks "
              f"({runner.num_blocks * runner.kv_block_bytes / 2**30:.2f} GiB)", flush=True)
        if not extensions:
            del runner
            torch.cuda.empty_cache()
    print(f"extensions cost {built[True][0] - built[False][0]:.1f} s of capture and "
          f"{built[False][2] - built[True][2]} KV blocks")
    print("ms per step (back-to-back steps) / ms per token of a stream (window's wall time)")
    print(f"{'batch':>6} " + " ".join(f"{name:>14}" for name in VARIANTS), flush=True)
    for bsz in map(int, args.batches.split(",")):
        cells = []
        for changes in VARIANTS.values():
            if "token_mask" in changes:  # every token allowed: what a constrained step costs with its mask in time
                changes = dict(token_mask=b"\xff" * (4 * ((cfg.vocab_size + 31) // 32)))
            r = persistent_engine(runner, cfg, bsz, args.prompt_len, args.decode_steps, **changes)
            cells.append(f"{r['step_ms_mean']:>7.3f}/{1e3 * bsz / r['tok_s']:<6.3f}")
        print(f"{bsz:>6} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
