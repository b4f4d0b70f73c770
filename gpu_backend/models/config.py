"""ModelConfig: the shape of a Llama-family decoder (dense or mixture of experts), read from a Hugging Face
config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "mixtral": "MixtralForCausalLM"}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder: dense (Llama 2/3.x, Mistral, Qwen2, Qwen3, SmolLM2, Phi-3/Phi-4)
    or mixture of experts (Qwen3-MoE, Mixtral).

    `attention_bias` means biases on q/k/v (Qwen2); o_proj never has one. `qk_norm` is Qwen3's
    per-head RMSNorm of q and k before RoPE. `rope_scaling` is None or the Llama-3 dict
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    `num_experts` > 0 makes every layer's MLP a mixture of experts: `num_experts_per_tok` of them run per
    token, each a SwiGLU MLP of width `moe_intermediate_size`; the router's softmax is over all experts,
    and with `norm_topk_prob` the chosen k weights are renormalised to sum to 1 (Mixtral always does).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    model_type: str = "llama"
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _check_llama3_rope(self.rope_scaling))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"ModelConfig.rms_norm_eps and rope_theta must be > 0, "
                             f"got {self.rms_norm_eps} and {self.rope_theta}")
        for token_id in (*self.eos_token_ids, self.bos_token_id):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"ModelConfig token id {token_id} (bos/eos) is outside the vocabulary "
                                 f"of {self.vocab_size}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        self._check_moe()

    def _check_moe(self) -> None:
        if (self.model_type in MOE_MODEL_TYPES) != (self.num_experts > 0):
            raise ValueError(f"ModelConfig.num_experts is {self.num_experts} for model_type {self.model_type!r}: "
                             f"{', '.join(MOE_MODEL_TYPES)} need experts (> 0), the others none (0)")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"ModelConfig needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                             f"({self.num_experts}) and moe_intermediate_size > 0 ({self.moe_intermediate_size})")
        if self.model_type == "mixtral" and self.intermediate_size != self.moe_intermediate_size:
            raise ValueError(f"ModelConfig of a mixtral model: its experts are intermediate_size wide, so "
                             f"moe_intermediate_size ({self.moe_intermediate_size}) must equal it "
                             f"({self.intermediate_size})")

    # ---- derived sizes ----
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + self.mlp_params + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: gate, up and down (every expert's, and the router, for MoE)."""
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        return self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward reads (its experts only; the router and all attention weights)."""
        if not self.is_moe:
            return self.num_params
        inactive = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params - self.num_layers * inactive

    def weight_bytes(self, dtype: torch.dtype | str = torch.float32) -> int:
        return self.num_params * _dtype_size(dtype)

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts per layer that `num_tokens` tokens choose when each picks its top k uniformly and
        independently: E (1 - (1 - k/E)^tokens). Real routers are skewed, so this is an upper estimate."""
        if not self.is_moe:
            return 0.0
        return self.num_experts * (1 - (1 - self.num_experts_per_tok / self.num_experts) ** num_tokens)

    def decode_weight_bytes(self, num_tokens: int, dtype: torch.dtype | str = torch.float32) -> int:
        """Weight bytes a step of `num_tokens` tokens reads (the floor of a decode step, KV aside): every weight
        but the experts nobody chose (MoE: `expected_experts` of them are read) and, where the embedding table is
        not also the LM head, all of it but the `num_tokens` rows the step looks up."""
        params = self.num_params - self.unread_embedding_params(num_tokens)
        if self.is_moe:
            expert = 3 * self.hidden_size * self.moe_intermediate_size
            params -= int((self.num_experts - self.expected_experts(num_tokens)) * expert * self.num_layers)
        return params * _dtype_size(dtype)

    def unread_embedding_params(self, num_tokens: int) -> int:
        """Embedding-table parameters a step of `num_tokens` tokens does not read: all but its rows, unless the
        table is tied to the LM head (which reads it whole)."""
        if self.tie_word_embeddings:
            return 0
        return (self.vocab_size - min(num_tokens, self.vocab_size)) * self.hidden_size

    def kv_bytes_per_token(self, dtype: torch.dtype | str = torch.float32) -> int:
        """Bytes of K and V, all layers, for one token."""
        return 2 * self.num_layers * self.kv_size * _dtype_size(dtype)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Read a Hugging Face config.json dict (model types in SUPPORTED_MODEL_TYPES)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        _reject_unsupported(hf, model_type)
        num_heads = _require(hf, "num_attention_heads")
        hidden_size = _require(hf, "hidden_size")
        rope_theta, rope_scaling = _read_rope(hf)
        eos = hf.get("eos_token_id")
        return cls(**_read_moe(hf, model_type),
            vocab_size=_require(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(hf, "intermediate_size"),
            num_layers=_require(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(hf, model_type),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
            name=name or hf.get("_name_or_path") or model_type,
            model_type=model_type,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config.json dict that transformers (4.x and 5.x) loads as the same model."""
        arch = HF_ARCHITECTURES[self.model_type]
        eos = list(self.eos_token_ids)
        out = {
            "architectures": [arch], "model_type": self.model_type, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else {"rope_type": "llama3", **self.rope_scaling},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "initializer_range": 0.02, "use_cache": True,
        }
        if self.model_type in ("qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "phi3"):
            out.update(sliding_window=None, use_sliding_window=False)
        out.update(self._moe_to_hf())
        if self.model_type == "phi3":
            out.update(pad_token_id=None, original_max_position_embeddings=self.max_position_embeddings)
        return out

    def _moe_to_hf(self) -> dict[str, Any]:
        if self.model_type == "qwen3_moe":
            return dict(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                        moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        if self.model_type == "mixtral":
            return dict(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                        intermediate_size=self.moe_intermediate_size, router_jitter_noise=0.0,
                        output_router_logits=False)
        return {}


def _require(hf: Mapping[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return hf[key]


def _reject_unsupported(hf: Mapping[str, Any], model_type: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true for {model_type} (o_proj bias) is not supported")
    if hf.get("use_sliding_window") and model_type in ("qwen2", "qwen3", "qwen3_moe"):
        raise ValueError("config.json use_sliding_window=true is not supported")
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError("config.json shared_expert_intermediate_size: shared experts are not supported")


def _read_moe(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The expert fields of a Qwen3-MoE or Mixtral config.json; {} for a dense model."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not num_experts:
        raise ValueError(f"config.json of a {model_type} model is missing required field 'num_experts'"
                         f" (or 'num_local_experts')")
    if model_type == "mixtral":  # every expert is intermediate_size wide; the top-k weights always renormalised
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(_require(hf, "num_experts_per_tok")),
                    moe_intermediate_size=int(_require(hf, "intermediate_size")), norm_topk_prob=True)
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ValueError("config.json decoder_sparse_step != 1 or a non-empty mlp_only_layers (dense layers "
                         "among the MoE ones) is not supported; every layer must be a mixture of experts")
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(_require(hf, "num_experts_per_tok")),
                moe_intermediate_size=int(_require(hf, "moe_intermediate_size")),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _max_positions(hf: Mapping[str, Any], model_type: str) -> int:
    max_pos = int(hf.get("max_position_embeddings", 4096))
    window = hf.get("sliding_window")
    if model_type in ("mistral", "mixtral", "phi3") and window:
        # within one window, sliding-window attention is exact full attention
        max_pos = min(max_pos, int(window))
    return max_pos


def _read_rope(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters (with rope_theta inside)
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    partial = float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {partial} is not supported (only 1.0: RoPE over "
                         f"the whole head, as Phi-4 and Phi-3 use)")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"config.json rope type {rope_type!r} is not supported (only default and llama3; "
                         f"Phi-3's longrope/su 128k variants are not)")
    return theta, {k: scaling.get(k) for k in LLAMA3_ROPE_KEYS}


def _check_llama3_rope(scaling: Mapping[str, Any]) -> dict:
    missing = [k for k in LLAMA3_ROPE_KEYS if scaling.get(k) is None]
    if missing:
        raise ValueError(f"ModelConfig.rope_scaling (llama3) is missing {missing}")
    extra = set(scaling) - set(LLAMA3_ROPE_KEYS) - {"rope_type", "type"}
    if extra:
        raise ValueError(f"ModelConfig.rope_scaling has unknown keys {sorted(extra)}")
    out = {k: float(scaling[k]) for k in LLAMA3_ROPE_KEYS[:3]}
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if not (out["factor"] >= 1 and 0 < out["low_freq_factor"] < out["high_freq_factor"]):
        raise ValueError(f"ModelConfig.rope_scaling needs factor >= 1 and 0 < low_freq_factor < "
                         f"high_freq_factor, got {out}")
    return out


def _dtype_size(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty((), dtype=dtype).element_size()
