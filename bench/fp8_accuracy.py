"""FP8 accuracy gates (issue 22): FP8 schemes against the dense model on real weights (the demo model).

Over a held text (bench/data/held_text.txt: the Python license, prose the model did not see in this form):
- agreement: at each position, with the same text before it (teacher forcing), does the FP8 model's greedy
  token equal the dense model's? Gate: at least 95% of positions.
- perplexity of the text under each model. Gate: FP8 within 2% of dense.
- free-running greedy: how many tokens the two models' continuations of the text's first 64 tokens agree
  for (reported, no gate: one early difference changes everything after it).
- the noise floor (`--floor`): the dense model in --dtype against the same model in float32, same measures.

The dense reference runs once; each scheme (`--scheme`, repeatable) is a fresh copy of the model with that
scheme's projections quantized (models/fp8.py's `SCHEMES`, plus `EXTRA_SCHEMES` below for comparison).

    python -m bench.fp8_accuracy --tokens 2000 --dtype bf16 --scheme fp8 --scheme fp8-partial --floor \
        --out bench/results/fp8_accuracy-<commit>-<machine>.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from gpu_backend.models import load_model
from gpu_backend.models.demo import ensure_demo_model
from gpu_backend.models.fp8 import QUANTIZED_PROJECTIONS, SCHEMES, Fp8Scheme, quantize_decoder_weights
from gpu_backend.models.generate import BlockPool, SeqState, greedy_generate, make_step
from gpu_backend.models.llama import allocate_kv_cache

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TEXT = Path(__file__).parent / "data" / "held_text.txt"
# not served; for comparison (the name: the projections in FP8, and how activations are kept)
EXTRA_SCHEMES = {
    "all-w8a16": Fp8Scheme(QUANTIZED_PROJECTIONS, fp8_activations=False),
    "o+gate_up-w8a8": Fp8Scheme(("o", "gate_up"), fp8_activations=True),
    "gate_up-w8a16": Fp8Scheme(("gate_up",), fp8_activations=False),
    "qkv+o+gate_up-w8a16": Fp8Scheme(("qkv", "o", "gate_up"), fp8_activations=False),
}


def tokenize(model_dir: Path, text: str, limit: int) -> list[int]:
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    if len(ids) < limit + 1:
        raise SystemExit(f"the held text has {len(ids)} tokens; {limit + 1} are needed")
    return ids[:limit + 1]


@torch.inference_mode()
def teacher_forced_logits(model, ids: list[int], chunk: int = 256):
    """Yields the float32 logits [n, V] of every position of `ids` (next-token predictions), chunk by chunk."""
    device = model.lm_head.weight.device
    block = 16
    kv = allocate_kv_cache(model.cfg, -(-len(ids) // block), block, model.lm_head.weight.dtype, device)
    pool, seq = BlockPool(list(range(kv.shape[2]))), SeqState(list(ids))
    while seq.num_cached < len(ids):
        n = min(chunk, len(ids) - seq.num_cached)
        input_ids, positions, batch = make_step([seq], [n], pool, block, device)
        hidden = model(input_ids, positions, batch, kv)
        seq.num_cached += n
        yield model.compute_logits(hidden)


def predictions(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy token [n], negative log-likelihood of the text's next token [n]) at every position."""
    targets = torch.tensor(ids[1:])
    greedy, nll, pos = [], [], 0
    for logits in teacher_forced_logits(model, ids[:-1]):
        t = targets[pos:pos + logits.shape[0]].to(logits.device)
        greedy.append(logits.argmax(-1).cpu())
        nll.append(torch.nn.functional.cross_entropy(logits, t, reduction="none").cpu())
        pos += logits.shape[0]
    return torch.cat(greedy), torch.cat(nll)


def compare(ref: tuple[torch.Tensor, torch.Tensor], other: tuple[torch.Tensor, torch.Tensor]) -> dict:
    ppl_ref, ppl = math.exp(float(ref[1].mean())), math.exp(float(other[1].mean()))
    return dict(positions=len(ref[0]), agreement=float((ref[0] == other[0]).float().mean()),
                ppl_dense=ppl_ref, ppl_fp8=ppl, ppl_ratio=ppl / ppl_ref)


def load_dense(model_dir: Path, dtype: torch.dtype, device: str):
    _, model, _ = load_model(str(model_dir), dtype=dtype, device=device, progress=False)
    if device == "cpu" and dtype != torch.float32:
        # the CPU loader stores Linear weights transposed for float32 MKL; bf16 GEMMs on that layout take ~30x
        # longer on CPUs without bf16 instructions (a bench-only concern: the cpu engine runs float32)
        with torch.no_grad():
            for lin in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
                lin.weight.data = lin.weight.data.contiguous()
            model.tie_weights()
    return model


def quantized(model_dir: Path, dtype: torch.dtype, device: str, name: str):
    """A fresh dense copy with `name`'s projections replaced by FP8 ones (as `--quantization` does at load)."""
    model = load_dense(model_dir, dtype, device)
    if name in SCHEMES:
        model.quantization = name
    else:
        quantize_decoder_weights(model.decoder_weights().layers, EXTRA_SCHEMES[name])
    return model


def step_bytes(model) -> dict:
    """Bytes a batch-1 decode step reads for weights: the projections as stored plus the LM head (the
    embedding table is a gather of one row); the bf16 figure for the same shapes beside it."""
    w = model.decoder_weights()
    proj = sum(t.num_bytes if hasattr(t, "num_bytes") else t.numel() * t.element_size()
               for layer in w.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    proj_bf16 = sum(t.shape[0] * t.shape[1] * 2
                    for layer in w.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = w.lm_head.numel() * 2
    return dict(projection_bytes=proj, projection_bytes_bf16=proj_bf16, step_bytes=proj + head,
                step_bytes_bf16=proj_bf16 + head, step_bytes_vs_bf16=(proj + head) / (proj_bf16 + head))


def free_running(dense, other, prompt: list[int], n: int) -> int:
    a, b = greedy_generate(dense, [prompt], n)[0], greedy_generate(other, [prompt], n)[0]
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="the dense model's (and FP8 model's activations')")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--free-running", type=int, default=256, help="greedy tokens generated by each model (0: none)")
    p.add_argument("--scheme", action="append", choices=list(SCHEMES) + list(EXTRA_SCHEMES),
                   help="repeatable; default: every --quantization scheme")
    p.add_argument("--floor", action="store_true", help="also the dense --dtype model against float32")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    model_dir = ensure_demo_model() if a.model == "demo" else Path(a.model)
    ids = tokenize(model_dir, TEXT.read_text(), a.tokens)
    t0 = time.time()
    dense = load_dense(model_dir, DTYPES[a.dtype], a.device)
    ref = predictions(dense, ids)
    result = dict(model=str(a.model), dtype=a.dtype, device=a.device, text=TEXT.name, tokens=a.tokens,
                  machine=platform.node(), torch=torch.__version__, schemes={})
    if a.floor and a.dtype != "fp32":
        floor = compare(predictions(load_dense(model_dir, torch.float32, a.device), ids), ref)
        result["noise_floor_vs_fp32"] = dict(positions=floor["positions"], agreement=floor["agreement"],
                                             ppl_fp32=floor["ppl_dense"], ppl=floor["ppl_fp8"],
                                             ppl_ratio=floor["ppl_ratio"])
        print(json.dumps({"noise_floor_vs_fp32": result["noise_floor_vs_fp32"]}), flush=True)
    for name in a.scheme or list(SCHEMES):
        model = quantized(model_dir, DTYPES[a.dtype], a.device, name)
        r = compare(ref, predictions(model, ids)) | step_bytes(model)
        if a.free_running:
            same = free_running(dense, model, ids[:64], a.free_running)
            r |= dict(free_running_tokens=a.free_running, free_running_same_prefix=same)
        r["gates"] = dict(agreement_ge_0_95=r["agreement"] >= 0.95, ppl_within_2pct=r["ppl_ratio"] <= 1.02)
        result["schemes"][name] = r
        print(json.dumps({name: r}), flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
