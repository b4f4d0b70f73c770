"""Batch-1 decode GEMMs: which kernels/gemv.py tile streams each projection's weights fastest, and cuBLAS beside.

    python bench/gemv_probe.py                                   # Llama-3-8B's projections, a few tiles, cuBLAS
    python bench/gemv_probe.py --model qwen3-30b-a3b --model phi-4 --sweep --out bench/results/gemv.json

Shapes come from the model presets (gpu_backend/models/presets.py): qkv, o, gate_up, down, lm_head, and the MoE
router. Each variant runs inside a CUDA graph over enough weight copies (at least 4, at least 256 MB in all) that
the 50-60 MB L2 holds none of them, as in a step where every layer's weights are new; GB/s counts the weight bytes
read once. `--sweep` times every (BLOCK_N, BLOCK_K, num_warps) of a grid and prints the best per shape beside the
one the GPU runner uses now (`gpu_runner.GpuRunnerConfig.gemv_projections` / kernels/gemv.gemv_config).
`--fp8`: FP8 e4m3 rows with one scale each (`--quantization fp8` at batch 1: gpu_ops streams them with the bf16
tile's BLOCK_K doubled, the same bytes a program); GB/s then counts one byte a weight.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_backend.models.presets import preset_config  # noqa: E402
from kernels.device_check import time_us  # noqa: E402  (replays `reps` captured calls in one graph)

FEW = ((4, 512, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 256, 4), (8, 512, 8), (32, 256, 8))
SWEEP = tuple(itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024), (2, 4, 8)))


def projections(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each batch-1 GEMV of preset `name`."""
    c = preset_config(name)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q), "lm_head": (c.vocab_size, c.hidden_size)}
    if c.num_experts:
        shapes["router"] = (c.num_experts, c.hidden_size)
    else:
        shapes.update(gate_up=(2 * c.intermediate_size, c.hidden_size), down=(c.hidden_size, c.intermediate_size))
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="a preset (repeat); default llama-3-8b")
    ap.add_argument("--sweep", action="store_true", help="every tile of the grid, not a few")
    ap.add_argument("--fp8", action="store_true", help="FP8 rows and their scales instead of bf16 rows")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    from gpu_backend.engine.gpu_runner import GpuRunnerConfig
    from kernels.gemv import gemv, gemv_config

    current = dict(GpuRunnerConfig.gemv_projections)
    rows, seen = [], set()
    for model in args.model or ["llama-3-8b"]:
        for name, (n, k) in projections(model).items():
            if (n, k) in seen:
                continue
            seen.add((n, k))
            wbytes = 1 if args.fp8 else 2
            copies = max(4, -(-(256 << 20) // (n * k * wbytes)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            scale = torch.ones(n, device="cuda") if args.fp8 else None
            if args.fp8:
                ws = [w.to(torch.float8_e4m3fn) for w in ws]
            turn = itertools.cycle(ws)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            now = current.get(name), gemv_config(n, k)
            if args.fp8:  # gpu_ops: the bf16 tile with BLOCK_K doubled
                now = tuple(None if c is None else (c[0], 2 * c[1], c[2]) for c in now)
            timed = {}
            grid = [(c[0], 2 * c[1], c[2]) if args.fp8 else c for c in (SWEEP if args.sweep else FEW)]
            for cfg in grid + [c for c in now if c is not None and c not in grid]:  # the runner's tiles always
                if cfg[0] * cfg[1] > 16384 * (2 if args.fp8 else 1):  # too many registers a thread
                    continue
                timed[cfg] = time_us(lambda c=cfg: gemv(x, next(turn), out=out, config=c, scale=scale), reps=copies)
            cublas = float("nan") if args.fp8 else time_us(lambda: F.linear(x, next(turn)), reps=copies)
            best = min(timed, key=timed.get)
            row = {"model": model, "projection": name, "n": n, "k": k, "mb": n * k * wbytes / 1e6,
                   "weights": "fp8" if args.fp8 else "bf16",
                   "best": list(best), "best_us": timed[best], "cublas_us": None if args.fp8 else cublas,
                   "runner_config": list(now[0]) if now[0] else None,
                   "runner_us": timed.get(now[0]) if now[0] else None,
                   "rule_config": list(now[1]), "rule_us": timed.get(now[1]),
                   "all": {str(c): round(us, 2) for c, us in sorted(timed.items(), key=lambda kv: kv[1])[:12]}}
            rows.append(row)
            gbps = lambda us: n * k * wbytes / us / 1e3  # noqa: E731
            print(f"{model:14s} {name:8s} {n:6d} x {k:5d}: best {str(best):15s} {timed[best]:7.1f} us "
                  f"{gbps(timed[best]):5.0f} GB/s | runner {str(now[0]):15s} {row['runner_us'] or float('nan'):7.1f} | "
                  f"rule {str(now[1]):15s} {row['rule_us'] or float('nan'):7.1f} | cuBLAS {cublas:7.1f} us", flush=True)
            del ws
    if args.out:
        Path(args.out).write_text(json.dumps({"bench": "gemv_probe", "gpu": torch.cuda.get_device_name(),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
