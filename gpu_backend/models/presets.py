"""Real model shapes for `random:<preset>` weights (benchmarks without downloads)."""

from __future__ import annotations

from .config import ModelConfig

_LLAMA3_VOCAB = dict(vocab_size=128256, bos_token_id=128000, rms_norm_eps=1e-5, rope_theta=500000.0)

PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        **_LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, eos_token_ids=(128001, 128009),
        name="llama-3-8b"),
    "llama-3.2-1b": ModelConfig(
        **_LLAMA3_VOCAB, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        eos_token_ids=(128001, 128008, 128009), name="llama-3.2-1b"),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        attention_bias=True, bos_token_id=151643, eos_token_ids=(151645, 151643), name="qwen2.5-7b",
        model_type="qwen2"),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name="smollm2-135m"),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
