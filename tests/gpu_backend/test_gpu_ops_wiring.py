"""The GPU runner's ops (engine/gpu_ops.TritonOps) wired to the step buffer, checked without a GPU: the Triton
kernels are swapped for float32 torch stand-ins with the same signatures and contracts (attention is handed
rope_kv's arguments: it rotates q and writes the rotated k only to the cache, then reads the cache through the
step buffer's seq ids, query offsets, context lengths and block tables; padding rows have KV slot -1 and seq id
-1).

Each step of a real engine run (native scheduler, C fill) goes through the one forward twice: with the torch
ops (what the cpu engine runs) and with TritonOps over the same step buffer and a copy of the KV cache; the
hidden states of every real row must agree. The kernels themselves are tested against torch on a GPU
(tests/kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_backend.engine.cpu_runner import CpuRunner
from gpu_backend.engine.gpu_ops import TritonOps
from gpu_backend.models import LlamaModel
from gpu_backend.models.llama_forward import decoder_layers
from gpu_backend.models.moe import expert_mlp
from gpu_backend.models.rope import rope_inv_freq
from gpu_backend.models.torch_ops import TorchOps, rms_norm
from protocols.ring import RequestSpec
from conftest_models import tiny_cfg
from test_engine_loop import CONTEXT_LEN, Engine, _prompts, engine, model  # noqa: F401  (fixtures)


def _rotate(x, cos, sin):  # x [T, heads, D]; cos, sin [T, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rope_kv(q, k, v, positions, cos, sin, slot_mapping, layer_cache, q_norm=None, k_norm=None, eps=1e-6):
    if q_norm is not None:  # Qwen3: each head row normalised first, q in place like the kernel
        q.copy_(rms_norm(q, q_norm, eps))
        k = rms_norm(k, k_norm, eps)
    c, s = cos[positions], sin[positions]
    q.copy_(_rotate(q, c, s))
    real = slot_mapping >= 0
    kvh, d = layer_cache.shape[-2:]
    layer_cache[0].view(-1, kvh, d)[slot_mapping[real]] = _rotate(k, c, s)[real]
    layer_cache[1].view(-1, kvh, d)[slot_mapping[real]] = v[real]
    return q


def _attn(q, layer_cache, seq_ids, q_start, ctx_lens, block_tables, num_seqs, scale, out, split_keys, rope):
    _rope_kv(q, layer_cache=layer_cache, **rope)  # the kernel's contract: rotate q, write K/V, then attend
    out.zero_()
    bs = layer_cache.shape[2]
    for i in range(int(num_seqs[0])):
        lo, hi, ctx = int(q_start[i]), int(q_start[i + 1]), int(ctx_lens[i])
        blocks = block_tables[i, : -(-ctx // bs)].long()
        k = layer_cache[0][blocks].flatten(0, 1)[:ctx].transpose(0, 1)         # [KVH, ctx, D]
        v = layer_cache[1][blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        qi = q[lo:hi].transpose(0, 1)                                           # [H, n, D]
        allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - (hi - lo), ctx)[:, None]
        o = F.scaled_dot_product_attention(qi[None], k[None], v[None], attn_mask=allowed, scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def _moe(x, logits, gate_up, down, top_k, renormalize):
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    rows = [sum(w * expert_mlp(x[t:t + 1], gate_up[e], down[e])[0] for w, e in zip(weights[t], ids[t].tolist()))
            for t in range(x.shape[0])]
    return torch.stack(rows)


def _swiglu(gate_up):
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def _normed(x, norm, residual_out):  # kernels/gemv.py's `norm` argument: the GEMV's input, x + residual written
    if norm is None:
        return x
    res, w, eps = norm
    if res is None:
        return rms_norm(x, w, eps)
    residual_out.copy_(res + x)
    return rms_norm(residual_out, w, eps)


def _gemv(x, w, b, config, norm=None, residual_out=None, swiglu=False):
    y = F.linear(_normed(x, norm, residual_out), w, b)
    return _swiglu(y) if swiglu else y


def _moe_one_token(x, router, gate_up, down, top_k, renormalize, norm=None, residual_out=None, evict_first=False):
    x = _normed(x, norm, residual_out)
    return _moe(x, F.linear(x, router), gate_up, down, top_k, renormalize)


KERNELS = dict(moe=_moe, moe_one_token=_moe_one_token,
               rmsnorm=rms_norm, add_rmsnorm=lambda x, r, w, eps: (rms_norm(r + x, w, eps), r + x),
               attn=_attn, swiglu=_swiglu, gemv=_gemv)


class TwinRunner(CpuRunner):
    """A CpuRunner that also runs each step with TritonOps (torch stand-ins) and records the difference."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        freqs = torch.arange(CONTEXT_LEN, dtype=torch.float32)[:, None] * rope_inv_freq(self.cfg)[None, :]
        self.rope = (freqs.cos(), freqs.sin())                                 # [context_len, D/2]
        self.max_diff, self.rows_compared = 0.0, 0

    @torch.inference_mode()
    def run(self, step):
        n, bucket, cfg, w = step.num_tokens, step.bucket, self.cfg, self.model.decoder_weights()
        scale = cfg.head_dim ** -0.5
        ops = TritonOps(KERNELS, self.bufs.d, bucket, min(bucket, self.step_geometry.max_seqs), self.rope,
                        self.kv_cache.clone(), torch.empty(bucket, cfg.num_heads, cfg.head_dim), scale,
                        {"qkv": (8, 512, 4)})
        x, res = decoder_layers(ops, w, cfg, self.bufs.d["input_ids"][:bucket].long())  # padded to the bucket
        reference = TorchOps(self._attn_batch(step), torch.from_numpy(self.bufs.h["positions"][:n]), self.model.rotary,
                             self.kv_cache.clone(), scale, torch.float32)
        xr, rr = decoder_layers(reference, w, cfg, torch.from_numpy(self.bufs.h["input_ids"][:n]).long())
        self.max_diff = max(self.max_diff, float(((x + res)[:n] - (xr + rr)).abs().max()))
        self.rows_compared += n
        return super().run(step)


def test_triton_ops_wiring_matches_the_torch_ops_step_by_step(model, engine):
    e = engine(num_blocks=24, budget=16, max_seqs=4, runner_cls=TwinRunner)
    for i, p in enumerate(_prompts(5, model[0].vocab_size, seed=7)):
        e.submit(RequestSpec(i, p, 10, temperature=0.0, ignore_eos=True))
    e.run_until_done()
    print(f"{e.runner.rows_compared} token rows compared, max |diff| {e.runner.max_diff:.2e}")
    assert e.runner.rows_compared > 50 and e.runner.max_diff < 1e-4


def test_triton_ops_wiring_of_a_moe_model_with_qk_norm():
    """Qwen3-MoE: the per-head q/k norms and the moe ops (router GEMM, then the fused kernel's contract; at one
    token the one-token path's, router included)."""
    cfg = tiny_cfg("qwen3_moe", max_position_embeddings=CONTEXT_LEN)
    torch.manual_seed(1)
    e = Engine((cfg, LlamaModel(cfg).eval()), num_blocks=24, budget=16, max_seqs=4, runner_cls=TwinRunner)
    try:
        for i, p in enumerate(_prompts(4, cfg.vocab_size, seed=8)):
            e.submit(RequestSpec(i, p, 6, temperature=0.0, ignore_eos=True))
        e.run_until_done()
        assert e.runner.rows_compared > 40 and e.runner.max_diff < 1e-4
    finally:
        e.close()
