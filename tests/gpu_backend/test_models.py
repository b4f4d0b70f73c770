"""LlamaModel over the paged cache against transformers on the same weights; ModelConfig; load_model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest_models import BLOCK_SIZE, PagedRun, hf_logits, hf_reference, ours_from, tiny_cfg
from gpu_backend.models import (PRESETS, AttnBatch, ModelConfig, SeqState, allocate_kv_cache, greedy_generate,
                                load_model, model_fingerprint)

ATOL = 1e-4
KINDS = ["llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"]


def _tokens(n: int, seed: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    cfg = tiny_cfg(request.param)
    hf = hf_reference(cfg)
    return cfg, hf, ours_from(hf, cfg)


def test_whole_prompt_prefill_matches_transformers(pair):
    cfg, hf, ours = pair
    seq = SeqState(_tokens(13, seed=1))
    (logits,) = PagedRun(ours).step([seq], [13])
    torch.testing.assert_close(logits, hf_logits(hf, seq.token_ids), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(pair):
    cfg, hf, ours = pair
    tokens = _tokens(19, seed=2)
    ref = hf_logits(hf, tokens)
    run, seq = PagedRun(ours, seed=3), SeqState(tokens)
    got = [run.step([seq], [n])[0] for n in (5, 3, 7, 1, 1, 1, 1)]
    assert seq.block_table != sorted(seq.block_table), "blocks should be non-contiguous"
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_mixed_batch_decode_and_prefill_matches_transformers(pair):
    cfg, hf, ours = pair
    a, b, c = SeqState(_tokens(14, seed=4)), SeqState(_tokens(12, seed=5)), SeqState(_tokens(9, seed=6))
    refs = {id(s): hf_logits(hf, s.token_ids) for s in (a, b, c)}
    run = PagedRun(ours, seed=7)
    run.step([a, c], [10, 6])                                   # two fresh prefills in one call
    steps = [([a, b, c], [1, 7, 1]),                            # decode rows around a prefill chunk
             ([b, a, c], [5, 1, 1]),                            # chunk with context, decodes after it
             ([c, a], [1, 1]), ([a], [1])]
    for seqs, q_lens in steps:
        for seq, n, logits in zip(seqs, q_lens, run.step(seqs, q_lens)):
            end = seq.num_cached
            torch.testing.assert_close(logits, refs[id(seq)][end - n:end], atol=ATOL, rtol=0)
    assert (a.num_cached, b.num_cached, c.num_cached) == (14, 12, 9)


def test_decode_uses_only_its_own_blocks(pair):
    # garbage in the rest of the cache must not leak into attention (padding is masked)
    cfg, hf, ours = pair
    tokens = _tokens(9, seed=8)
    run, short = PagedRun(ours, seed=9), SeqState(tokens)
    other = SeqState(_tokens(31, seed=10))
    run.step([other, short], [30, 8])
    run.kv_cache[:, :, run.pool.free_ids] = 1e4
    logits = run.step([short, other], [1, 1])[0]
    torch.testing.assert_close(logits, hf_logits(hf, tokens)[8:9], atol=ATOL, rtol=0)


def test_greedy_generate_matches_transformers_generate(pair):
    cfg, hf, ours = pair
    prompts = [_tokens(n, seed=20 + n) for n in (3, 11, 6)]
    got = greedy_generate(ours, prompts, max_new_tokens=8, block_size=BLOCK_SIZE, prefill_chunk=4)
    for prompt, out in zip(prompts, got):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                              eos_token_id=None, pad_token_id=0)
        assert out == ref[0, len(prompt):].tolist()


def test_greedy_generate_stops_at_stop_token(pair):
    cfg, hf, ours = pair
    prompt = _tokens(5, seed=30)
    free_run = greedy_generate(ours, [prompt], max_new_tokens=6, block_size=BLOCK_SIZE)[0]
    stopped = greedy_generate(ours, [prompt], max_new_tokens=6, block_size=BLOCK_SIZE,
                              stop_token_ids=(free_run[2],))[0]
    assert stopped == free_run[: free_run.index(free_run[2]) + 1]


def test_attn_batch_is_validated():
    cfg = tiny_cfg()
    model = ours_from(hf_reference(cfg), cfg)
    cache = allocate_kv_cache(cfg, 4, BLOCK_SIZE, torch.float32, "cpu")
    ids = torch.zeros(3, dtype=torch.long)
    bad = AttnBatch(q_lens=[3], ctx_lens=[2], block_tables=[[0]], slot_mapping=torch.arange(3))
    with pytest.raises(ValueError, match="q_len=3, ctx_len=2"):
        model(ids, torch.arange(3), bad, cache)
    short = AttnBatch(q_lens=[3], ctx_lens=[9], block_tables=[[0, 1]], slot_mapping=torch.arange(3))
    with pytest.raises(ValueError, match="2 blocks of 4 for ctx_len=9"):
        model(ids, torch.arange(3), short, cache)


def test_tied_embeddings_share_one_parameter():
    cfg = tiny_cfg("llama")
    model = ours_from(hf_reference(cfg), cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not ours_from(hf_reference(tiny_cfg("qwen2")), tiny_cfg("qwen2")).cfg.tie_word_embeddings


# ---- ModelConfig ----
LLAMA32_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}


def test_from_hf_llama32():
    cfg = ModelConfig.from_hf(LLAMA32_HF, name="llama-3.2-1b")
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 32, 8, 64)
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.tie_word_embeddings
    assert cfg.rope_scaling == {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 2 * 16 * 8 * 64 * 2
    assert cfg.kv_bytes_per_token("float32") == 2 * 16 * 8 * 64 * 4
    assert 1.2e9 < cfg.num_params < 1.3e9


def test_from_hf_transformers5_rope_parameters_and_int_eos():
    hf = {k: v for k, v in LLAMA32_HF.items() if k not in ("rope_scaling", "rope_theta")}
    hf["rope_parameters"] = {**LLAMA32_HF["rope_scaling"], "rope_theta": 500000.0}
    hf["eos_token_id"] = 128009
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 32.0 and cfg.eos_token_ids == (128009,)
    plain = ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


def test_from_hf_qwen2_and_mistral():
    qwen = ModelConfig.from_hf({**LLAMA32_HF, "model_type": "qwen2", "rope_scaling": None, "sliding_window": 4096,
                                "use_sliding_window": False, "tie_word_embeddings": False})
    assert qwen.attention_bias and not qwen.tie_word_embeddings and qwen.max_position_embeddings == 131072
    mistral = ModelConfig.from_hf({**LLAMA32_HF, "model_type": "mistral", "rope_scaling": None,
                                   "sliding_window": 4096})
    assert mistral.max_position_embeddings == 4096 and not mistral.attention_bias


def test_to_hf_round_trips():
    for kind in KINDS:
        cfg = tiny_cfg(kind)
        again = ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf())), name=cfg.name)
        assert again == cfg


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"num_hidden_layers": None}, "missing required field 'num_hidden_layers'"),
    ({"num_key_value_heads": 5}, "multiple of num_kv_heads"),
    ({"eos_token_id": 200000}, "outside the vocabulary"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "o_proj bias"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
])
def test_from_hf_rejects_with_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**LLAMA32_HF, **change})


def test_model_config_is_frozen_and_validated():
    cfg = tiny_cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3
    with pytest.raises(ValueError, match="head_dim must be even"):
        cfg.replace(head_dim=15)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        cfg.replace(num_layers=0)
    assert cfg.replace(eos_token_ids=[2, 3]).eos_token_ids == (2, 3)


# ---- load_model / model_fingerprint ----
@pytest.mark.parametrize("kind, shard", [("llama", None), ("qwen2", "20KB")])
def test_load_model_from_hf_folder(tmp_path, kind, shard):
    cfg = tiny_cfg(kind)
    hf = hf_reference(cfg, seed=5)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    loaded_cfg, model, model_dir = load_model(str(tmp_path), progress=False)
    assert model_dir == tmp_path and loaded_cfg.replace(name=cfg.name) == cfg
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    seq = SeqState(_tokens(10, seed=11))
    (logits,) = PagedRun(model).step([seq], [10])
    torch.testing.assert_close(logits, hf_logits(hf, seq.token_ids), atol=ATOL, rtol=0)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        load_model("random:nope")
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg().to_hf()))
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_model(str(tmp_path))


def test_load_model_reports_missing_weights(tmp_path):
    cfg = tiny_cfg("qwen2")
    hf = hf_reference(cfg)
    sd = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp" not in k}
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(str(tmp_path), progress=False)


def test_random_preset_smollm2_is_deterministic():
    cfg, model, model_dir = load_model("random:smollm2-135m", progress=False)
    assert model_dir is None and cfg.num_layers == 30 and cfg.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    embed = model.model.embed_tokens.weight
    assert model.lm_head.weight is embed and abs(embed.std().item() - 0.02) < 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones(576))
    first = embed[:4, :8].clone()
    del model
    _, again, _ = load_model("random:smollm2-135m", progress=False)
    assert torch.equal(again.model.embed_tokens.weight[:4, :8], first)


def test_model_fingerprint(tmp_path):
    cfg = tiny_cfg()
    hf_reference(cfg).save_pretrained(tmp_path)
    fp = model_fingerprint(tmp_path)
    assert len(fp) == 32 and int(fp, 16) >= 0 and fp == model_fingerprint(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert model_fingerprint(tmp_path) != fp
    assert model_fingerprint("random:smollm2-135m") == model_fingerprint(PRESETS["smollm2-135m"])
    assert model_fingerprint(cfg) != model_fingerprint(cfg.replace(num_layers=3))
