"""The Llama-family forward, written once: both runners call `decoder_layers` and `lm_head_logits`.

The layer sequence lives here; the kernels are pluggable (`DecoderOps`): torch reference ops on the CPU
(`models/torch_ops.py`, the `cpu` engine and `LlamaModel.forward`), Triton kernels over the step buffer on
the GPU (`engine/gpu_ops.py`, run eagerly or captured into bucketed CUDA graphs by `engine/gpu_runner.py`).
Per layer: [(residual add +) RMSNorm -> qkv GEMM] -> [per-head q/k norm, in the same op as] RoPE fused with
the KV-cache write -> paged attention -> o GEMM [-> all-reduce] -> [add + RMSNorm -> gate_up GEMM -> SwiGLU] ->
down GEMM (or, in a mixture-of-experts layer, [add + RMSNorm -> the `moe` op: router, top-k, each token through
its experts' SwiGLU MLPs, weighted sum]) [-> all-reduce]; the last layer's residual add is fused into the final
norm of the head. Each [...] is one op (`norm_linear`, `norm_moe`): a one-token GPU step runs the norm inside the
GEMV or the router that reads it (kernels/gemv.py), no launch of its own. With tensor parallelism
(gpu_backend/parallel/) each rank holds its share of the heads and MLP columns (`cfg` is the rank's shape) and
`all_reduce` sums the row-parallel projections' partial outputs; on one device it is the identity.

Weights come as `DecoderWeights`: q/k/v and gate/up fused into one GEMM each (`fuse_weights`), the model's
own Linear weights left as views of the fused tensors, so names and state_dict stay Hugging Face's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .fp8 import SCHEMES, Fp8Weight, quantize_decoder_weights


@dataclass
class LayerWeights:
    in_norm: torch.Tensor                 # [hidden]
    qkv: torch.Tensor | Fp8Weight         # [q + 2 kv, hidden] (the four projections: Fp8Weight with fp8)
    qkv_bias: torch.Tensor | None         # [q + 2 kv] (Qwen2)
    q_norm: torch.Tensor | None           # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    o: torch.Tensor | Fp8Weight           # [hidden, q]
    post_norm: torch.Tensor
    gate_up: torch.Tensor | Fp8Weight | None  # [2 I, hidden] (dense)
    down: torch.Tensor | Fp8Weight | None     # [hidden, I] (dense)
    router: torch.Tensor | None = None    # [E, hidden] (MoE)
    experts_gate_up: torch.Tensor | None = None  # [E, 2 I, hidden] (MoE; bf16 also under --quantization fp8)
    experts_down: torch.Tensor | None = None     # [E, hidden, I] (MoE)


@dataclass
class DecoderWeights:
    embed: torch.Tensor                   # [V, hidden]
    lm_head: torch.Tensor                 # [V, hidden]
    final_norm: torch.Tensor
    layers: list[LayerWeights]

    @property
    def num_bytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.lm_head, self.final_norm] + [
            t for layer in self.layers for t in vars(layer).values() if t is not None]
        for t in tensors:
            if isinstance(t, Fp8Weight):
                total += t.num_bytes
            elif t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


class DecoderOps(Protocol):
    """One device's kernels for one step, bound to that step's inputs (positions, KV slots, attention
    metadata, the KV cache). Shapes: x [T, hidden]; q [T, H, D]; k, v [T, KVH, D]."""

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias); `name` ("qkv", "o", "gate_up", "down", "lm_head") picks a kernel per shape;
        an `Fp8Weight` goes through `fp8.fp8_linear` (or the GPU's FP8 GEMV at one token)."""

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x)."""

    def rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
        """Rotate q and k by their positions; write k and v into layer `layer`'s cache. Returns rotated q.
        With `q_norm`, `k_norm` ([D], Qwen3) each head row of q and k is first RMS-normalised (`eps`) and
        scaled, rounded as `rmsnorm` rounds; the GPU does it in the RoPE kernel (one launch, not three)."""

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Each token over its sequence's cached context (causal): [T, H, D]."""

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] -> silu(gate) * up, [T, I]."""

    def moe(self, x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor,
            top_k: int, renormalize: bool) -> torch.Tensor:
        """Mixture of experts over x [T, hidden]: softmax of the router logits over all E experts, each token's
        top_k (renormalised to sum 1 when `renormalize`), sum over them of weight * expert SwiGLU MLP (x).
        router [E, hidden]; experts_gate_up [E, 2 I, hidden]; experts_down [E, hidden, I]. -> [T, hidden]."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the tensor-parallel ranks (each holds a partial sum after a row-parallel
        projection); x itself on one device."""

    def norm_linear(self, name: str, x: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, weight, bias: torch.Tensor | None = None,
                    swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(name, RMSNorm(residual + x)), residual + x); x None: RMSNorm(residual), residual unchanged.
        `swiglu`: the linear's output goes through `swiglu`. `NormFused` composes it; the GPU fuses it at one
        token (the norm inside the GEMV: no launch of its own)."""

    def norm_moe(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 router: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(moe(RMSNorm(residual + x), ...), residual + x), as `norm_linear`."""

    def prefetch(self, weight, during: str) -> None:
        """A hint: `weight` is what a later `linear` reads, and the kernels launched next until then (`during`:
        "attention", or an MoE layer's "router" and experts) leave HBM idle for a while. The GPU may start reading
        it into L2 beside them (one-token steps, `BLINK_L2_PREFETCH`); results never depend on it."""


class NormFused:
    """`norm_linear` and `norm_moe` as their parts (add + RMSNorm, then the linear or the MoE): what ops without a
    fused kernel for them run, and what the GPU's fused kernels are checked against."""

    def prefetch(self, weight, during: str) -> None:
        pass  # a hint (DecoderOps.prefetch); ops that do nothing with it stay correct

    def norm_linear(self, name, x, residual, norm_weight, eps, weight, bias=None, swiglu=False):
        if x is None:
            normed = self.rmsnorm(residual, norm_weight, eps)
        else:
            normed, residual = self.add_rmsnorm(x, residual, norm_weight, eps)
        y = self.linear(name, normed, weight, bias)
        return (self.swiglu(y) if swiglu else y), residual

    def norm_moe(self, x, residual, norm_weight, eps, router, experts_gate_up, experts_down, top_k, renormalize):
        normed, residual = self.add_rmsnorm(x, residual, norm_weight, eps)
        return self.moe(normed, router, experts_gate_up, experts_down, top_k, renormalize), residual


def decoder_layers(ops: DecoderOps, w: DecoderWeights, cfg: ModelConfig,
                   input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer over the step's tokens. Returns (last MLP output, residual), [T, hidden] each:
    their sum is the hidden state (the head fuses the add into its norm). Each block starts with its norm
    (`norm_linear`, `norm_moe`: the residual add and RMSNorm go with the projection that reads them)."""
    residual, x = F.embedding(input_ids, w.embed), None                      # [T, hidden]
    for i, layer in enumerate(w.layers):
        x, residual = _attention_block(ops, layer, cfg, x, residual, i)
        if layer.router is not None and i + 1 < len(w.layers):
            ops.prefetch(w.layers[i + 1].qkv, during="router")  # the next layer's, while the routing idles HBM
        x, residual = _mlp_block(ops, layer, cfg, x, residual)
    return x, residual


def _mlp_block(ops: DecoderOps, layer: LayerWeights, cfg: ModelConfig, x: torch.Tensor,
               residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    eps = cfg.rms_norm_eps
    if layer.router is not None:
        y, residual = ops.norm_moe(x, residual, layer.post_norm, eps, layer.router, layer.experts_gate_up,
                                   layer.experts_down, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return ops.all_reduce(y), residual
    h, residual = ops.norm_linear("gate_up", x, residual, layer.post_norm, eps, layer.gate_up, swiglu=True)
    return ops.all_reduce(ops.linear("down", h, layer.down)), residual


def _attention_block(ops: DecoderOps, layer: LayerWeights, cfg: ModelConfig, x: torch.Tensor | None,
                     residual: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv, residual = ops.norm_linear("qkv", x, residual, layer.in_norm, cfg.rms_norm_eps, layer.qkv,
                                    layer.qkv_bias)                           # [T, q + 2 kv]
    q = qkv[:, :q_size].unflatten(1, (cfg.num_heads, cfg.head_dim))
    k = qkv[:, q_size:q_size + kv_size].unflatten(1, (cfg.num_kv_heads, cfg.head_dim))
    v = qkv[:, q_size + kv_size:].unflatten(1, (cfg.num_kv_heads, cfg.head_dim))
    q = ops.rope_kv(q, k, v, i, q_norm=layer.q_norm, k_norm=layer.k_norm, eps=cfg.rms_norm_eps)  # norms: Qwen3
    ops.prefetch(layer.o, during="attention")                                 # read while the attention runs
    return ops.all_reduce(ops.linear("o", ops.attention(q, i).flatten(1), layer.o)), residual


def lm_head_logits(ops: DecoderOps, w: DecoderWeights, cfg: ModelConfig, x: torch.Tensor,
                   residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Final add + norm and the LM head over some rows of (x, residual): [n, hidden] -> [n, V] float32, into
    `out` when given (the head's output converted straight into it: no float32 copy in between)."""
    logits = ops.norm_linear("lm_head", x, residual, w.final_norm, cfg.rms_norm_eps, w.lm_head)[0]
    return logits.float() if out is None else out.copy_(logits)


@torch.no_grad()
def fuse_weights(model: nn.Module) -> DecoderWeights:
    """`_fuse_dense`, then the projections quantized when the model was loaded with a quantization
    (`model.quantization`, set by `weights.load_model`; `fp8.py`)."""
    weights = _fuse_dense(model)
    scheme = SCHEMES.get(getattr(model, "quantization", None))
    if scheme is not None:
        quantize_decoder_weights(weights.layers, scheme)
    return weights


def _fuse_dense(model: nn.Module) -> DecoderWeights:
    """The model's weights for `decoder_layers`, q/k/v and gate/up fused (one layer's copy at a time, so
    peak memory grows by one layer). The fused tensor keeps the originals' storage order (the CPU keeps
    Linear weights as [in, out] buffers for MKL, `transpose_linear_storage_`); the originals become views
    of it, so nothing is held twice and the model's state_dict is unchanged."""
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        norms = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else (None, None)
        layers.append(LayerWeights(layer.input_layernorm.weight, *_qkv(attn), *norms, attn.o_proj.weight,
                                   layer.post_attention_layernorm.weight, **_mlp(layer.mlp)))
    return DecoderWeights(model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight, layers)


def _qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused qkv weight (Phi-3's checkpoint has it fused already) and bias."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj.weight, None
    qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) if attn.q_proj.bias is not None else None
    return qkv, bias


def _mlp(mlp: nn.Module) -> dict[str, torch.Tensor | None]:
    if hasattr(mlp, "experts"):
        return dict(gate_up=None, down=None, router=mlp.gate.weight, experts_gate_up=mlp.experts.gate_up_proj,
                    experts_down=mlp.experts.down_proj)
    gate_up = mlp.gate_up_proj.weight if hasattr(mlp, "gate_up_proj") else _fuse([mlp.gate_proj, mlp.up_proj])
    return dict(gate_up=gate_up, down=mlp.down_proj.weight)


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    """One [sum out, in] weight for `linears` (contiguous, or an [in, sum out] buffer's transpose when the
    originals are stored so); each Linear's weight becomes a view of its rows."""
    weights = [lin.weight.data for lin in linears]
    if all(w.t().is_contiguous() for w in weights) and not all(w.is_contiguous() for w in weights):
        fused = torch.cat([w.t() for w in weights], dim=1).t()
    else:
        fused = torch.cat(weights)
    start = 0
    for lin, w in zip(linears, weights):
        lin.weight.data = fused[start:start + w.shape[0]]
        start += w.shape[0]
    return fused
