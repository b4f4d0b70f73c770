"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2, Qwen3, SmolLM2, Phi-3/Phi-4, Qwen3-MoE, Mixtral) over a
paged KV cache.

Parameter names equal transformers' (`model.layers.{i}.self_attn.q_proj.weight`, `lm_head.weight`, ...),
so a transformers state dict loads with `load_state_dict`: Phi-3's fused `self_attn.qkv_proj` and
`mlp.gate_up_proj`; the MoE models' router `mlp.gate.weight` [E, hidden] and experts stacked as
transformers 5 holds them, `mlp.experts.gate_up_proj` [E, 2 I, hidden] and `mlp.experts.down_proj`
[E, hidden, I] (checkpoints store one tensor per expert: `weights.py` stacks them while loading). The modules hold the parameters; the forward is
`llama_forward.decoder_layers`, the one both runners call, here with the torch ops (`torch_ops.TorchOps`).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttnBatch
from .config import ModelConfig
from .llama_forward import DecoderWeights, decoder_layers, fuse_weights
from .rope import RotaryEmbedding
from .torch_ops import TorchOps, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        if cfg.model_type == "phi3":  # one fused projection in the checkpoint
            self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
            self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
            self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.model_type == "phi3":  # gate and up fused in the checkpoint (gate first)
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class MoeExperts(nn.Module):
    """Every expert's SwiGLU MLP, stacked: gate_up_proj [E, 2 I, hidden] (gate rows first), down_proj [E, hidden, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        if not self.gate_up_proj.is_meta:  # as nn.Linear initialises (loaders overwrite both)
            nn.init.uniform_(self.gate_up_proj, -h ** -0.5, h ** -0.5)
            nn.init.uniform_(self.down_proj, -i ** -0.5, i ** -0.5)


class MoeBlock(nn.Module):
    """The router (`gate`, [E, hidden]) and the experts of a mixture-of-experts layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = MoeExperts(cfg)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoeBlock(cfg) if cfg.is_moe else LlamaMLP(cfg)


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
        w = self.decoder_weights()
        ops = TorchOps(batch, positions, self.rotary, kv_cache, self.cfg.head_dim ** -0.5, w.embed.dtype)
        x, residual = decoder_layers(ops, w, self.cfg, input_ids)
        return ops.add_rmsnorm(x, residual, w.final_norm, self.cfg.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def decoder_weights(self) -> DecoderWeights:
        """The fused weights `decoder_layers` reads, made again whenever a parameter was replaced or
        changed in place since (`.to()`, `load_state_dict`, `transpose_linear_storage_`)."""
        stamp = self._weights_stamp()
        cached = self.__dict__.get("_fused")
        if cached is None or cached[0] != stamp:
            with torch.inference_mode(False):  # parameters must stay editable outside inference mode
                fused = fuse_weights(self)
            self.__dict__["_fused"] = (self._weights_stamp(), fused)
        return self.__dict__["_fused"][1]

    def _weights_stamp(self) -> tuple:
        return tuple((id(p), p.data_ptr(), p._version) for p in self.parameters())


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
