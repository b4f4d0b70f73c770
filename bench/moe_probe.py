"""Where a MoE layer's decode time goes (issue 25): each kernel of `kernels/moe.py` timed alone at real shapes,
and the expert GEMMs at other tile shapes.

    python bench/moe_probe.py [--model qwen3-30b-a3b] [--tokens 1,8,64] [--out bench/results/moe_probe.json]

One layer's experts at the preset's shapes, random bf16 weights, in 4 copies taken in rotation so the L2 holds
none of them; random routing (each token's top-k of a random softmax). Every figure is a CUDA graph of back-to-back
calls (`kernels.device_check.time_us`), so a kernel's microseconds include its launch gap inside a graph, as in
the bucket graphs. GB/s counts the chosen experts' weight bytes once. Each tile variant's output is checked
against the default's (bf16 sums in another order: close, not equal); a variant that does not build or run
(shared memory) says so.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blink.bench.results import commit  # noqa: E402
from gpu_backend.models import preset_config  # noqa: E402
from kernels import moe as M  # noqa: E402
from kernels.device_check import copy_gbps, time_us  # noqa: E402

VARIANTS = [M.ExpertTiles(bn, bk, warps, stages) for bn, bk, warps, stages in
            itertools.product((32, 64), (64, 128, 256), (4,), (None, 4, 6))]


def layer(cfg, copies: int = 4):
    hidden, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    scale = hidden ** -0.5
    gate_up = [torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * scale for _ in range(copies)]
    down = [torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5 for _ in range(copies)]
    return gate_up, down


def probe(cfg, num_tokens: int, gate_up, down) -> dict:
    hidden, experts, top_k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(num_tokens, experts, device="cuda", generator=gen)
    weights, ids = M.moe_route(logits, top_k, True)
    chosen = ids.unique().numel()
    inter = gate_up[0].shape[1] // 2
    expert_bytes = chosen * 3 * inter * hidden * 2
    rot = itertools.count()

    def pick():
        i = next(rot) % len(gate_up)
        return gate_up[i], down[i]

    bm = M.block_m(ids.numel(), experts)
    sorted_pairs, counts, offsets = M.moe_align(ids, experts)
    blocks = M.max_row_blocks(num_tokens, top_k, experts, bm)
    table = M.moe_block_table(counts, offsets, bm, blocks)
    parts = {
        "route": time_us(lambda: M.moe_route(logits, top_k, True)),
        "align": time_us(lambda: M.moe_align(ids, experts)),
        "block_table": time_us(lambda: M.moe_block_table(counts, offsets, bm, blocks)),
        "experts (default tiles)": time_us(lambda: M.moe_experts(x, weights, ids, *pick())),
        "fused_moe (all of it)": time_us(lambda: M.fused_moe(x, logits, *pick(), top_k, True)),
    }
    del sorted_pairs, table
    want = M.moe_experts(x, weights, ids, gate_up[0], down[0]).float()
    tiles = {}
    for v in VARIANTS:
        name = f"bn={v.block_n} bk={v.block_k} warps={v.num_warps} stages={v.num_stages}"
        try:
            got = M.moe_experts(x, weights, ids, gate_up[0], down[0], tiles=v).float()
            err = ((got - want).norm() / want.norm()).item()
            us = time_us(lambda v=v: M.moe_experts(x, weights, ids, *pick(), tiles=v))
            tiles[name] = {"us": us, "gbps": expert_bytes / us / 1e3, "rel_err_vs_default": err}
        except Exception as exc:  # a tile shape this GPU cannot build (shared memory) or run
            tiles[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row = tiles[name]
        print(f"T={num_tokens:4d} {name:38s} " + (f"{row['us']:8.1f} us {row['gbps']:6.0f} GB/s err {row['rel_err_vs_default']:.1e}"
                                                  if "us" in row else row["error"]), flush=True)
    return {"num_tokens": num_tokens, "block_m": bm, "experts_chosen": chosen, "expert_bytes": expert_bytes,
            "default_tiles": vars(M.expert_tiles(bm)), "parts_us": parts, "tiles": tiles}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a preset with experts")
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cfg = preset_config(args.model)
    gate_up, down = layer(cfg)
    gbps = copy_gbps()
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        row = probe(cfg, t, gate_up, down)
        parts = row["parts_us"]
        print(f"T={t}: " + ", ".join(f"{k} {v:.1f} us" for k, v in parts.items())
              + f"; chosen experts' bytes at {gbps:.0f} GB/s: {row['expert_bytes'] / gbps / 1e3:.1f} us", flush=True)
        rows.append(row)
    doc = {"commit": commit(), "gpu": torch.cuda.get_device_name(), "host": platform.node(), "model": args.model,
           "copy_gbps": gbps, "layers": cfg.num_layers, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
