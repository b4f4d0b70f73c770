"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache.

Parameter names equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, `lm_head.weight`, ...),
so a Hugging Face state dict loads with `load_state_dict`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttnBatch, AttnPlan, paged_attention
from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)   # as HF: normalise in float32
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, plan: AttnPlan, layer_cache) -> torch.Tensor:
        # x: [T, hidden]; layer_cache: [2, NB, BS, KVH, D]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))      # [T, H, D]
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))   # [T, KVH, D]
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, plan, layer_cache, self.scale)         # [T, H, D]
        return self.o_proj(out.flatten(-2))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, cos, sin, plan: AttnPlan, layer_cache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, plan, layer_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBackbone(nn.Module):
    """The `model.` prefix of Hugging Face's state dict."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """Decoder + LM head. `forward` runs one engine step over a paged KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(cfg)

    def tie_weights(self) -> None:
        """Share one Parameter between embed_tokens and lm_head (again after `to_empty`/`to`)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_cache: [L, 2, NB, BS, KVH, D] -> hidden [T, hidden]
        (final norm applied). Writes the new tokens' K/V into kv_cache."""
        h = self.model.embed_tokens(input_ids)                               # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)                   # [T, 1, D/2]
        plan = AttnPlan.build(batch, kv_cache.shape[3], input_ids.shape[0], h.device, h.dtype)
        for layer, layer_cache in zip(self.model.layers, kv_cache):
            h = layer(h, cos, sin, plan, layer_cache)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()


def transpose_linear_storage_(model: nn.Module) -> None:
    """Keep every Linear weight [out, in] as a view of a contiguous [in, out] buffer. On the CPU,
    MKL's small-batch GEMM (decode) streams that layout about 1.5x faster. Names, shapes and
    values are unchanged; state_dict() tensors become non-contiguous."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """Zeroed cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"allocate_kv_cache: num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
