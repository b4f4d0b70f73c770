"""`DecoderOps` in plain torch: the `cpu` engine's kernels and the reference for the GPU's Triton ones.

Bound to one step: attention's plan (`AttnPlan`, built once per step from an `AttnBatch`), the tokens'
cos/sin, and the KV cache. Any device works (tests run it on the GPU too); the GPU runner uses
`engine/gpu_ops.py` instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttnBatch, AttnPlan, attend, write_kv
from .fp8 import Fp8Weight, fp8_linear
from .llama_forward import NormFused
from .moe import moe_reference
from .rope import RotaryEmbedding, apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; as Hugging Face for half types: normalise in float32, scale in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    normed = F.rms_norm(x.float(), x.shape[-1:], None, eps)
    return weight * normed.to(x.dtype)


class TorchOps(NormFused):
    def __init__(self, batch: AttnBatch, positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                 scale: float, dtype: torch.dtype):
        # kv_cache: [L, 2, NB, BS, KVH, D]; positions: [T] int64
        self.plan = AttnPlan.build(batch, kv_cache.shape[3], positions.shape[0], positions.device, dtype)
        self.cos, self.sin = rotary.cos_sin(positions, dtype)               # [T, 1, D/2]
        self.kv_cache, self.scale = kv_cache, scale
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's rotated k and v

    def linear(self, name: str, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
        if q_norm is not None:  # Qwen3's per-head norms, then the rotation (the GPU fuses both into one kernel)
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        write_kv(self.kv_cache[layer], k, v, self.plan.slot_mapping)
        self._fresh = (k, v)  # a whole-context prefill attends over these instead of gathering the cache
        return q

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        k, v = self._fresh
        return attend(q, k, v, self.plan, self.kv_cache[layer], self.scale)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def moe(self, x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor,
            top_k: int, renormalize: bool) -> torch.Tensor:
        return moe_reference(x, router, experts_gate_up, experts_down, top_k, renormalize)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x  # one device holds the whole model
