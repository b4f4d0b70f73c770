"""The fused mixture of experts against the plain torch op (gpu_backend/models/moe.py): routing, the counting
sort by expert, the grouped expert GEMMs at M = 1, 8, 64, 256 tokens with experts that get no token, and
one CUDA graph replayed over new inputs; the one-launch decode routing against the three launches, bit for bit."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from gpu_backend.models.moe import expert_mlp, moe_reference, route  # noqa: E402
from kernels.moe import (ExpertTiles, block_m, expert_tiles, fused_moe, max_row_blocks, moe_align, moe_block_table,  # noqa: E402
                         moe_experts, moe_one_token, moe_route, moe_route_decode, route_decode_pays,
                         route_in_one_launch)


def _experts(num_experts, hidden, inter, device, gen, dtype=torch.bfloat16):
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen).mul(hidden ** -0.5).to(device, dtype)
    down = torch.randn(num_experts, hidden, inter, generator=gen).mul(inter ** -0.5).to(device, dtype)
    return gate_up, down


def _reference_with_routing(x, weights, ids, gate_up, down):
    """Token by token, choice by choice: sum_j w_j * expert_{id_j}(x_t), float32 sum, rounded once."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += expert_mlp(x[t:t + 1], gate_up[e], down[e])[0].float() * weights[t, j]
    return out.to(x.dtype)


def _clear_rows(x, router, top_k):
    """Rows whose k-th and (k+1)-th router probabilities are apart: a near-tie may fall either way between
    two softmax implementations, and then the rows legitimately differ."""
    probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1).sort(dim=-1, descending=True).values
    if probs.shape[1] == top_k:
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    return (probs[:, top_k - 1] - probs[:, top_k]) > 1e-4


def _token_counts(device):
    return (1, 3, 9) if device == "cpu" else (1, 8, 64, 256)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_softmax_topk(device, renormalize):
    gen = torch.Generator().manual_seed(0)
    for num_experts, top_k in ((8, 2), (128, 8), (6, 3)):
        # distinct logits far apart: no near-ties, so the chosen set is unambiguous
        logits = torch.stack([torch.randperm(num_experts, generator=gen).float() * 0.37 for _ in range(11)])
        logits = logits.to(device, torch.bfloat16)
        weights, ids = moe_route(logits, top_k, renormalize)
        want_w, want_ids = route(logits.float().cpu(), torch.eye(num_experts), top_k, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids.cpu().long(), want_ids)
        torch.testing.assert_close(weights.cpu(), want_w, atol=1e-6, rtol=1e-5)


def test_align_is_a_stable_counting_sort_by_expert(device):
    gen = torch.Generator().manual_seed(1)
    num_experts, top_k = 16, 4
    for num_tokens in (1, 7, 300):                         # 300 * 4 pairs: more than one 1024-pair chunk
        ids = torch.stack([torch.randperm(num_experts - 5, generator=gen)[:top_k] for _ in range(num_tokens)])
        ids = (ids + 5).to(device, torch.int32)            # experts 0..4 get nothing
        sorted_pairs, counts, offsets = moe_align(ids, num_experts)
        flat = ids.flatten().cpu().long()
        want_counts = torch.bincount(flat, minlength=num_experts)
        assert torch.equal(counts.cpu().long(), want_counts) and counts[:5].sum() == 0
        assert torch.equal(offsets.cpu().long(), torch.cumsum(want_counts, 0) - want_counts)
        assert torch.equal(sorted_pairs.cpu().long(), torch.sort(flat, stable=True).indices)


def test_block_table_lists_the_row_blocks_that_hold_pairs(device):
    gen = torch.Generator().manual_seed(5)
    for num_experts, top_k, num_tokens, bm in ((128, 8, 1, 16), (16, 4, 37, 16), (8, 2, 300, 64), (6, 3, 5, 16)):
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        ids = ids.to(device, torch.int32)
        _, counts, offsets = moe_align(ids, num_experts)
        max_blocks = max_row_blocks(num_tokens, top_k, num_experts, bm)
        expert, start, end = (t.cpu().tolist() for t in moe_block_table(counts, offsets, bm, max_blocks))
        want = [(e, o + i, o + c) for e, (c, o) in enumerate(zip(counts.tolist(), offsets.tolist()))
                for i in range(0, c, bm)]
        assert len(want) <= max_blocks and len(expert) == max_blocks
        assert list(zip(expert, start, end))[:len(want)] == want
        assert all(e == -1 for e in expert[len(want):])
    assert max_row_blocks(1, 8, 128, 16) == 8 and max_row_blocks(256, 8, 128, 16) == 256
    assert max_row_blocks(2, 2, 8, 64) == 4 and max_row_blocks(512, 2, 8, 64) == 1024 // 64 + 8


def test_experts_match_the_torch_op_with_empty_experts(device):
    gen = torch.Generator().manual_seed(2)
    num_experts, top_k, hidden, inter = 8, 2, 96, 80       # widths not multiples of the 64-wide tiles
    gate_up, down = _experts(num_experts, hidden, inter, device, gen)
    for num_tokens in _token_counts(device):
        x = torch.randn(num_tokens, hidden, generator=gen).to(device, torch.bfloat16)
        # only experts 1, 3, 4 and 6 are ever chosen: the other four get no pair at any M
        pool = torch.tensor([1, 3, 4, 6])
        ids = torch.stack([pool[torch.randperm(4, generator=gen)[:top_k]] for _ in range(num_tokens)])
        weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
        got = moe_experts(x, weights, ids.to(device, torch.int32), gate_up, down)
        want = _reference_with_routing(x, weights, ids, gate_up, down)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fused_moe_matches_the_torch_op(device):
    gen = torch.Generator().manual_seed(3)
    num_experts, top_k, hidden, inter = (16, 4, 64, 48) if device == "cpu" else (64, 8, 512, 320)
    gate_up, down = _experts(num_experts, hidden, inter, device, gen)
    router = torch.randn(num_experts, hidden, generator=gen).mul(hidden ** -0.5).to(device, torch.bfloat16)
    for num_tokens in _token_counts(device):
        x = torch.randn(num_tokens, hidden, generator=gen).to(device, torch.bfloat16)
        logits = torch.nn.functional.linear(x, router)
        got = fused_moe(x, logits, gate_up, down, top_k, True)
        want = moe_reference(x, router, gate_up, down, top_k, True)
        used = route(x, router, top_k, True)[1].unique().numel()
        assert num_tokens > 8 or used < num_experts        # small batches leave experts without tokens
        clear = _clear_rows(x, router, top_k)
        assert clear.float().mean() > 0.8
        torch.testing.assert_close(got[clear].float(), want[clear].float(), atol=3e-2, rtol=3e-2)


def test_block_m_follows_the_pairs_per_expert():
    assert block_m(8, 128) == 16 and block_m(2048, 128) == 16 and block_m(4096, 128) == 32
    assert block_m(512, 8) == 64
    assert expert_tiles(16) == ExpertTiles(64, 128, 4, 4) and expert_tiles(64).block_n == 64
    assert "num_stages" not in ExpertTiles(32).launch() and ExpertTiles(32, 64, 4, 6).launch()["num_stages"] == 6


def test_moe_rejects_bad_arguments(device):
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=device)
    gate_up = torch.zeros(4, 2 * 16, 32, dtype=torch.bfloat16, device=device)
    down = torch.zeros(4, 32, 16, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=device)
    weights = torch.zeros(2, 2, device=device)
    with pytest.raises(ValueError, match="experts_down"):
        moe_experts(x, weights, ids, gate_up, down[:, :16])
    with pytest.raises(ValueError, match="ids"):
        moe_experts(x, weights, ids.long(), gate_up, down)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.zeros(2, 4, device=device), 5, True)


def test_fused_moe_decode_path_equals_the_three_launch_path(device):
    """fused_moe at decode sizes (routing in one launch) gives the same bits as moe_route then moe_experts."""
    gen = torch.Generator().manual_seed(7)
    num_experts, top_k, hidden, inter = (16, 4, 64, 48) if device == "cpu" else (128, 8, 512, 320)
    gate_up, down = _experts(num_experts, hidden, inter, device, gen)
    for num_tokens in (1, 5, 16):
        assert route_in_one_launch(num_tokens, top_k, num_experts)
        x = torch.randn(num_tokens, hidden, generator=gen).to(device, torch.bfloat16)
        logits = torch.randn(num_tokens, num_experts, generator=gen).to(device, torch.bfloat16)
        want = moe_experts(x, *moe_route(logits, top_k, True), gate_up, down)
        assert torch.equal(fused_moe(x, logits, gate_up, down, top_k, True), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here; CUDA graphs need one")
@pytest.mark.parametrize("num_tokens", [16, 64])          # 16: routing in one launch; 64: three launches
def test_fused_moe_replays_in_a_cuda_graph(num_tokens):
    gen = torch.Generator().manual_seed(4)
    num_experts, top_k, hidden, inter = 128, 8, 256, 192
    gate_up, down = _experts(num_experts, hidden, inter, "cuda", gen)
    router = torch.randn(num_experts, hidden, generator=gen).mul(hidden ** -0.5).to("cuda", torch.bfloat16)
    x = torch.randn(num_tokens, hidden, generator=gen).to("cuda", torch.bfloat16)

    def step():
        return fused_moe(x, torch.nn.functional.linear(x, router), gate_up, down, top_k, True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                             # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    for seed in range(3):                                  # new inputs route to other experts
        x.copy_(torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(10 + seed)).to("cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step(), atol=0, rtol=0)
        want = moe_reference(x, router, gate_up, down, top_k, True)
        clear = _clear_rows(x, router, top_k)
        torch.testing.assert_close(out[clear].float(), want[clear].float(), atol=3e-2, rtol=3e-2)


def _logits_with_ties(num_tokens, num_experts, gen):
    """Router logits on a coarse grid (many exact ties between experts), a few rows all equal."""
    logits = torch.randint(0, 6, (num_tokens, num_experts), generator=gen).float() * 0.75
    logits[::5] = 1.0
    return logits


@pytest.mark.parametrize("renormalize", [True, False])
def test_decode_routing_in_one_launch_matches_the_three_kernels_bit_for_bit(device, renormalize):
    """moe_route_decode (one program) against moe_route + moe_align + moe_block_table: every output equal, for
    1..16 tokens, random and tied logits, experts with no pairs, bf16 and float32 logits."""
    gen = torch.Generator().manual_seed(6)
    # the interpreter runs the 128 align programs one by one: fewer token counts there
    token_counts = range(1, 17) if device == "cuda" else (1, 2, 5, 16)
    for num_experts, top_k in ((128, 8), (8, 2), (6, 3)):
        for num_tokens in token_counts:
            assert route_in_one_launch(num_tokens, top_k, num_experts)
            ties = _logits_with_ties(num_tokens, num_experts, gen)
            for logits in (torch.randn(num_tokens, num_experts, generator=gen).to(torch.bfloat16), ties):
                logits = logits.to(device)
                weights, ids = moe_route(logits, top_k, renormalize)
                sorted_pairs, counts, offsets = moe_align(ids, num_experts)
                bm = block_m(num_tokens * top_k, num_experts)
                max_blocks = max_row_blocks(num_tokens, top_k, num_experts, bm)
                want = (weights, ids, sorted_pairs, counts, offsets, *moe_block_table(counts, offsets, bm, max_blocks))
                got = moe_route_decode(logits, top_k, renormalize, bm, max_blocks)
                names = ("weights", "ids", "sorted", "counts", "offsets", "block_expert", "block_start", "block_end")
                for name, g, w in zip(names, got, want):
                    assert g.dtype == w.dtype and torch.equal(g, w), f"{name} at T={num_tokens}, E={num_experts}"
            assert (counts == 0).any() or num_tokens * top_k >= num_experts


def test_one_launch_routing_bounds():
    assert route_in_one_launch(1, 8, 128) and route_in_one_launch(16, 8, 128) and not route_in_one_launch(17, 8, 128)
    assert route_in_one_launch(64, 2, 8) and not route_in_one_launch(0, 8, 128)
    assert not route_in_one_launch(16, 8, 512)              # 16 x 512 logits: one program would be too wide
    # fused_moe takes the one launch only where it was faster on an H100: up to 32 padded pairs
    assert route_decode_pays(1, 8, 128) and route_decode_pays(4, 8, 128) and not route_decode_pays(5, 8, 128)
    assert route_decode_pays(16, 2, 8) and not route_decode_pays(17, 2, 8) and not route_decode_pays(16, 2, 512)
    with pytest.raises(ValueError, match="moe_route_decode takes at most 128"):
        moe_route_decode(torch.zeros(32, 128), 8, True, 16, 64)


@pytest.mark.parametrize("renormalize", [True, False])
def test_one_token_path_matches_the_batched_kernels(device, renormalize):
    """moe_one_token (router, routing, experts in three launches, GEMVs) against fused_moe after the router's
    F.linear: the same experts chosen with the same weights, outputs within bf16 rounding; called again on new
    inputs (the completion counter resets itself), with experts that get no token."""
    gen = torch.Generator().manual_seed(11)
    num_experts, top_k, hidden, inter = (16, 4, 64, 48) if device == "cpu" else (128, 8, 2048, 768)
    gate_up, down = _experts(num_experts, hidden, inter, device, gen)
    router = torch.randn(num_experts, hidden, generator=gen).mul(hidden ** -0.5).to(device, torch.bfloat16)
    checked = 0
    for _ in range(4):
        x = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16)
        if not _clear_rows(x, router, top_k)[0]:
            continue                                      # a near-tie may route either way: not comparable
        checked += 1
        got = moe_one_token(x, router, gate_up, down, top_k, renormalize)
        assert torch.equal(moe_one_token(x, router, gate_up, down, top_k, renormalize), got)  # deterministic
        # the router's tile (bench/moe_probe.py sweeps it): the same experts, its logits summed in another order
        other = moe_one_token(x, router, gate_up, down, top_k, renormalize, router_tile=(min(hidden, 512), 4))
        torch.testing.assert_close(other.float(), got.float(), atol=2e-2, rtol=2e-2)
        want = fused_moe(x, torch.nn.functional.linear(x, router), gate_up, down, top_k, renormalize)
        ref = moe_reference(x, router, gate_up, down, top_k, renormalize)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert checked >= 2


def test_one_token_path_with_the_norm_fused_matches_norm_then_moe(device):
    """norm=(residual, weight, eps): the router's launch normalises x + residual (every program) and writes the
    sum to residual_out; the result is moe_one_token of the add + RMSNorm kernel's output, bit for bit where the
    two norms agree (the same row reduction) and within bf16 rounding anyway."""
    from kernels.rmsnorm import add_rmsnorm, rmsnorm

    gen = torch.Generator().manual_seed(12)
    num_experts, top_k, hidden, inter = (16, 4, 64, 48) if device == "cpu" else (128, 8, 2048, 768)
    gate_up, down = _experts(num_experts, hidden, inter, device, gen)
    router = torch.randn(num_experts, hidden, generator=gen).mul(hidden ** -0.5).to(device, torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, torch.bfloat16)
    checked = 0
    for i in range(6):
        x = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16)
        res = torch.randn(1, hidden, generator=gen).to(device, torch.bfloat16) if i % 2 else None
        normed, summed = add_rmsnorm(x, res, nw, 1e-6) if res is not None else (rmsnorm(x, nw, 1e-6), None)
        if not _clear_rows(normed, router, top_k)[0]:
            continue
        checked += 1
        res_out = torch.full_like(x, float("nan")) if res is not None else None
        got = moe_one_token(x, router, gate_up, down, top_k, True, norm=(res, nw, 1e-6), residual_out=res_out)
        want = moe_one_token(normed, router, gate_up, down, top_k, True)
        if res is not None:
            assert torch.equal(res_out, summed)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert checked >= 2


def test_one_token_path_rejects_bad_arguments(device):
    x = torch.zeros(1, 32, dtype=torch.bfloat16, device=device)
    router = torch.zeros(4, 32, dtype=torch.bfloat16, device=device)
    gate_up = torch.zeros(4, 2 * 16, 32, dtype=torch.bfloat16, device=device)
    down = torch.zeros(4, 32, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="x must have shape"):
        moe_one_token(torch.zeros(2, 32, dtype=torch.bfloat16, device=device), router, gate_up, down, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_one_token(x, router, gate_up, down, 5, True)
    with pytest.raises(ValueError, match="experts_down"):
        moe_one_token(x, router, gate_up, down[:, :16], 2, True)
