"""How a model splits across tensor-parallel ranks (Megatron-style): each rank holds 1/N of the attention
heads (query and key/value heads alike) and of the MLP's intermediate columns, so that per layer only two
all-reduces join them (after the attention output projection and after the MLP's down projection).

Column-parallel (split along the output rows): q/k/v (and Qwen2's biases), gate/up, each expert's gate/up.
Row-parallel (split along the input columns, partial sums): o, down, each expert's down.
Replicated: the embedding, the norms (Qwen3's per-head q/k norms too), the MoE router; the LM head lives on the
leader (rank 0) only, which samples (the followers' copy is dropped).
A rank's model is a LlamaModel of the rank's shape (`local_config`): the forward and the runner need nothing
else to know about it.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from torch import nn

from gpu_backend.models import ModelConfig
from gpu_backend.models.llama import LlamaModel
from gpu_backend.models.fp8 import CHECKPOINT_SCHEME, check_quantization
from gpu_backend.models.weights import (RANDOM_PREFIX, RANDOM_SEED, _empty_model, check_fits, checkpoint_quantization,
                                        init_random_, load_safetensors_, read_config)

_ONE_EXPERT = re.compile(r"\.mlp\.experts\.(gate|up|down)\[\d+\]$")  # weights.py's names of one expert's tensor

TP_SIZES = (1, 2, 4, 8)


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Refuse a split that does not divide the model evenly, naming the field."""
    if world not in TP_SIZES:
        raise ValueError(f"--tensor-parallel-size {world}: supported sizes are {', '.join(map(str, TP_SIZES))}")
    widths = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
    if cfg.num_experts:
        widths["moe_intermediate_size"] = cfg.moe_intermediate_size
    else:
        widths["intermediate_size"] = cfg.intermediate_size
    for name, value in widths.items():
        if value % world:
            raise ValueError(f"{cfg.name}: {name} {value} does not split across --tensor-parallel-size {world}")
    if cfg.hidden_size % 8:
        raise ValueError(f"{cfg.name}: hidden_size {cfg.hidden_size} must be a multiple of 8 for the all-reduce")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """One rank's shape: 1/world of the heads and of the intermediate width, everything else as the model's."""
    check_shardable(cfg, world)
    # Mixtral's experts are intermediate_size wide (the config ties the two); Qwen3-MoE has no dense MLP
    split_dense = not cfg.num_experts or cfg.intermediate_size == cfg.moe_intermediate_size
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world if split_dense else cfg.intermediate_size,
                               moe_intermediate_size=cfg.moe_intermediate_size // world)


def _part(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = t.shape[dim] // world
    return t.narrow(dim, rank * size, size)


def _parts(t: torch.Tensor, dim: int, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Fused blocks along `dim` (q|k|v, gate|up): each block split, this rank's pieces joined in the same order."""
    return torch.cat([_part(piece, dim, rank, world) for piece in t.split(sizes, dim=dim)], dim=dim)


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s piece of parameter `name` (transformers' names, LlamaModel's layout) of the whole model."""
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                      "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return _part(t, 0, rank, world)
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        return _part(t, 1, rank, world)
    if name.endswith("self_attn.qkv_proj.weight"):
        return _parts(t, 0, [cfg.q_size, cfg.kv_size, cfg.kv_size], rank, world)
    if name.endswith("mlp.gate_up_proj.weight"):
        return _parts(t, 0, [cfg.intermediate_size] * 2, rank, world)
    if name.endswith("mlp.experts.gate_up_proj"):
        return _parts(t, 1, [cfg.moe_intermediate_size] * 2, rank, world)
    if name.endswith("mlp.experts.down_proj"):
        return _part(t, 2, rank, world)
    return t


def checkpoint_piece(cfg: ModelConfig, rank: int, world: int):
    """The loader's `piece` (weights.load_safetensors_) for rank `rank`: `shard_tensor`, and for one expert's
    gate or up [I, hidden] its rows, for its down [hidden, I] its columns."""
    def piece(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if match := _ONE_EXPERT.search(name):
            return _part(tensor, 1 if match[1] == "down" else 0, rank, world)
        return shard_tensor(name, tensor, cfg, rank, world)
    return piece


@torch.no_grad()
def shard_model(model: LlamaModel, cfg: ModelConfig, rank: int, world: int, device: torch.device) -> LlamaModel:
    """Rank `rank`'s LlamaModel of `local_config(cfg, world)` on `device`, from the whole `model` (any device)."""
    local = _empty_model(local_config(cfg, world), next(model.parameters()).dtype, device)
    params = dict(local.named_parameters(remove_duplicate=False))
    for name, t in model.named_parameters(remove_duplicate=False):
        if rank and name == "lm_head.weight":
            continue
        params[name].copy_(shard_tensor(name, t, cfg, rank, world))
    local.quantization = getattr(model, "quantization", None)
    if rank:
        drop_lm_head_(local)
    return local


def drop_lm_head_(model: LlamaModel) -> None:
    """A follower never computes the head: its LM head becomes an empty tensor (tied or not)."""
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.new_empty(0, model.lm_head.weight.shape[1]),
                                        requires_grad=False)


def load_rank_models(spec: str, devices: list[torch.device], quantization: str | None = None,
                     progress: bool = True, dtype: torch.dtype = torch.bfloat16
                     ) -> tuple[ModelConfig, list[LlamaModel], object]:
    """(the whole model's config, one model per rank on its device, the folder or None). Nothing whole is
    ever built (Llama-3-70B's 141 GB fit no GPU, and not every host's memory): random presets are drawn per
    rank at the rank's shape; a Hugging Face folder is read once per rank, a tensor at a time, each rank taking
    its piece of every tensor (`checkpoint_piece`)."""
    world = len(devices)
    if spec.startswith(RANDOM_PREFIX):
        from gpu_backend.models.presets import preset_config

        cfg = preset_config(spec[len(RANDOM_PREFIX):])
        local = local_config(cfg, world)
        models = []
        for rank, device in enumerate(devices):
            check_fits(local, dtype, device)
            model = _empty_model(local, dtype, device)
            init_random_(model, seed=RANDOM_SEED + rank)
            model.quantization = quantization
            if rank:
                drop_lm_head_(model)
            models.append(model)
        return cfg, models, None
    model_dir = Path(spec).expanduser()
    cfg = read_config(model_dir)
    local = local_config(cfg, world)
    quantization = CHECKPOINT_SCHEME if checkpoint_quantization(model_dir) is not None else check_quantization(quantization)
    models = []
    for rank, device in enumerate(devices):
        check_fits(local, dtype, device)
        model = _empty_model(local, dtype, device)
        load_safetensors_(model, model_dir, progress=progress, piece=checkpoint_piece(cfg, rank, world))
        model.quantization = quantization
        if rank:
            drop_lm_head_(model)
        models.append(model)
    return cfg, models, model_dir
