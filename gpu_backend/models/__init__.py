"""Llama-family models for blink: config, paged-attention decoder, weight loading, GGUF import, demo model."""

from .attention import AttnBatch, AttnPlan, paged_attention
from .config import ModelConfig
from .demo import default_cache_dir, ensure_demo_model
from .generate import BlockPool, SeqState, greedy_generate, make_step
from .gguf_import import import_gguf
from .llama import LlamaModel, allocate_kv_cache
from .presets import PRESETS, preset_config
from .weights import load_model, model_fingerprint

__all__ = [
    "AttnBatch", "AttnPlan", "paged_attention", "ModelConfig", "default_cache_dir", "ensure_demo_model",
    "BlockPool", "SeqState", "greedy_generate", "make_step", "import_gguf", "LlamaModel",
    "allocate_kv_cache", "PRESETS", "preset_config", "load_model", "model_fingerprint",
]
