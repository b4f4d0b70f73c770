"""`blink model import X.gguf OUT/`: turn a llama-architecture GGUF into a Hugging Face folder.

Writes config.json (LlamaForCausalLM), model.safetensors (float32, dequantised; sharded with an index
past `max_shard_bytes`), tokenizer.json, tokenizer_config.json (with the chat template),
special_tokens_map.json and generation_config.json.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from .config import ModelConfig
from .gguf_tokenizer import build_tokenizer, special_token_ids, write_tokenizer_files
from .rope import rope_inv_freq

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# Llama-3.x rope scalings that llama.cpp stores only as a `rope_freqs` tensor
_LLAMA3_ROPE_CANDIDATES = [dict(factor=f, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192) for f in (8.0, 32.0, 16.0)]
MAX_SHARD_BYTES = 2 << 30


def import_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Convert a llama-architecture GGUF into a Hugging Face model folder at out_dir; returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} not found")
    if (out_dir / "config.json").exists():
        raise FileExistsError(f"{out_dir} already holds a model (config.json); choose an empty folder")
    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = gguf_config(meta, tensors, name=gguf_path.stem)
    tokenizer = build_tokenizer(meta)   # fail on an unsupported vocabulary before writing anything
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(meta, tokenizer, out_dir, cfg.max_position_embeddings)
    _write_json(out_dir / "config.json", {**cfg.to_hf(), "torch_dtype": "float32"})
    _write_json(out_dir / "generation_config.json", _generation_config(cfg, meta))
    _write_weights(cfg, tensors, out_dir, progress, max_shard_bytes)
    return out_dir


# ---- metadata ----
def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All GGUF key/values as Python values (str, int, float, bool, lists)."""
    return {key: _field_value(field) for key, field in reader.fields.items()}


def _field_value(field) -> Any:
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
    return _scalar(field.parts[field.data[0]], kind)


def _scalar(part: np.ndarray, kind) -> Any:
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part[0].item()
    return bool(value) if kind == GGUFValueType.BOOL else value


def gguf_config(meta: dict[str, Any], tensors: dict, name: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported (only 'llama')")
    get = lambda key, default=None: meta.get(f"llama.{key}", default)  # noqa: E731
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise ValueError(f"GGUF llama.rope.scaling.type={scaling_type!r} is not supported")
    num_heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    ids = special_token_ids(meta)
    eos_ids = tuple(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    cfg = ModelConfig(
        vocab_size=int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"])), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=num_heads, num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=ids["bos"], eos_token_ids=eos_ids, name=meta.get("general.name") or name)
    if "rope_freqs.weight" in tensors:
        cfg = cfg.replace(rope_scaling=_infer_llama3_rope(cfg, _dequant(tensors["rope_freqs.weight"])))
    return cfg


def _f32(value: float) -> float:
    return float(str(np.float32(value)))   # 9.999999747e-06 -> 1e-05, as the original config had it


def _infer_llama3_rope(cfg: ModelConfig, rope_freqs: np.ndarray) -> dict:
    # llama.cpp stores inv_freq / scaled_inv_freq per frequency; match it to a Llama-3.x scaling
    base = rope_inv_freq(cfg.replace(rope_scaling=None))
    for candidate in _LLAMA3_ROPE_CANDIDATES:
        ratio = base / rope_inv_freq(cfg.replace(rope_scaling=candidate))
        if np.allclose(ratio.numpy(), rope_freqs, rtol=1e-3):
            return candidate
    raise ValueError("GGUF rope_freqs.weight matches no known Llama-3 rope scaling "
                     f"(tried {_LLAMA3_ROPE_CANDIDATES})")


def _generation_config(cfg: ModelConfig, meta: dict[str, Any]) -> dict[str, Any]:
    eos = list(cfg.eos_token_ids)
    out = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    pad = meta.get("tokenizer.ggml.padding_token_id")
    return {**out, "pad_token_id": pad} if pad is not None else out


# ---- weights ----
def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: GGUF keeps each head's rotary pairs (i, i + D/2) as adjacent
    rows (GPT-J layout); Hugging Face keeps the two halves apart (rotate_half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequant(t) -> np.ndarray:
    shape = [int(d) for d in reversed(t.shape)]   # GGUF lists dims fastest-first
    return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def _hf_tensor(cfg: ModelConfig, t) -> torch.Tensor:
    w = _dequant(t)
    if t.name.endswith("attn_q.weight"):
        w = unpermute_rope_rows(w, cfg.num_heads)
    elif t.name.endswith("attn_k.weight"):
        w = unpermute_rope_rows(w, cfg.num_kv_heads)
    return torch.from_numpy(np.ascontiguousarray(w))


def _write_weights(cfg: ModelConfig, tensors: dict, out_dir: Path, progress: bool, max_shard_bytes: int) -> None:
    names = [n for n in tensors if n != "rope_freqs.weight"]
    shards = _plan_shards(names, tensors, max_shard_bytes)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    with tqdm(total=len(names), desc="importing GGUF", unit="tensor", file=sys.stderr, disable=not progress) as bar:
        for file, shard in zip(files, shards):
            out = {}
            for name in shard:
                out[hf_tensor_name(name)] = _hf_tensor(cfg, tensors[name])
                weight_map[hf_tensor_name(name)] = file
                bar.update(1)
            save_file(out, str(out_dir / file), metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(4 * int(np.prod(tensors[n].shape)) for n in names)
        _write_json(out_dir / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})


def _plan_shards(names: list[str], tensors: dict, max_shard_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for name in names:
        nbytes = 4 * int(np.prod(tensors[name].shape))
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
