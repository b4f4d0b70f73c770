"""Batch-1 decode GEMMs of Llama-3-8B: which torch/cuBLAS path streams the weights fastest.

    python bench/gemv_probe.py

Each variant runs inside a CUDA graph, 4 weight copies in rotation so the 60 MB L2 holds none of them;
GB/s counts the weight bytes read once. Prints one row per (shape, variant).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.device_check import time_us  # noqa: E402  (replays `reps` captured calls in one graph)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def main() -> None:
    for name, (n, k) in SHAPES.items():
        # each captured call takes the next of 4 copies, so the graph streams weights L2 cannot hold
        ws = itertools.cycle([torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)])
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        variants = {"F.linear M=1": lambda: F.linear(x, next(ws)), "F.linear M=8": lambda: F.linear(x8, next(ws))}
        from kernels.gemv import gemv

        for cfg in ((4, 512, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 256, 4), (8, 512, 8), (32, 256, 8)):
            us = time_us(lambda c=cfg: gemv(x, next(ws), config=c))
            print(f"{name:8s} triton   gemv {str(cfg):14s} {us:8.1f} us {n * k * 2 / us / 1e3:7.0f} GB/s", flush=True)
        for lib in ("cublas",):
            torch.backends.cuda.preferred_blas_library(lib)
            for vname, fn in variants.items():
                us = time_us(fn)
                print(f"{name:8s} {lib:8s} {vname:14s} {us:8.1f} us {n * k * 2 / us / 1e3:7.0f} GB/s", flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
