"""Time each kernel on Llama-3-8B shapes and state it against the copy bandwidth measured here.

Run by kernels/device_check.sh after the GPU tests. Each kernel is captured `REPS` times back to back
in one CUDA graph (the way the engine launches it: no host launch cost) and the replay is timed with
CUDA events. Bytes are the minimum the kernel must move (inputs read once, outputs written once);
GB/s = bytes / time, and `% copy` compares it with a device-to-device copy of a 1 GiB tensor
(2 GiB moved: read + write).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

from kernel_batches import make_batch  # noqa: E402
from kernels.moe import (fused_moe, max_row_blocks, moe_align, moe_block_table, moe_route,  # noqa: E402
                         moe_route_decode)
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.rmsnorm import add_rmsnorm, rmsnorm  # noqa: E402
from kernels.rope_kv import rope_and_cache_kv  # noqa: E402
from kernels.sampling import sample  # noqa: E402
from kernels.swiglu import swiglu  # noqa: E402

REPS = 20
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256
BF16 = 2


def replay_ms(graph, reps: int, warmup: int = 3) -> float:
    """Mean milliseconds per replay of an already captured graph (anything with `.replay()`), after `warmup`
    replays, timed with CUDA events over `reps` back-to-back replays."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def time_us(fn, reps: int = REPS) -> float:
    """Mean microseconds per call of fn, replayed from a CUDA graph of `reps` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() / us / 1e3


def bench_norm_swiglu(rows: int):
    x, res = (torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    yield f"add_rmsnorm T={rows}", time_us(lambda: add_rmsnorm(x, res, w, 1e-5, out=out, residual_out=res)), \
        (5 * rows * HIDDEN + HIDDEN) * BF16, 0
    gate_up = torch.randn(rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(rows, INTER, device="cuda", dtype=torch.bfloat16)
    yield f"swiglu T={rows}", time_us(lambda: swiglu(gate_up, out=act)), 3 * rows * INTER * BF16, 0


def _attn_setup(q_lens, ctx_lens, num_tokens, max_seqs):
    gen = torch.Generator().manual_seed(0)
    max_blocks = max(-(-c // 16) for c in ctx_lens)
    num_blocks = sum(-(-c // 16) for c in ctx_lens) + 1
    batch = make_batch(q_lens, ctx_lens, num_tokens, max_seqs, max_blocks, num_blocks, "cuda", gen)
    cache = torch.randn(2, num_blocks, 16, KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    return batch, cache


def bench_rope(rows: int):
    batch, cache = _attn_setup([rows], [rows], rows, 1)
    qkv = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS: HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    cos = sin = torch.randn(8192, HEAD_DIM, device="cuda")
    moved = rows * HEAD_DIM * (2 * HEADS + 4 * KV_HEADS) * BF16 + 2 * rows * HEAD_DIM // 2 * 4
    yield f"rope_kv T={rows}", time_us(lambda: rope_and_cache_kv(q, k, v, batch.positions, cos, sin,
                                                                 batch.slot_mapping, cache)), moved, 0


def bench_qk_norm_rope(rows: int):
    """Qwen3-30B-A3B's q/k norm + RoPE + KV write (32 heads, 4 KV heads of 128): fused, then as three launches."""
    heads, kv_heads = 32, 4
    batch = make_batch([rows], [rows], rows, 1, -(-rows // 16), -(-rows // 16) + 1, "cuda", torch.Generator())
    cache = torch.randn(2, -(-rows // 16) + 1, 16, kv_heads, HEAD_DIM, device="cuda").to(torch.bfloat16)
    qkv = torch.randn(rows, heads + 2 * kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :heads], qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]
    cos = sin = torch.randn(8192, HEAD_DIM // 2, device="cuda")
    w = torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    moved = rows * HEAD_DIM * (2 * heads + 4 * kv_heads) * BF16 + 2 * rows * HEAD_DIM // 2 * 4
    args = (batch.positions, cos, sin, batch.slot_mapping, cache)
    yield f"qk-norm + rope_kv fused T={rows}", time_us(lambda: rope_and_cache_kv(
        q, k, v, *args, q_norm=w, k_norm=w, eps=1e-6)), moved, 0
    normed = lambda x: rmsnorm(x.reshape(-1, HEAD_DIM), w, 1e-6).view(x.shape)
    three = lambda: rope_and_cache_kv(normed(q), normed(k), v, *args)
    yield f"qk-norm + rope_kv 3 launches T={rows}", time_us(three), moved, 0


def bench_routing(rows: int):
    """Qwen3-30B-A3B's routing (128 experts, 8 per token): one launch, then route + align + block table."""
    logits = torch.randn(rows, 128, device="cuda").to(torch.bfloat16)
    blocks = max_row_blocks(rows, 8, 128, 16)

    def three():
        weights, ids = moe_route(logits, 8, True)
        _, counts, offsets = moe_align(ids, 128)
        return moe_block_table(counts, offsets, 16, blocks)
    moved = logits.numel() * BF16
    yield f"moe routing 1 launch T={rows}", time_us(lambda: moe_route_decode(logits, 8, True, 16, blocks)), moved, 0
    yield f"moe routing 3 launches T={rows}", time_us(three), moved, 0


def bench_attention(name: str, q_lens, ctx_lens, num_tokens, max_seqs):
    batch, cache = _attn_setup(q_lens, ctx_lens, num_tokens, max_seqs)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = sum(ctx_lens) * 2 * KV_HEADS * HEAD_DIM * BF16
    # causal: a token at position p does QK^T and PV over p + 1 keys, for every head
    flops = sum(4 * HEADS * HEAD_DIM * (c - n + i + 1) for n, c in zip(q_lens, ctx_lens) for i in range(n))
    fn = lambda: paged_attention(q, cache, batch.seq_ids_of_token, batch.q_start, batch.ctx_lens_t,
                                 batch.block_tables, batch.num_seqs, HEAD_DIM ** -0.5, out=out)
    yield f"attention {name}", time_us(fn), kv_bytes + 2 * q.numel() * BF16, flops


def bench_sampling(rows: int):
    logits = torch.randn(rows, VOCAB, device="cuda") * 3
    params = dict(temperature=torch.full((rows,), 0.8, device="cuda"), top_p=torch.full((rows,), 0.95, device="cuda"),
                  top_k=torch.zeros(rows, dtype=torch.int32, device="cuda"), min_p=torch.zeros(rows, device="cuda"),
                  seeds=torch.arange(rows, device="cuda"), positions=torch.arange(rows, device="cuda"))
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    yield f"sample N={rows} V={VOCAB}", time_us(lambda: sample(logits, **params, out=out)), rows * VOCAB * 4, 0


def bench_moe(rows: int):
    """One Qwen3-30B-A3B MoE layer after the router GEMM (128 experts of 2048 x 768, 8 per token). Bytes: the
    experts this batch's routing chose (read once each), x in, out."""
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen).mul(0.02).to(torch.bfloat16)
    down = torch.randn(experts, hidden, inter, device="cuda", generator=gen).mul(0.02).to(torch.bfloat16)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(rows, experts, device="cuda", generator=gen).to(torch.bfloat16)
    used = moe_route(logits, top_k, True)[1].unique().numel()                  # host read: set-up only
    moved = used * 3 * hidden * inter * BF16 + 2 * rows * hidden * BF16
    yield f"fused_moe T={rows} ({used} experts)", time_us(lambda: fused_moe(x, logits, gate_up, down, top_k, True)), \
        moved, 2 * rows * top_k * 3 * hidden * inter


def main() -> None:
    peak = copy_gbps()
    print(f"\ndevice: {torch.cuda.get_device_name()}  copy bandwidth (1 GiB tensor): {peak:.0f} GB/s")
    print(f"{'kernel':<40} {'time_us':>9} {'MB moved':>9} {'GB/s':>7} {'% copy':>7} {'TFLOP/s':>8}")
    runs = [bench_norm_swiglu(1), bench_norm_swiglu(512), bench_rope(512),
            bench_attention("decode b=1 ctx=4096", [1], [4096], 1, 1),
            bench_attention("decode b=64 ctx=2048", [1] * 64, [2048] * 64, 64, 64),
            bench_attention("decode b=256 ctx~1k", [1] * 256, [256 + 7 * i for i in range(256)], 256, 256),
            bench_attention("mixed T=512 (2 chunks, 200 dec)", [1] * 200 + [256, 56],
                            [1000 + 5 * i for i in range(200)] + [1280, 56], 512, 256),
            bench_attention("prefill 1x2048", [2048], [2048], 2048, 1),
            bench_qk_norm_rope(1), bench_qk_norm_rope(16), bench_routing(1), bench_routing(4), bench_routing(16),
            bench_sampling(1), bench_sampling(64), bench_moe(1), bench_moe(8), bench_moe(64), bench_moe(256)]
    for run in runs:
        for name, us, moved, flops in run:
            gbps = moved / us / 1e3
            tflops = f"{flops / us / 1e6:8.1f}" if flops else f"{'':>8}"
            print(f"{name:<40} {us:>9.1f} {moved / 1e6:>9.2f} {gbps:>7.0f} {100 * gbps / peak:>6.0f}% {tflops}")
    print("(prefill and sampling are not bandwidth-bound: their GB/s is context, not a target)")


if __name__ == "__main__":
    main()
