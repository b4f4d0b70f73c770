"""FP8 (e4m3) weights for the decoder's projections: `--quantization fp8`.

Weights: one scale per output channel (row), quantized at load from a bf16 checkpoint, or read from an FP8
checkpoint in the compressed-tensors layout (`weights.py` dequantizes it at load; `quantize_decoder_weights`
then quantizes the fused q/k/v and gate/up rows again, which gives back the checkpoint's values exactly when a
row's largest weight sits at the FP8 maximum, as a channel-scaled checkpoint's do). Activations: one scale
per token, computed on the fly (dynamic), so nothing is calibrated. The LM head and the embedding stay in
the model's dtype, as the common FP8 releases keep them.

`fp8_linear` is the one FP8 matmul both runners call (`torch._scaled_mm`, CPU and GPU); at one token the GPU
runner streams the FP8 rows through `kernels/gemv.py` instead (weight-only: the activation stays bf16, the
bytes a batch-1 step reads are the weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale
QUANTIZED_PROJECTIONS = ("qkv", "o", "gate_up", "down")
QUANTIZATIONS = ("fp8",)


@dataclass
class Fp8Weight:
    """A [N, K] weight as FP8 values and one float32 scale per row: W ~= q * scale[:, None]."""

    q: torch.Tensor       # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor   # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def num_bytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


@torch.no_grad()
def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """Per-row scales from each row's largest magnitude (the row's max lands on the FP8 maximum)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()
    return Fp8Weight(q, scale.contiguous())


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token scales: x [T, K] -> (FP8 [T, K], float32 scales [T, 1])."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               quantize=quantize_tokens) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) with FP8 operands and float32 accumulation; the result in x's dtype.
    `quantize`: the per-token quantizer (the GPU runner passes kernels/fp8_quant.py's, one kernel)."""
    xq, x_scale = quantize(x)
    out = torch._scaled_mm(xq, w.q.t(), scale_a=x_scale, scale_b=w.scale[None, :], out_dtype=_out_dtype(x))
    out = out.to(x.dtype)
    return out + bias if bias is not None else out


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    # cuBLASLt's row-wise scaled FP8 GEMM writes bf16; the CPU one writes what it is asked
    return torch.bfloat16 if x.is_cuda else x.dtype


def quantize_decoder_weights(layers: list, projections: tuple[str, ...] = QUANTIZED_PROJECTIONS) -> None:
    """Replace each layer's dense projections (`LayerWeights` fields) by `Fp8Weight`s, in place."""
    for layer in layers:
        for name in projections:
            dense = getattr(layer, name)
            if isinstance(dense, torch.Tensor):
                setattr(layer, name, quantize_weight(dense))


def check_quantization(name: str | None) -> str | None:
    """The `--quantization` value, or a ValueError naming the choices."""
    if name in (None, "", "none"):
        return None
    if name not in QUANTIZATIONS:
        raise ValueError(f"--quantization {name!r} is not supported; choose one of: {', '.join(QUANTIZATIONS)}")
    return name


@torch.no_grad()
def release_dense_projections_(model: torch.nn.Module) -> None:
    """After the GPU runner quantized the fused projections: drop the model's dense copies (the Linear
    weights are views of the fused dense tensors), so their memory goes to the KV cache. The model's
    embedding, norms and LM head stay; so do a mixture of experts' router and experts (not quantized)."""
    for layer in model.model.layers:
        quantized = [layer.self_attn] + ([] if hasattr(layer.mlp, "experts") else [layer.mlp])
        for lin in (m for block in quantized for m in block.modules() if isinstance(m, torch.nn.Linear)):
            lin.weight.data = lin.weight.data.new_empty(0)
