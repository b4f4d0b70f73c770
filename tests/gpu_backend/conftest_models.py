"""Helpers shared by the model tests: tiny configs and a transformers reference with the same weights."""

from __future__ import annotations

import random

import torch
import transformers

from gpu_backend.models import BlockPool, LlamaModel, ModelConfig, SeqState, allocate_kv_cache, make_step

LLAMA3_ROPE = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
BLOCK_SIZE = 4
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def tiny_cfg(kind: str = "llama", **changes) -> ModelConfig:
    """2 layers, hidden 64, 4 heads over 2 KV heads, head_dim 16; the MoE kinds 8 experts, 2 (Mixtral) or 3
    (Qwen3-MoE) per token, so a few tokens leave some experts without any."""
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                bos_token_id=1, eos_token_ids=(2,), name=f"tiny-{kind}")
    if kind == "llama":
        base.update(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)
    elif kind == "qwen2":
        base.update(model_type="qwen2", attention_bias=True, tie_word_embeddings=False, rope_theta=1e6)
    elif kind == "qwen3":
        base.update(model_type="qwen3", qk_norm=True, head_dim=24, tie_word_embeddings=False)
    elif kind == "phi3":
        base.update(model_type="phi3", rope_theta=250000.0, tie_word_embeddings=False)
    elif kind == "qwen3_moe":
        base.update(model_type="qwen3_moe", qk_norm=True, tie_word_embeddings=False, num_experts=8,
                    num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True)
    elif kind == "mixtral":
        base.update(model_type="mixtral", rope_theta=1e6, tie_word_embeddings=False, num_experts=8,
                    num_experts_per_tok=2, intermediate_size=48, moe_intermediate_size=48)
    return ModelConfig(**{**base, **changes})


def hf_reference(cfg: ModelConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """transformers' model of cfg with every parameter random (norm weights near 1, biases nonzero)."""
    hf_cls = getattr(transformers, HF_CLASSES[cfg.model_type])
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    model = hf_cls(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.05 * noise)
    return model


def ours_from(hf: torch.nn.Module, cfg: ModelConfig) -> LlamaModel:
    model = LlamaModel(cfg).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def hf_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of one sequence, every position."""
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


class PagedRun:
    """Drives LlamaModel step by step with non-contiguous, shuffled KV blocks."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0):
        self.model = model
        self.kv_cache = allocate_kv_cache(model.cfg, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        block_ids = list(range(num_blocks))
        random.Random(seed).shuffle(block_ids)
        self.pool = BlockPool(block_ids)

    def step(self, seqs: list[SeqState], q_lens: list[int]) -> list[torch.Tensor]:
        """Feeds the next q_lens[i] tokens of each sequence; returns each one's [q_len, vocab] logits."""
        input_ids, positions, batch = make_step(seqs, q_lens, self.pool, BLOCK_SIZE)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(input_ids, positions, batch, self.kv_cache))
        for seq, n in zip(seqs, q_lens):
            seq.num_cached += n
        return list(logits.split(q_lens))
