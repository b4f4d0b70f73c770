"""Build a LlamaModel from a Hugging Face folder (safetensors) or from random weights of a preset shape."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .config import ModelConfig
from .llama import LlamaModel, transpose_linear_storage_
from .fp8 import CHECKPOINT_SCHEME, FP8_DTYPE, check_quantization
from .presets import preset_config

RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
RANDOM_STD = 0.02
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# checkpoints store one tensor per expert (Qwen3-MoE `mlp.experts.{e}.gate_proj`, Mixtral
# `block_sparse_moe.experts.{e}.w1`: w1 gate, w3 up, w2 down); LlamaModel stacks them as transformers 5 does
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_MIXTRAL_ROUTER_KEY = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.gate\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def load_model(spec: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               progress: bool = True, quantization: str | None = None) -> tuple[ModelConfig, LlamaModel, Path | None]:
    """spec: a Hugging Face folder (config.json + *.safetensors) or `random:<preset>`.

    dtype None means float32 on the CPU and bfloat16 elsewhere. quantization "fp8" quantizes the decoder's
    projections when the runners fuse them (`model.quantization`; models/fp8.py); an FP8 checkpoint
    (compressed-tensors) implies it. Returns (config, model in eval mode without grads, folder or None for
    random weights).
    """
    device = torch.device(device)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    quantization = check_quantization(quantization)
    if spec.startswith(RANDOM_PREFIX):
        cfg = preset_config(spec[len(RANDOM_PREFIX):])
        check_fits(cfg, dtype, device)
        model = _empty_model(cfg, dtype, device)
        init_random_(model, seed=RANDOM_SEED, std=RANDOM_STD)
        model.quantization = quantization
        return cfg, model, None
    model_dir = Path(spec).expanduser()
    cfg = read_config(model_dir)
    check_fits(cfg, dtype, device)
    model = _empty_model(cfg, dtype, device)
    if checkpoint_quantization(model_dir) is not None:
        quantization = CHECKPOINT_SCHEME
    load_safetensors_(model, model_dir, progress=progress)
    model.quantization = quantization
    return cfg, model, model_dir


def read_config(model_dir: Path) -> ModelConfig:
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a model folder needs a Hugging Face config.json "
                                f"(or use random:<preset>)")
    return ModelConfig.from_hf(json.loads(config_path.read_text()), name=Path(model_dir).resolve().name)


def check_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before allocating anything, weights larger than the GPU's memory (Mixtral-8x7B's 93 GB in
    bf16 on an 80 GB H100; it loads on a 141 GB H200). The KV cache's room is the runner's to check."""
    if device.type != "cuda":
        return
    weight_bytes = cfg.weight_bytes(dtype)
    total_bytes = torch.cuda.get_device_properties(device).total_memory
    if weight_bytes >= total_bytes:
        raise ValueError(f"{cfg.name}: the weights take {weight_bytes / 1e9:.1f} GB in {dtype} "
                         f"({weight_bytes} bytes), more than the {total_bytes / 1e9:.1f} GB of "
                         f"{torch.cuda.get_device_name(device)}; use a GPU with more memory (an H200 has 141 GB)")


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(cfg).to(dtype)
    model = model.to_empty(device=device).eval()
    model.tie_weights()
    if device.type == "cpu":
        transpose_linear_storage_(model)
    model.requires_grad_(False)
    return model


@torch.no_grad()
def init_random_(model: LlamaModel, seed: int = RANDOM_SEED, std: float = RANDOM_STD) -> None:
    """Deterministic init: matrices and embeddings ~ N(0, std), norms 1, biases 0."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():   # a tied weight is visited once
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a folder, following model.safetensors.index.json when present."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights found" +
                                (f" (missing {missing})" if missing else ""))
    return files


@torch.no_grad()
def load_safetensors_(model: LlamaModel, model_dir: Path, progress: bool = True,
                      piece: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Copy every tensor of the folder into the model's parameters (cast and moved on the way), one at a time.
    `piece(name, tensor)`, when given, takes the part of each whole tensor that `model` holds (a tensor-parallel
    rank's: gpu_backend/parallel/shard.py), by the name of its parameter or, for one expert's tensor of a stacked
    expert parameter, `<layer>.mlp.experts.{gate,up,down}[<e>]`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    files = weight_files(model_dir)
    filled: set[str] = set()
    scales = _weight_scales(files)
    with tqdm(total=_count_tensors(files), desc=f"loading {Path(model_dir).name}", unit="tensor",
              file=sys.stderr, disable=not progress) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    _copy_tensor(params, key, f, filled, scales, piece)
                    bar.update(1)
    _check_filled(model, params, filled)


def _weight_scales(files: list[Path]) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's `<name>.weight_scale` tensors (small: one per channel or per tensor), by name."""
    scales = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(".weight_scale"):
                    scales[key.removesuffix("_scale")] = f.get_tensor(key).float()
    return scales


def _dequantize(key: str, tensor: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """An FP8 weight times its scale (per channel [N, 1] or per tensor), in float32; the runners quantize
    the fused projections again per channel (models/fp8.py)."""
    if key not in scales:
        raise ValueError(f"FP8 weight {key!r} has no {key}_scale in the checkpoint")
    scale = scales[key]
    if scale.numel() not in (1, tensor.shape[0]):
        raise ValueError(f"{key}_scale has {scale.numel()} values; expected 1 or {tensor.shape[0]} (one per row)")
    return tensor.float() * scale.reshape(-1, 1)


def _count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    return total


def checkpoint_quantization(model_dir: Path) -> str | None:
    """"fp8" for an FP8 checkpoint in the compressed-tensors layout (or vLLM's "fp8" method), None for a dense
    one; a ValueError for a scheme this loader cannot read."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method != "compressed-tensors":
        raise ValueError(f"{model_dir}: quantization_config.quant_method {method!r} is not supported (fp8 and "
                         f"compressed-tensors FP8 are)")
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"{model_dir}: compressed-tensors weights {w} are not FP8 with channel or tensor "
                             f"scales, the layout this loader reads")
    return "fp8"


def _copy_tensor(params: dict, key: str, f, filled: set[str], scales: dict, piece=None) -> None:
    if key.endswith(_IGNORED_SUFFIXES) or key.endswith(".input_scale"):
        return  # activations are scaled per token at run time (models/fp8.py): a static scale is not used
    if key.endswith(".weight_scale"):
        return  # read with its weight (_fp8_weight)
    name, target = _target(params, key)
    tensor = f.get_tensor(key)
    if tensor.dtype == FP8_DTYPE:
        tensor = _dequantize(key, tensor, scales)
    if piece is not None:
        tensor = piece(name, tensor)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"weight {key!r} has shape {tuple(tensor.shape)}, the config implies {tuple(target.shape)}")
    target.copy_(tensor)
    filled.add(name)


def _target(params: dict, key: str) -> tuple[str, torch.Tensor]:
    """(the name `_check_filled` counts, the parameter or the slice of a stacked expert parameter) of a
    checkpoint tensor."""
    if key in params:
        return key, params[key]
    if match := _MIXTRAL_ROUTER_KEY.match(key):
        return _target(params, f"{match[1]}mlp.gate.weight")
    match = _EXPERT_KEY.match(key)
    stacked = match and params.get(f"{match[1]}mlp.experts.{'down' if _EXPERT_PART[match[3]] == 'down' else 'gate_up'}_proj")
    if stacked is None or int(match[2]) >= stacked.shape[0]:
        raise ValueError(f"weight {key!r} has no parameter in LlamaModel (unsupported architecture variant, "
                         f"or an expert past the config's num_experts?)")
    expert, part = int(match[2]), _EXPERT_PART[match[3]]
    name = f"{match[1]}mlp.experts.{part}[{expert}]"
    if part == "down":
        return name, stacked[expert]
    width = stacked.shape[1] // 2
    return name, stacked[expert, :width] if part == "gate" else stacked[expert, width:]


def _expert_parts(name: str, param: torch.Tensor) -> set[str]:
    """The per-expert names `_target` gives the slices of a stacked expert parameter (empty for others)."""
    if name.endswith(".mlp.experts.gate_up_proj"):
        parts = ("gate", "up")
    elif name.endswith(".mlp.experts.down_proj"):
        parts = ("down",)
    else:
        return set()
    prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
    return {f"{prefix}{part}[{e}]" for part in parts for e in range(param.shape[0])}


def _check_filled(model: LlamaModel, params: dict, filled: set[str]) -> None:
    for name, param in params.items():
        parts = _expert_parts(name, param)
        if parts and parts <= filled:
            filled.add(name)
    if model.cfg.tie_word_embeddings and "lm_head.weight" not in filled and "model.embed_tokens.weight" in filled:
        filled.add("lm_head.weight")
    if model.cfg.tie_word_embeddings and "model.embed_tokens.weight" not in filled and "lm_head.weight" in filled:
        filled.add("model.embed_tokens.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"weights missing from the safetensors files: {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def model_fingerprint(source: Path | str | ModelConfig, quantization: str | None = None,
                      tensor_parallel_size: int = 1) -> str:
    """32 hex chars of sha256 over the config and the weight files' names and sizes (or, for
    random weights, a ModelConfig or `random:<preset>`: the config and the init recipe, which draws each
    tensor-parallel rank's share apart), and the run-time quantization (FP8 weights give other tokens).
    Goes into the ring header."""
    h = hashlib.sha256()
    if quantization:
        h.update(f"quantization={quantization}\n".encode())
    if isinstance(source, str) and source.startswith(RANDOM_PREFIX):
        source = preset_config(source[len(RANDOM_PREFIX):])
    if isinstance(source, ModelConfig):
        h.update(json.dumps(source.to_hf(), sort_keys=True).encode())
        h.update(f"random seed={RANDOM_SEED} std={RANDOM_STD}".encode())
        if tensor_parallel_size > 1:
            h.update(f" tensor_parallel_size={tensor_parallel_size}".encode())
        return h.hexdigest()[:32]
    model_dir = Path(source)
    h.update(json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True).encode())
    for path in weight_files(model_dir):
        h.update(f"\n{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:32]
