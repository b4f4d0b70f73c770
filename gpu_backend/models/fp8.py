"""FP8 (e4m3) weights for the decoder's projections: `--quantization fp8` and `fp8-partial` (`SCHEMES`).

- `fp8`: all four projections in FP8 with FP8 activations (one dynamic scale per token): half the bytes of
  bf16 and FP8 tensor-core GEMMs.
- `fp8-partial`: only the o and gate/up weights in FP8, weight-only (activations stay in the model's dtype);
  q/k/v and down stay in the model's dtype. About 70% of bf16's projection bytes (Llama-3-8B: a batch-1 step
  reads ~10.7 GB, not 15.0), fewer flipped greedy tokens.
On the demo model neither meets the greedy-agreement gate (95% of positions against bf16; bf16 itself agrees
with float32 on 97.9%): e4m3's three mantissa bits give each weight ~2-3% relative noise whatever the scale
layout, and the flips add up over projections and layers. docs/models.md has the figures.

Weights: one scale per output channel (row), quantized at load from a bf16 checkpoint, or read from an FP8
checkpoint in the compressed-tensors layout (`weights.py` dequantizes it at load; `quantize_decoder_weights`
then quantizes the fused q/k/v and gate/up rows again, which gives back the checkpoint's values exactly when a
row's largest weight sits at the FP8 maximum, as a channel-scaled checkpoint's do; such a checkpoint implies
`fp8`). Activations under `fp8`: one scale per token, computed on the fly (dynamic), so nothing is
calibrated. The LM head and the embedding stay in the model's dtype, as the common FP8 releases keep them.

`fp8_linear` is the one FP8 matmul both runners call: `torch._scaled_mm` (CPU and GPU) for FP8 activations,
else the FP8 weight times the dense activations (kernels/fp8_gemm.py on the GPU); at one token the GPU runner
streams the FP8 rows through `kernels/gemv.py` instead (weight-only in both schemes: the activation stays bf16,
the bytes a batch-1 step reads are the weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale
QUANTIZED_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Fp8Scheme:
    """What a `--quantization` value puts in FP8: `projections` (`LayerWeights` fields; the others stay in the
    model's dtype) and whether activations are quantized too (per token, dynamic) or stay dense."""

    projections: tuple[str, ...]
    fp8_activations: bool


SCHEMES = {
    "fp8": Fp8Scheme(QUANTIZED_PROJECTIONS, fp8_activations=True),
    "fp8-partial": Fp8Scheme(("o", "gate_up"), fp8_activations=False),
}
CHECKPOINT_SCHEME = "fp8"  # an FP8 checkpoint's projections are all FP8 already
QUANTIZATIONS = tuple(SCHEMES)


@dataclass
class Fp8Weight:
    """A [N, K] weight as FP8 values and one float32 scale per row: W ~= q * scale[:, None].
    `fp8_activations`: multiply with FP8 activations (W8A8), else with the dense activations (W8A16)."""

    q: torch.Tensor       # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor   # [N] float32
    fp8_activations: bool = True

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def num_bytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


@torch.no_grad()
def quantize_weight(w: torch.Tensor, fp8_activations: bool = True) -> Fp8Weight:
    """Per-row scales from each row's largest magnitude (the row's max lands on the FP8 maximum)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()
    return Fp8Weight(q, scale.contiguous(), fp8_activations)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token scales: x [T, K] -> (FP8 [T, K], float32 scales [T, 1])."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               quantize=quantize_tokens, weight_only_mm=None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias), the result in x's dtype. With `w.fp8_activations`: FP8 operands and float32
    accumulation, `quantize` the per-token quantizer (the GPU runner passes kernels/fp8_quant.py's, one
    kernel). Else x times the FP8 weight: `weight_only_mm(x, q, scale, bias)` (the GPU runner passes
    kernels/fp8_gemm.py's, which widens the FP8 tiles in registers), by default x times the dequantized weight."""
    if not w.fp8_activations:
        if weight_only_mm is not None:
            return weight_only_mm(x, w.q, w.scale, bias)
        return F.linear(x, dequantize_rows(w, x.dtype), bias)
    xq, x_scale = quantize(x)
    out = torch._scaled_mm(xq, w.q.t(), scale_a=x_scale, scale_b=w.scale[None, :], out_dtype=_out_dtype(x))
    out = out.to(x.dtype)
    return out + bias if bias is not None else out


def dequantize_rows(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None] in `dtype`; in the narrow dtype directly (no float32 copy of a whole matrix)."""
    if dtype == torch.float32:
        return w.dequantize(dtype)
    return w.q.to(dtype) * w.scale[:, None].to(dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    # cuBLASLt's row-wise scaled FP8 GEMM writes bf16; the CPU one writes what it is asked
    return torch.bfloat16 if x.is_cuda else x.dtype


def quantize_decoder_weights(layers: list, scheme: Fp8Scheme = SCHEMES["fp8"]) -> None:
    """Replace the scheme's dense projections (`LayerWeights` fields) of each layer by `Fp8Weight`s, in place."""
    for layer in layers:
        for name in scheme.projections:
            dense = getattr(layer, name)
            if isinstance(dense, torch.Tensor):
                setattr(layer, name, quantize_weight(dense, scheme.fp8_activations))


def check_quantization(name: str | None) -> str | None:
    """The `--quantization` value, or a ValueError naming the choices."""
    if name in (None, "", "none"):
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"--quantization {name!r} is not supported; choose one of: {', '.join(QUANTIZATIONS)}")
    return name


@torch.no_grad()
def release_dense_projections_(model: torch.nn.Module, weights) -> None:
    """After the GPU runner quantized the fused projections: drop the model's dense copies (the Linear
    weights are views of the fused dense tensors), so their memory goes to the KV cache. What `weights`
    (`DecoderWeights`) still reads dense stays: the projections the scheme keeps, the embedding, norms and LM
    head, a mixture of experts' router and experts (not quantized)."""
    in_use = {t.untyped_storage().data_ptr() for layer in weights.layers for t in vars(layer).values()
              if isinstance(t, torch.Tensor)}
    for layer in model.model.layers:
        quantized = [layer.self_attn] + ([] if hasattr(layer.mlp, "experts") else [layer.mlp])
        for lin in (m for block in quantized for m in block.modules() if isinstance(m, torch.nn.Linear)):
            if lin.weight.numel() and lin.weight.untyped_storage().data_ptr() not in in_use:
                lin.weight.data = lin.weight.data.new_empty(0)
