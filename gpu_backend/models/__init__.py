"""Llama-family models for blink (dense, Phi-3/Phi-4, and the Qwen3-MoE/Mixtral mixtures of experts): config,
paged-attention decoder, weight loading, GGUF import, demo model."""

from .attention import AttnBatch, AttnPlan, paged_attention
from .config import ModelConfig
from .generate import BlockPool, SeqState, greedy_generate, make_step
from .llama import LlamaModel, allocate_kv_cache
from .presets import PRESETS, preset_config
from .weights import load_model, model_fingerprint

# GGUF import needs the `gguf` package; a GPU host that only loads Hugging Face folders need not have it
_LAZY = {"import_gguf": ".gguf_import", "ensure_demo_model": ".demo", "default_cache_dir": ".demo"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttnBatch", "AttnPlan", "paged_attention", "ModelConfig", "BlockPool", "SeqState", "greedy_generate",
    "make_step", "LlamaModel", "allocate_kv_cache", "PRESETS", "preset_config", "load_model",
    "model_fingerprint", "import_gguf", "ensure_demo_model", "default_cache_dir",
]
