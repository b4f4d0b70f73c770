"""Where a MoE layer's decode time goes (issue 25): each kernel of `kernels/moe.py` timed alone at real shapes,
and the expert GEMMs at other tile shapes.

    python bench/moe_probe.py [--model qwen3-30b-a3b] [--tokens 1,8,64] [--out bench/results/moe_probe.json]
    python bench/moe_probe.py --one-token [--out ...]   # moe_one_token (batch 1) at other gate_up GEMV tiles

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


# (gate_up tile, down tile, router tile) of moe_one_token; None = its default. gate_up: (BLOCK_N, BLOCK_K, warps);
# down: (BLOCK_N, BLOCK_K of each expert, warps); router: (BLOCK_K, warps), whose warps also run the routing
ONE_TOKEN_TILES = [((2, 1024, 4), None, None)] + [(g, None, None) for g in (
    (1, 512, 4), (1, 512, 2), (1, 1024, 2), (1, 1024, 8), (1, 2048, 8), (1, 256, 2), (2, 512, 4))] + [
    (None, d, None) for d in ((1, 128, 4), (1, 128, 2), (2, 128, 8), (1, 256, 4), (2, 64, 4), (4, 128, 8),
                              (1, 64, 2))] + [
    (None, None, r) for r in ((1024, 4), (1024, 2), (2048, 4), (2048, 2), (2048, 1), (512, 4))]


def probe_one_token(cfg, gate_up, down) -> dict:
    """moe_one_token (router with its fused norm, gate_up, down) at other gate_up and down tiles; all its
    launches timed together, as the step runs them: the difference between rows is the changed kernel's."""
    hidden, experts, top_k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    norm_w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    routers = [torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * hidden ** -0.5
               for _ in gate_up]
    res_out = torch.empty_like(x)
    inter = gate_up[0].shape[1] // 2
    gate_up_bytes = top_k * 2 * inter * hidden * 2
    rot = itertools.count()

    def call(tiles, i=None):
        i = next(rot) % len(gate_up) if i is None else i
        return M.moe_one_token(x, routers[i], gate_up[i], down[i], top_k, True, norm=(res, norm_w, 1e-6),
                               residual_out=res_out, gate_up_tile=tiles[0], down_tile=tiles[1], router_tile=tiles[2])

    def shown(t) -> str:
        return "default" if t is None else " ".join(f"{k}={v}" for k, v in zip(
            ("bn", "bk", "warps") if len(t) == 3 else ("bk", "warps"), t))

    want = call((None, None, None), 0).float()
    rows = {}
    for tile in [(None, None, None)] + ONE_TOKEN_TILES:
        name = " ".join(f"{part} {shown(t)}" for part, t in zip(("gate_up", "down", "router"), tile))
        try:
            diff = (call(tile, 0).float() - want).abs().max().item()  # sums in another order: close, not equal
            rows[name] = {"us": time_us(lambda tile=tile: call(tile)), "max_abs_diff_vs_default": diff}
        except Exception as exc:
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        r = rows[name]
        print(f"one token, {name:60s} " + (f"{r['us']:7.2f} us (diff {r['max_abs_diff_vs_default']:.1e})"
                                                   if "us" in r else r["error"]), flush=True)
    return {"gate_up_bytes": gate_up_bytes, "whole_moe_us": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="a preset with experts")
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--one-token", action="store_true", help="moe_one_token's gate_up tiles instead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cfg = preset_config(args.model)
    gate_up, down = layer(cfg)
    gbps = copy_gbps()
    if args.one_token:
        doc = {"commit": commit(), "gpu": torch.cuda.get_device_name(), "model": args.model, "copy_gbps": gbps,
               **probe_one_token(cfg, gate_up, down)}
        print(f"gate_up bytes at {gbps:.0f} GB/s: {doc['gate_up_bytes'] / gbps / 1e3:.1f} us", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1))
        return
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
