"""Phi-3/Phi-4, Qwen3-MoE and Mixtral: checkpoints in their real layouts (safetensors shards + index, one
tensor per expert, fused qkv/gate_up) loaded by our loader and held against transformers on the same weights;
routing that sends a batch's tokens to different experts and leaves some without any; config.json fields,
refusals and the presets' shapes; the cpu engine serving a tiny MoE model end to end.
(The prefill/decode/mixed-batch comparisons run on these kinds too: tests/gpu_backend/test_models.py.)"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest_models import PagedRun, hf_logits, hf_reference, tiny_cfg
from gpu_backend.models import PRESETS, ModelConfig, SeqState, greedy_generate, load_model
from gpu_backend.models import moe as moe_module
from gpu_backend.models import weights as weights_module
from gpu_backend.models.moe import expert_mlp, moe_reference, route

ATOL = 1e-4
NEW_KINDS = ["phi3", "qwen3_moe", "mixtral"]


def _tokens(n: int, seed: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- checkpoints in the real layouts ----
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_sharded_checkpoint_loads_and_matches_transformers(tmp_path, kind):
    cfg = tiny_cfg(kind)
    hf = hf_reference(cfg, seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1, "the checkpoint should span several shards"
    if kind == "qwen3_moe":
        assert "model.layers.1.mlp.experts.7.up_proj.weight" in index
    if kind == "mixtral":
        assert {"model.layers.0.block_sparse_moe.experts.3.w2.weight",
                "model.layers.0.block_sparse_moe.gate.weight"} <= set(index)
    if kind == "phi3":
        assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(index)
    loaded_cfg, model, _ = load_model(str(tmp_path), progress=False)
    assert loaded_cfg.replace(name=cfg.name) == cfg
    seqs = [SeqState(_tokens(12, seed=4)), SeqState(_tokens(7, seed=5))]
    run = PagedRun(model)
    for seq, logits in zip(seqs, run.step(seqs, [12, 7])):
        torch.testing.assert_close(logits, hf_logits(hf, seq.token_ids), atol=ATOL, rtol=0)


def test_missing_expert_is_reported(tmp_path):
    cfg = tiny_cfg("mixtral")
    hf_reference(cfg).save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(str(tmp_path), progress=False)


def test_expert_past_num_experts_is_refused(tmp_path):
    cfg = tiny_cfg("qwen3_moe")
    hf_reference(cfg).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 6, "num_local_experts": 6}))
    with pytest.raises(ValueError, match="expert past the config's num_experts"):
        load_model(str(tmp_path), progress=False)


# ---- routing ----
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_batch_routes_to_different_experts_and_leaves_some_without_tokens(tmp_path, monkeypatch, kind):
    cfg = tiny_cfg(kind)
    hf = hf_reference(cfg, seed=6)
    hf.save_pretrained(tmp_path)
    _, ours, _ = load_model(str(tmp_path), progress=False)
    routed: list[torch.Tensor] = []
    real = moe_module.moe_reference

    def recording(x, router, gate_up, down, top_k, renormalize):
        routed.append(route(x, router, top_k, renormalize)[1])
        return real(x, router, gate_up, down, top_k, renormalize)

    monkeypatch.setattr("gpu_backend.models.torch_ops.moe_reference", recording)
    a, b = SeqState(_tokens(9, seed=7)), SeqState(_tokens(5, seed=8))
    run = PagedRun(ours)
    run.step([a, b], [6, 2])
    routed.clear()
    logits = run.step([a, b], [1, 1])                                       # a decode batch of two tokens
    assert len(routed) == cfg.num_layers
    used = [set(ids.flatten().tolist()) for ids in routed]                 # per layer
    assert all(len(u) < cfg.num_experts for u in used), "two tokens x top_k leave experts without tokens"
    assert any(set(ids[0].tolist()) != set(ids[1].tolist()) for ids in routed), "tokens should differ"
    for seq, got in zip((a, b), logits):
        want = hf_logits(hf, seq.token_ids[:seq.num_cached])[-1:]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_reference_equals_every_expert_masked(renormalize):
    """The torch op against a dense computation: every expert on every token, weighted by the routing."""
    gen = torch.Generator().manual_seed(9)
    num_experts, top_k, hidden, inter, tokens = 6, 2, 16, 12, 5
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    probs = torch.softmax(x @ router.T, dim=-1)
    top = probs.topk(top_k, dim=-1)
    dense_w = torch.zeros_like(probs).scatter(1, top.indices, top.values)
    if renormalize:
        dense_w = dense_w / dense_w.sum(-1, keepdim=True)
    every = torch.stack([expert_mlp(x, gate_up[e], down[e]) for e in range(num_experts)], dim=1)  # [T, E, hidden]
    want = (every * dense_w[..., None]).sum(1)
    torch.testing.assert_close(moe_reference(x, router, gate_up, down, top_k, renormalize), want,
                               atol=1e-5, rtol=1e-5)


# ---- config.json of the real checkpoints, refusals, presets ----
QWEN3_30B_A3B_HF = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_32B_HF = {  # Qwen/Qwen3-32B config.json
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "intermediate_size": 25600, "max_position_embeddings": 40960, "num_attention_heads": 64,
    "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936}
PHI4_HF = {  # microsoft/phi-4 config.json
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_dropout": 0.0, "bos_token_id": 100257,
    "embd_pdrop": 0.0, "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17920, "max_position_embeddings": 16384, "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
    "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 100352}
MIXTRAL_HF = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 32000}


@pytest.mark.parametrize("preset, hf", [("qwen3-30b-a3b", QWEN3_30B_A3B_HF), ("qwen3-32b", QWEN3_32B_HF),
                                        ("phi-4", PHI4_HF), ("mixtral-8x7b", MIXTRAL_HF)])
def test_presets_equal_the_published_configs(preset, hf):
    cfg = ModelConfig.from_hf(hf, name=preset)
    assert cfg.replace(eos_token_ids=PRESETS[preset].eos_token_ids) == PRESETS[preset]


@pytest.mark.parametrize("preset, total_b, active_b", [
    ("qwen3-30b-a3b", 30.5, 3.35), ("qwen3-32b", 32.8, 32.8), ("phi-4", 14.7, 14.7), ("mixtral-8x7b", 46.7, 12.9)])
def test_preset_parameter_counts(preset, total_b, active_b):
    cfg = PRESETS[preset]
    assert abs(cfg.num_params / 1e9 - total_b) < 0.05 and abs(cfg.active_params / 1e9 - active_b) < 0.05


def test_decode_weight_bytes_counts_the_chosen_experts_and_the_embedding_rows_looked_up():
    cfg = PRESETS["qwen3-30b-a3b"]
    expert_gb = 3 * 2048 * 768 * 2 * 48 / 1e9                                # one expert in every layer, bf16
    embed_gb = 151936 * 2048 * 2 / 1e9                                        # untied: the LM head is another table
    assert cfg.expected_experts(1) == pytest.approx(8) and cfg.expected_experts(256) == pytest.approx(128)
    batch1 = cfg.decode_weight_bytes(1, torch.bfloat16) / 1e9
    # issue 25's floor: active experts, attention, router, LM head; the embedding table but for one row is not read
    assert batch1 == pytest.approx(cfg.active_params * 2 / 1e9 - embed_gb, abs=1e-5) and 6.0 < batch1 < 6.2
    assert cfg.decode_weight_bytes(256, torch.bfloat16) / 1e9 == pytest.approx(
        cfg.weight_bytes("bfloat16") / 1e9 - embed_gb, abs=2e-3)
    assert cfg.decode_weight_bytes(8, torch.bfloat16) / 1e9 == pytest.approx(batch1 + 43.6 * expert_gb, rel=1e-3)
    dense = PRESETS["llama-3-8b"]
    # issue 22's 15.01 GB: Llama-3-8B's weights without the embedding table
    assert dense.decode_weight_bytes(1, torch.bfloat16) / 1e9 == pytest.approx(15.01, abs=0.005)
    tied = dense.replace(tie_word_embeddings=True)
    assert tied.decode_weight_bytes(4, torch.bfloat16) == tied.weight_bytes(torch.bfloat16)


def test_tiny_moe_parameter_count_equals_the_model():
    for kind in ("qwen3_moe", "mixtral", "phi3"):
        cfg = tiny_cfg(kind)
        assert sum(p.numel() for p in hf_reference(cfg).parameters()) == cfg.num_params


@pytest.mark.parametrize("base, change, message", [
    (PHI4_HF, {"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
    (PHI4_HF, {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope type 'longrope' is not supported"),
    (QWEN3_30B_A3B_HF, {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    (QWEN3_30B_A3B_HF, {"mlp_only_layers": [0, 1]}, "mlp_only_layers"),
    (QWEN3_30B_A3B_HF, {"num_experts": None}, "missing required field 'num_experts'"),
    (QWEN3_30B_A3B_HF, {"num_experts_per_tok": 200}, "num_experts_per_tok"),
    (QWEN3_30B_A3B_HF, {"shared_expert_intermediate_size": 5632}, "shared experts are not supported"),
    (MIXTRAL_HF, {"num_local_experts": None}, "num_local_experts"),
])
def test_from_hf_refuses_unsupported_variants(base, change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**base, **change})


def test_phi3_sliding_window_caps_the_context():
    cfg = ModelConfig.from_hf({**PHI4_HF, "sliding_window": 2047})
    assert cfg.max_position_embeddings == 2047 and cfg.model_type == "phi3"


def test_mixtral_is_refused_on_an_h100_and_fits_an_h200(monkeypatch):
    cfg = PRESETS["mixtral-8x7b"]
    for name, total_bytes, fits in (("NVIDIA H100 80GB HBM3", 85_031_714_816, False),
                                    ("NVIDIA H200", 150_754_820_096, True)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, t=total_bytes: SimpleNamespace(total_memory=t))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d, n=name: n)
        if fits:
            weights_module.check_fits(cfg, torch.bfloat16, torch.device("cuda"))
        else:
            with pytest.raises(ValueError, match=r"93\.4 GB in torch.bfloat16 \(93405585408 bytes\).*85\.0 GB of "
                                                 r"NVIDIA H100"):
                weights_module.check_fits(cfg, torch.bfloat16, torch.device("cuda"))
    weights_module.check_fits(cfg, torch.bfloat16, torch.device("cpu"))  # the CPU is not checked


# ---- the cpu engine serves a tiny MoE model ----
def test_cpu_engine_serves_a_tiny_moe_model():
    from gpu_backend.models import LlamaModel
    from protocols.ring import FinishReason, RequestSpec
    test_engine_loop = pytest.importorskip("test_engine_loop")
    cfg = tiny_cfg("qwen3_moe", max_position_embeddings=test_engine_loop.CONTEXT_LEN)
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaky logits: greedy choices far from ties
    prompts = test_engine_loop._prompts(4, cfg.vocab_size, seed=3)
    want = greedy_generate(model, prompts, 10, block_size=4)
    e = test_engine_loop.Engine((cfg, model))
    try:
        slots = [e.submit(RequestSpec(i, p, 10, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
        e.run_until_done()
        assert [e.tokens[s] for s in slots] == want
        assert all(e.finishes[s] is FinishReason.LENGTH for s in slots)
        assert e.loop.scheduler.num_free == e.runner.num_blocks
    finally:
        e.close()


# ---- FP8 (--quantization fp8): the attention projections (and Phi-3's MLP), not the experts ----
@pytest.mark.parametrize("kind", ["phi3", "qwen3_moe"])
def test_fp8_quantizes_the_projections_and_keeps_the_experts(kind):
    from gpu_backend.models.fp8 import Fp8Weight, release_dense_projections_
    from gpu_backend.models.llama_forward import fuse_weights
    from conftest_models import ours_from
    cfg = tiny_cfg(kind)
    hf = hf_reference(cfg)
    dense, fp8 = ours_from(hf, cfg), ours_from(hf, cfg)
    fp8.quantization = "fp8"
    ids = [5, 17, 42, 3, 88, 61, 9, 30, 71, 12]
    a = PagedRun(dense).step([SeqState(list(ids))], [len(ids)])[0]
    b = PagedRun(fp8).step([SeqState(list(ids))], [len(ids)])[0]
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.99 and not torch.equal(a, b)
    weights = fuse_weights(fp8)
    layer = weights.layers[0]
    assert isinstance(layer.qkv, Fp8Weight) and isinstance(layer.o, Fp8Weight)
    release_dense_projections_(fp8, weights)
    mlp = fp8.model.layers[0].mlp
    if cfg.is_moe:
        assert layer.gate_up is None and layer.experts_gate_up.dtype == torch.float32
        assert mlp.gate.weight.numel() == cfg.num_experts * cfg.hidden_size   # the router stays
        assert mlp.experts.down_proj.numel() > 0
    else:
        assert isinstance(layer.gate_up, Fp8Weight) and mlp.gate_up_proj.weight.numel() == 0
    assert fp8.model.layers[0].self_attn.o_proj.weight.numel() == 0
