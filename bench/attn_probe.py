"""Decode attention alone (kernels/paged_attention.py) at large batches: one layer's call timed per tile config.

    python bench/attn_probe.py [--batches 64,256,512] [--ctx 416,1024]

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head dim 128, 16-token pages, blocks of each sequence
scattered over the cache as the allocator leaves them). Prints, per (batch, context), each config's microseconds a
call and the KV bytes it reads a second (each context once); the default config first. `--kv-cache-dtype fp8` puts
the cache in FP8; `--prefill P` adds one prompt chunk of P tokens (a mixed step), `--configs block_m` sweeps the query
tile for it. Writes bench/results/attn_probe-COMMIT-GPU.json.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels")]

from blink.bench.results import bench_out, commit, write_summary  # noqa: E402
from kernel_batches import make_batch  # noqa: E402
from kernels.device_check import replay_ms  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def time_us(fn, reps: int = 30) -> float:
    """Mean microseconds a call, eager calls back to back (paged_attention allocates its partials per call)."""
    return replay_ms(SimpleNamespace(replay=fn), reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--ctx", default="416,1024")
    ap.add_argument("--max-ctx", type=int, default=4096,
                    help="the block table's width in tokens (a runner's context_len; it sets the static splits)")
    ap.add_argument("--configs", default="sweep", choices=("sweep", "splits", "block_m"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="fp8: the cache in float8 e4m3 (--kv-cache-dtype fp8), read at half the bytes")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also one prompt chunk of this many tokens (a mixed step: its tiles re-read its context)")
    ap.add_argument("--bucket", default="",
                    help="TOKENS:SEQS, the runner's bucket the step runs in (its static tiles: a 2,048-token bucket of a "
                         "2048:1024 server holds 1,024 sequence rows, so its query tiles are 4 tokens); default: "
                         "the step's own tokens and sequences")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    configs = [dict()] + ([dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in
                           itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4))] if args.configs == "sweep" else
                          [dict(num_splits=n) for n in (1, 2, 4)] + [dict(num_splits=n, block_n=128, num_stages=4)
                                                                      for n in (1, 2, 4)]
                          if args.configs == "splits" else [dict(block_m=m) for m in (16, 32, 64, 128)])
    rows = []
    for bsz, ctx in itertools.product(map(int, args.batches.split(",")), args.ctx.split(",")):
        # "mix": contexts spread over 64..3,000 (a saturation run's decode batch), else all the same
        ctxs = [64 + (i * 2654435761) % 2937 for i in range(bsz)] if ctx == "mix" else [int(ctx)] * bsz
        max_blocks = max(-(-max(ctxs) // PAGE), -(-args.max_ctx // PAGE))
        num_blocks = sum(-(-c // PAGE) for c in ctxs) + 8
        q_lens = [1] * bsz + ([args.prefill] if args.prefill else [])
        ctxs += [args.prefill] if args.prefill else []
        num_blocks += -(-args.prefill // PAGE)
        tokens, seqs = sum(q_lens), len(q_lens)
        if args.bucket:
            tokens, seqs = (max(a, b) for a, b in zip(map(int, args.bucket.split(":")), (tokens, seqs)))
        batch = make_batch(q_lens, ctxs, tokens, seqs, max_blocks, num_blocks, dev, gen)
        fp8 = args.kv_cache_dtype == "fp8"
        cache = torch.randn(2, num_blocks, PAGE, KV_HEADS, DIM, device=dev).to(
            torch.float8_e4m3fn if fp8 else torch.bfloat16)
        q = torch.randn(tokens, HEADS, DIM, device=dev).to(torch.bfloat16)
        out = torch.empty_like(q)
        kv_bytes = 2 * sum(ctxs) * KV_HEADS * DIM * (1 if fp8 else 2)  # each context once (a floor, not the reads)
        meta = (batch.seq_ids_of_token, batch.q_start, batch.ctx_lens_t, batch.block_tables, batch.num_seqs)
        for cfg in configs:
            try:
                us = time_us(lambda: paged_attention(q, cache, *meta, DIM ** -0.5, out=out, **cfg))
            except Exception as e:  # a config that does not build (shared memory)
                print(f"B={bsz} ctx={ctx} {cfg}: {type(e).__name__}")
                continue
            rows.append(dict(batch=bsz, ctx=ctx, prefill=args.prefill, kv=args.kv_cache_dtype, **cfg, us=us,
                             gbps=kv_bytes / us / 1e3))
            print(f"B={bsz:4d} ctx={ctx:>5s} {str(cfg or 'default'):55s} {us:8.1f} us {kv_bytes / us / 1e3:6.0f} GB/s",
                  flush=True)
    result = dict(bench="attn_probe", commit=(commit(short=True) or "unknown").replace("+", "-"),
                  gpu=torch.cuda.get_device_name(), rows=rows)
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    print("wrote", write_summary(bench_out(args.out) / f"attn_probe-{result['commit']}-{gpu}.json", result))


if __name__ == "__main__":
    main()
