"""FP8 layouts that have no kernels, emulated on the CPU (issue 22): which choice moves greedy agreement?

Each variant quantizes and dequantizes ("fake quantization") in float32 on the demo model, against the float32
dense model over the held text (bench/fp8_accuracy.py's measures; that bench runs what is served). A variant
is comma-separated key=value pairs:
- w: the weight scales: `row` (one per output row, served), `G` (one per row and group of G along K; the
  last group of a row may be shorter), `bf16` (weights rounded to bf16 instead), `dense`;
- a: the activation scales: `token` (served by fp8), `G` (per token and group of G), `none` (weight-only),
  `bf16` (rounded to bf16);
- skip: projections kept dense, `+`-joined (qkv, o, gate_up, down); keep: layer indices kept dense
  (negative from the end); only: the only layers quantized;
- kv: the KV cache: `fp8` (unscaled e4m3, as served) or `fp8_token` (one scale per token and head).

    python -m bench.fp8_variants --tokens 1000 "w=row,a=token" "w=128,a=token" "skip=down,a=none" \
        "kv=fp8,w=dense,a=none"
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from bench.fp8_accuracy import TEXT, load_dense, predictions, tokenize
from gpu_backend.models import llama, torch_ops
from gpu_backend.models.demo import ensure_demo_model
from gpu_backend.models.fp8 import FP8_DTYPE, FP8_MAX, QUANTIZED_PROJECTIONS


def fake_fp8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [..., K] through e4m3 and back, one scale per row (group None) or per row and group of `group`."""
    k = x.shape[-1]
    g = k if group is None or group >= k else group
    padded = F.pad(x, (0, -k % g)).unflatten(-1, (-1, g))
    scale = (padded.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q = (padded / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale
    return q.flatten(-2)[..., :k]


def round_as(x: torch.Tensor, how: str) -> torch.Tensor:
    """x rounded as `how` says: dense, none, bf16, token (per row FP8), row (the same) or a group size."""
    if how in ("dense", "none"):
        return x
    if how == "bf16":
        return x.to(torch.bfloat16).float()
    return fake_fp8(x, None if how in ("row", "token") else int(how))


class EmulatedWeight:
    """A projection's weight as the variant rounds it, and how its input activations are rounded."""

    def __init__(self, weight: torch.Tensor, activations: str):
        self.weight, self.activations = weight, activations


class EmulatedOps(torch_ops.TorchOps):
    """TorchOps with emulated FP8 projections and, optionally, an FP8 KV cache."""
    kv = None

    def linear(self, name, x, weight, bias=None):
        if not isinstance(weight, EmulatedWeight):
            return super().linear(name, x, weight, bias)
        y = F.linear(round_as(x, weight.activations), weight.weight, bias)
        return y.to(torch.bfloat16).float() if weight.activations == "bf16" else y

    def rope_kv(self, q, k, v, layer, q_norm=None, k_norm=None, eps=1e-6):
        if q_norm is not None:  # Qwen3: normalise before the emulated KV rounding, as before the norms moved here
            q, k = self.rmsnorm(q, q_norm, eps), self.rmsnorm(k, k_norm, eps)
        if self.kv == "fp8":
            k, v = (t.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() for t in (k, v))
        elif self.kv == "fp8_token":
            k, v = fake_fp8(k, None), fake_fp8(v, None)
        return super().rope_kv(q, k, v, layer)


def apply(variant: dict[str, str], layers: list, dense: list[dict]) -> None:
    """Set each layer's projections (the fused `LayerWeights`) to the variant's emulated ones."""
    skip = set(variant.get("skip", "").split("+"))
    n = len(layers)
    keep = {int(i) % n for i in variant.get("keep", "").split("+") if i}
    only = {int(i) % n for i in variant.get("only", "").split("+") if i}
    EmulatedOps.kv = variant.get("kv")
    for i, (layer, weights) in enumerate(zip(layers, dense)):
        for name, w in weights.items():
            kept = name in skip or i in keep or (only and i not in only)
            setattr(layer, name, w if kept else EmulatedWeight(round_as(w, variant.get("w", "row")),
                                                               variant.get("a", "token")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("variants", nargs="+")
    a = p.parse_args()
    model_dir = ensure_demo_model()
    ids = tokenize(model_dir, TEXT.read_text(), a.tokens)
    model = load_dense(model_dir, torch.float32, "cpu")
    llama.TorchOps = EmulatedOps  # what LlamaModel.forward builds
    try:
        layers = model.decoder_weights().layers
        dense = [{n: getattr(layer, n) for n in QUANTIZED_PROJECTIONS} for layer in layers]
        ref_greedy, ref_nll = predictions(model, ids)
        for text in a.variants:
            apply(dict(kv.split("=") for kv in text.split(",")), layers, dense)
            greedy, nll = predictions(model, ids)
            print(json.dumps(dict(variant=text, positions=len(greedy),
                                  agreement=round(float((greedy == ref_greedy).float().mean()), 4),
                                  ppl_ratio=round(math.exp(float(nll.mean()) - float(ref_nll.mean())), 4))), flush=True)
    finally:
        llama.TorchOps = torch_ops.TorchOps


if __name__ == "__main__":
    main()
