"""Paged attention over mixed prefill/decode batches against a float32 per-sequence reference."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from kernel_batches import make_batch, reference_attention  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402

# name: (heads, kv_heads, head_dim, q_lens, ctx_lens, num_tokens (bucket T), max_seqs (bucket S))
SMALL = {
    # prefill chunks after cached context, a whole-prompt prefill, decodes at 1 and across block edges
    "mixed": (4, 2, 32, [1, 20, 16, 1, 3], [1, 45, 16, 33, 17], 48, 8),
    "decode": (4, 2, 32, [1] * 6, [1, 15, 16, 17, 32, 64], 8, 8),
    "group3_d64": (6, 2, 64, [5, 1, 9], [5, 31, 40], 16, 4),
}
_DECODE_CTX = [1, 16, 17, 255, 256, 1000, 2047, 4000]
LARGE = {
    "llama8b_mixed": (32, 8, 128, [1] * 40 + [300, 64, 17, 1], [int(x) % 4000 + 1 for x in range(7, 40 * 97, 97)]
                      + [300, 1100, 17, 2], 512, 64),
    "llama8b_decode_b1": (32, 8, 128, [1], [4000], 1, 1),
    "llama8b_decode_b8": (32, 8, 128, [1] * 8, _DECODE_CTX, 8, 8),
    "llama8b_decode_b64": (32, 8, 128, [1] * 60, [int(x) % 4096 + 1 for x in range(13, 60 * 331, 331)], 64, 64),
    "llama8b_prefill_1k": (32, 8, 128, [1024], [1024], 1024, 4),
    "smollm_mixed": (9, 3, 64, [33, 1, 1, 7], [70, 1, 500, 7], 48, 8),
}


def _run(device, heads, kv_heads, head_dim, q_lens, ctx_lens, num_tokens, max_seqs, seed=0,
         cache_dtype=torch.bfloat16, **kw):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // 16) for c in ctx_lens) + 1
    num_blocks = sum(-(-c // 16) for c in ctx_lens) + 7
    batch = make_batch(q_lens, ctx_lens, num_tokens, max_seqs, max_blocks, num_blocks, device, gen)
    cache = torch.randn(2, num_blocks, 16, kv_heads, head_dim, generator=gen).to(device, cache_dtype)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    q = qkv[:, :heads]                                            # strided, like a view of the qkv GEMM
    out = torch.full((num_tokens, heads, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    scale = head_dim ** -0.5
    paged_attention(q, cache, batch.seq_ids_of_token, batch.q_start, batch.ctx_lens_t, batch.block_tables,
                    batch.num_seqs, scale, out=out, **kw)
    return out, reference_attention(q, cache, batch, scale), batch


def _check(out, ref, batch):
    real = batch.num_real_tokens
    assert not out[:real].isnan().any(), "a live row was not written"
    torch.testing.assert_close(out[:real].float(), ref, atol=1.5e-2, rtol=2e-2)
    assert (out[real:] == 0).all(), "padding rows must be zeros"


@pytest.mark.parametrize("case", sorted(SMALL))
@pytest.mark.parametrize("num_splits,block_n,split_keys", [(1, 16, 256), (3, 32, 16), (4, 16, 32), (None, None, 256)],
                         ids=["nosplit", "split3", "split4_mixed", "auto"])
def test_small_batches(device, case, num_splits, block_n, split_keys):
    """split_keys small: long tiles split (partials + reduce) while short ones write directly."""
    _check(*_run(device, *SMALL[case], num_splits=num_splits, block_n=block_n, block_m=16, split_keys=split_keys))


@pytest.mark.parametrize("case", sorted(SMALL))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache(device, case, num_splits):
    """An FP8 cache (--kv-cache-dtype fp8): its values widened, the dots in float16; against the float32 reference
    over the same (widened) cache, split or not."""
    _check(*_run(device, *SMALL[case], num_splits=num_splits, block_m=16, split_keys=16,
                 cache_dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("case", sorted(LARGE))
def test_model_shaped_batches(device, case):
    if device == "cpu":
        pytest.skip("model-sized shapes run on the GPU only (too slow for the interpreter)")
    _check(*_run(device, *LARGE[case]))


@pytest.mark.parametrize("num_splits", [1, 8])
def test_long_decode_beside_a_prefill_chunk(device, num_splits):
    """One long decode next to a prefill chunk in a prefill-heavy bucket: split or not, same answer."""
    if device == "cpu":
        pytest.skip("model-sized shapes run on the GPU only (too slow for the interpreter)")
    _check(*_run(device, 32, 8, 128, [1, 200, 1], [20000, 456, 3], 256, 4, num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_no_live_sequences_writes_only_zeros(device, num_splits):
    heads, kv_heads, head_dim = 4, 2, 32
    out, _, batch = _run(device, heads, kv_heads, head_dim, [3], [3], 8, 2, num_splits=num_splits, split_keys=16)
    batch.num_seqs.zero_()
    out.fill_(float("nan"))
    cache = torch.zeros(2, 10, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    q = torch.randn(8, heads, head_dim, device=device).to(torch.bfloat16)
    paged_attention(q, cache, batch.seq_ids_of_token, batch.q_start, batch.ctx_lens_t, batch.block_tables,
                    batch.num_seqs, 0.1, out=out, num_splits=num_splits, split_keys=16)
    assert (out == 0).all()


def test_rejects_bad_metadata(device):
    q = torch.zeros(4, 4, 32, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(2, 3, 16, 2, 32, dtype=torch.bfloat16, device=device)
    i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, cache, i32(4), i32(3), i32(2), i32(3, 2), i32(1), 0.1)
    with pytest.raises(ValueError, match="seq_ids_of_token"):
        paged_attention(q, cache, i32(4).long(), i32(3), i32(2), i32(2, 2), i32(1), 0.1)
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(q[:, :3], cache, i32(4), i32(3), i32(2), i32(2, 2), i32(1), 0.1)


@pytest.mark.parametrize("case", ["mixed", "decode"])
def test_the_reduce_reads_only_what_this_launch_wrote(device, case, monkeypatch):
    """The reduce merges by the log-sum-exp slots alone (+inf: nothing to merge, -inf: a split without keys), so
    every slot it reads must be this launch's: partial buffers that start as NaN (stale memory at its worst) change
    nothing, with tiles of one split, of several, and padding side by side."""
    empty = torch.empty

    def nan_partials(*shape, dtype=None, **kw):
        t = empty(*shape, dtype=dtype, **kw)
        return t.fill_(float("nan")) if dtype == torch.float32 else t
    monkeypatch.setattr(torch, "empty", nan_partials)
    out, ref, batch = _run(device, *SMALL[case], num_splits=4, block_n=16, block_m=16, split_keys=16)
    _check(out, ref, batch)
    batch.num_seqs.zero_()                                  # every row padding: slot 0 alone says "nothing to merge"
    q = torch.randn(out.shape, device=device).to(torch.bfloat16)
    cache = torch.zeros(2, 16, 16, SMALL[case][1], SMALL[case][2], dtype=torch.bfloat16, device=device)
    paged_attention(q, cache, batch.seq_ids_of_token, batch.q_start, batch.ctx_lens_t, batch.block_tables,
                    batch.num_seqs, 0.1, out=out, num_splits=4, block_n=16, block_m=16, split_keys=16)
    assert (out == 0).all()


def _rope_tables(max_pos: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)          # [max_pos, D/2]


# (heads, kv_heads, head_dim, ctx_len, max_seqs, qwen3 norms, split_keys): one token, as a batch-1 step has it
ONE_TOKEN = {
    "cpu": [(4, 2, 32, 1, 1, False, 16), (4, 2, 32, 45, 1, True, 16), (6, 2, 64, 33, 2, True, 256),
            (4, 2, 32, 40, 1, False, 256)],
    "cuda": [(32, 8, 128, 1, 1, False, 64), (32, 8, 128, 4000, 1, False, 64), (32, 4, 128, 700, 1, True, 64),
             (32, 4, 128, 17, 2, True, 256), (40, 8, 128, 3000, 1, False, 256)],
}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_one_token_rotates_and_writes_its_kv_in_the_tile_kernel(device, cache_dtype):
    """At one token `rope` moves kernels/rope_kv.py's work into the tile kernel (rotation, Qwen3's q/k norms, the
    K/V write by the last split's program): the output and the cache match rope_and_cache_kv then paged_attention
    (up to the norm's reduction order: one bf16 rounding), nothing else in the cache is written, q is not modified,
    and a padding token (slot -1, no live sequence) writes zeros and no cache slot."""
    from kernels.rope_kv import rope_and_cache_kv
    gen = torch.Generator().manual_seed(5)
    for heads, kv_heads, head_dim, ctx, max_seqs, norms, split_keys in ONE_TOKEN[device]:
        max_blocks = -(-ctx // 16) + 1
        num_blocks = max_blocks + 5
        batch = make_batch([1], [ctx], 1, max_seqs, max_blocks, num_blocks, device, gen)
        cache = torch.randn(2, num_blocks, 16, kv_heads, head_dim, generator=gen).to(device, cache_dtype)
        qkv = (torch.randn(1, heads + 2 * kv_heads, head_dim, generator=gen) * 3).to(device, torch.bfloat16)
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        cos, sin = _rope_tables(ctx + 5, head_dim, device)
        rope = dict(k=k, v=v, positions=batch.positions, cos=cos, sin=sin, slot_mapping=batch.slot_mapping)
        if norms:
            rope.update(q_norm=torch.rand(head_dim, generator=gen).add(0.5).to(device, torch.bfloat16),
                        k_norm=torch.rand(head_dim, generator=gen).add(0.5).to(device, torch.bfloat16), eps=1e-6)
        meta = (batch.seq_ids_of_token, batch.q_start, batch.ctx_lens_t, batch.block_tables, batch.num_seqs)
        want_cache, q_before = cache.clone(), q.clone()
        q_rot = rope_and_cache_kv(q.clone(), layer_cache=want_cache, **rope)
        want = paged_attention(q_rot, want_cache, *meta, head_dim ** -0.5, split_keys=split_keys)

        got = paged_attention(q, cache, *meta, head_dim ** -0.5, split_keys=split_keys, rope=rope)

        assert torch.equal(q, q_before), "q itself is rotated in registers, not in place"
        slot = int(batch.slot_mapping[0])
        flat_got, flat_want = (c.view(2, -1, kv_heads, head_dim) for c in (cache, want_cache))
        others = torch.ones(flat_got.shape[1], dtype=torch.bool)
        others[slot] = False
        assert torch.equal(flat_got[:, others].float(), flat_want[:, others].float()), "another slot was written"
        assert torch.equal(flat_got[1, slot].float(), flat_want[1, slot].float()), "V differs"
        torch.testing.assert_close(flat_got[0, slot].float(), flat_want[0, slot].float(), atol=0,
                                   rtol=2 ** -7 if cache_dtype == torch.bfloat16 else 2 ** -3)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

        batch.num_seqs.zero_()
        batch.seq_ids_of_token.fill_(-1)
        batch.slot_mapping.fill_(-1)
        before = cache.clone()
        out = paged_attention(q, cache, *meta, head_dim ** -0.5, split_keys=split_keys, rope=rope)
        assert (out == 0).all() and torch.equal(cache.float(), before.float()), "padding wrote a slot or output"


def test_one_split_when_the_sequences_fill_the_gpu():
    """A bucket whose (sequence, KV head) programs are two an SM or more takes one split (no partials, no reduce:
    bench/attn_probe.py measured it 1.8x faster at 256 decodes), whatever the context; fewer sequences split."""
    from kernels.paged_attention import _config
    many = _config(256, 256, 32, 8, 128, 4096, 132, None, None, None)
    few = _config(8, 8, 32, 8, 128, 4096, 132, None, None, None)
    assert many["num_splits"] == 1 and few["num_splits"] > 1
    assert _config(64, 64, 32, 8, 128, 4096, 132, None, None, None)["num_splits"] == 1   # 512 programs, 132 SMs
    assert _config(64, 64, 32, 4, 128, 4096, 132, None, None, None)["num_splits"] > 1    # 256: under two an SM
