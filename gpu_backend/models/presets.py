"""Real model shapes for `random:<preset>` weights (benchmarks without downloads).

The values are the published Hugging Face config.json files' (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-32B,
microsoft/phi-4, mistralai/Mixtral-8x7B-v0.1, ...); docs/models.md lists them with sizes and what fits where.
"""

from __future__ import annotations

from .config import ModelConfig

_LLAMA3_VOCAB = dict(vocab_size=128256, bos_token_id=128000, rms_norm_eps=1e-5, rope_theta=500000.0)
_QWEN3 = dict(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
              qk_norm=True, bos_token_id=151643, eos_token_ids=(151645, 151643))

PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        **_LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, eos_token_ids=(128001, 128009),
        name="llama-3-8b"),
    # 70.6 B parameters, 141 GB in bf16: no single GPU holds it; --tensor-parallel-size 2 (H200) or 4 (H100)
    "llama-3-70b": ModelConfig(
        **_LLAMA3_VOCAB, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, eos_token_ids=(128001, 128009),
        name="llama-3-70b"),
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
    "qwen3-32b": ModelConfig(
        **_QWEN3, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8,
        name="qwen3-32b", model_type="qwen3"),
    "qwen3-30b-a3b": ModelConfig(
        **_QWEN3, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        name="qwen3-30b-a3b", model_type="qwen3_moe"),
    "phi-4": ModelConfig(
        vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_layers=40, num_heads=40, num_kv_heads=10,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=250000.0, max_position_embeddings=16384,
        bos_token_id=100257, eos_token_ids=(100265,), name="phi-4", model_type="phi3"),
    # 46.7 B parameters, 93 GB in bf16: loads on an H200 (141 GB), refused on an H100 (80 GB) by load_model
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768, bos_token_id=1,
        eos_token_ids=(2,), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
        name="mixtral-8x7b", model_type="mixtral"),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
