"""RoPE + paged KV-cache write against the model's float32 rotate_half reference; with Qwen3's q/k norms fused in,
against the separate RMSNorm and RoPE kernels, bit for bit."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from gpu_backend.models.rope import apply_rope  # noqa: E402
from kernel_batches import make_batch  # noqa: E402
from kernels.rmsnorm import rmsnorm  # noqa: E402
from kernels.rope_kv import rope_and_cache_kv  # noqa: E402


def _tables(max_pos: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face layout: [max_pos, D] with both halves equal."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


CASES = {  # name: (heads, kv_heads, head_dim, q_lens, ctx_lens, num_tokens, max_seqs)
    "cpu": [(4, 2, 32, [1, 5, 17], [1, 20, 17], 28, 4), (9, 3, 64, [2, 1], [33, 16], 4, 2)],
    "cuda": [(32, 8, 128, [1] * 60 + [300, 100], [int(x) for x in torch.arange(60) * 67 + 1] + [300, 1000], 512, 64),
             (9, 3, 64, [7, 1, 1], [7, 16, 17], 16, 4)],
}


@pytest.mark.parametrize("table_kind", ["full_f32", "half_bf16"])
def test_rope_rotates_q_and_writes_k_v_to_their_slots(device, table_kind):
    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads, head_dim, q_lens, ctx_lens, num_tokens, max_seqs in CASES[device]:
        num_blocks = sum(-(-c // 16) for c in ctx_lens) + 5
        batch = make_batch(q_lens, ctx_lens, num_tokens, max_seqs, max(-(-c // 16) for c in ctx_lens), num_blocks,
                           device, gen)
        # q, k, v as strided views of one fused projection output
        qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
        q, k, v = qkv[:, :heads], qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]
        q0, k0, v0 = q.float().clone(), k.float().clone(), v.clone()
        cos, sin = _tables(max(ctx_lens) + 3, head_dim, 10000.0, device)
        if table_kind == "half_bf16":
            cos, sin = cos[:, : head_dim // 2].to(torch.bfloat16), sin[:, : head_dim // 2].to(torch.bfloat16)
        cache = torch.full((2, num_blocks, 16, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16, device=device)

        rope_and_cache_kv(q, k, v, batch.positions, cos, sin, batch.slot_mapping, cache)

        real = batch.num_real_tokens
        pos = batch.positions[:real].long()
        c, s = cos[pos, : head_dim // 2].float()[:, None], sin[pos, : head_dim // 2].float()[:, None]
        tol = dict(atol=2e-2, rtol=1e-2) if table_kind == "full_f32" else dict(atol=6e-2, rtol=2e-2)
        torch.testing.assert_close(q[:real].float(), apply_rope(q0[:real], c, s), **tol)
        assert torch.equal(k.float(), k0), "k itself must not be modified"
        flat = cache.flatten(1, 2)                                    # [2, slots, KVH, D]
        slots = batch.slot_mapping[:real]
        torch.testing.assert_close(flat[0, slots].float(), apply_rope(k0[:real], c, s), **tol)
        assert torch.equal(flat[1, slots], v0[:real])
        untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=device)
        untouched[slots] = False
        assert flat[:, untouched].isnan().all(), "padding rows or other slots were written"


def test_rope_rejects_bad_tables(device):
    q = torch.zeros(2, 4, 8, dtype=torch.bfloat16, device=device)
    k = v = torch.zeros(2, 2, 8, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(2, 3, 16, 2, 8, dtype=torch.bfloat16, device=device)
    pos = torch.zeros(2, dtype=torch.int32, device=device)
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    bad = torch.zeros(10, 6, device=device)
    with pytest.raises(ValueError, match="cos"):
        rope_and_cache_kv(q, k, v, pos, bad, bad, slots, cache)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_and_cache_kv(q, k, v, pos, bad[:, :8], bad[:, :8], slots.int(), cache)


def _qk_norm_then_rope(q, k, v, positions, cos, sin, slots, cache, q_norm, k_norm, eps):
    """The launches the fused kernel replaces: rmsnorm over each head row of q and k, then rope_kv."""
    q_normed = rmsnorm(q.reshape(-1, q.shape[-1]), q_norm, eps).view(q.shape)
    k_normed = rmsnorm(k.reshape(-1, k.shape[-1]), k_norm, eps).view(k.shape)
    return rope_and_cache_kv(q_normed, k_normed, v, positions, cos, sin, slots, cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_fused_into_rope_matches_the_separate_kernels_bit_for_bit(device, dtype):
    """Qwen3's per-head q/k RMSNorm inside the RoPE + KV-write kernel: q, the cache's K and V equal what
    rmsnorm(q), rmsnorm(k) then rope_and_cache_kv give, bit for bit, padding rows (slot -1) included."""
    gen = torch.Generator().manual_seed(11)
    for heads, kv_heads, head_dim, q_lens, ctx_lens, num_tokens, max_seqs in CASES[device]:
        num_blocks = sum(-(-c // 16) for c in ctx_lens) + 5
        batch = make_batch(q_lens, ctx_lens, num_tokens, max_seqs, max(-(-c // 16) for c in ctx_lens), num_blocks,
                           device, gen)
        qkv = (torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=gen) * 3).to(device, dtype)
        q, k, v = qkv[:, :heads], qkv[:, heads: heads + kv_heads], qkv[:, heads + kv_heads:]
        q_norm, k_norm = (torch.rand(head_dim, generator=gen).add(0.5).to(device, dtype) for _ in range(2))
        cos, sin = _tables(max(ctx_lens) + 3, head_dim, 1e6, device)
        want_cache = torch.full((2, num_blocks, 16, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
        got_cache = want_cache.clone()
        k0 = k.clone()
        want_q = _qk_norm_then_rope(q, k, v, batch.positions, cos, sin, batch.slot_mapping, want_cache,
                                    q_norm, k_norm, 1e-6)

        got_q = rope_and_cache_kv(q, k, v, batch.positions, cos, sin, batch.slot_mapping, got_cache,
                                  q_norm=q_norm, k_norm=k_norm, eps=1e-6)

        assert got_q.data_ptr() == q.data_ptr(), "q is normalised and rotated in place"
        assert torch.equal(got_q, want_q), "q differs from rmsnorm + rope"
        assert torch.equal(got_cache.isnan(), want_cache.isnan()), "other slots or padding rows were written"
        assert torch.equal(got_cache.nan_to_num(), want_cache.nan_to_num()), "cached K or V differs"
        assert torch.equal(k, k0), "k itself must not be modified"


def test_qk_norm_needs_both_weights(device):
    q = torch.zeros(2, 4, 8, dtype=torch.bfloat16, device=device)
    k = v = torch.zeros(2, 2, 8, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(2, 3, 16, 2, 8, dtype=torch.bfloat16, device=device)
    pos, slots = torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(2, dtype=torch.int64, device=device)
    table = torch.zeros(10, 8, device=device)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rope_and_cache_kv(q, k, v, pos, table, table, slots, cache, q_norm=torch.ones(8, device=device))
    with pytest.raises(ValueError, match="k_norm"):
        rope_and_cache_kv(q, k, v, pos, table, table, slots, cache, q_norm=torch.ones(8, device=device),
                          k_norm=torch.ones(6, device=device))
