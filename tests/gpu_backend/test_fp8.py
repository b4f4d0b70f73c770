"""FP8 weights (`--quantization fp8` and `fp8-partial`, gpu_backend/models/fp8.py): quantization, the FP8 matmuls
against a dequantized reference, which projections each scheme quantizes, a model's logits, and an FP8
compressed-tensors checkpoint read back exactly."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gpu_backend.config import BackendConfig, ConfigError
from gpu_backend.models import LlamaModel, SeqState, load_model
from gpu_backend.models.fp8 import (FP8_MAX, SCHEMES, Fp8Weight, fp8_linear, quantize_tokens, quantize_weight,
                                    release_dense_projections_)
from gpu_backend.models.llama_forward import fuse_weights
from tests.gpu_backend.conftest_models import PagedRun, hf_reference, ours_from, tiny_cfg


def test_each_row_is_scaled_to_the_fp8_range_and_rounds_within_e4m3_precision():
    w = torch.randn(64, 128) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different magnitudes
    q = quantize_weight(w)
    assert q.q.dtype == torch.float8_e4m3fn and q.scale.shape == (64,)
    assert torch.equal(q.q.float().abs().amax(1), torch.full((64,), FP8_MAX))
    err = (q.dequantize() - w).abs()
    # 3 mantissa bits: half a unit in the last place is 1/16 of the value; below 2^-6 the step is 2^-9 absolute
    bound = w.abs() / 16 + q.scale[:, None] * 2.0 ** -9
    assert bool((err <= bound * 1.0001).all())


def test_fp8_linear_equals_the_dequantized_operands_product():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 96, generator=gen), torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen)
    wq = quantize_weight(w)
    xq, xs = quantize_tokens(x)
    reference = (xq.float() * xs) @ wq.dequantize().t() + b
    torch.testing.assert_close(fp8_linear(x, wq, b), reference, rtol=1e-5, atol=1e-5)
    dense = x @ w.t() + b  # and near the dense product: e4m3 on both operands
    assert float((fp8_linear(x, wq, b) - dense).norm() / dense.norm()) < 0.06


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_fp8_linear_is_x_times_the_dequantized_weight(dtype):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(32, 64, generator=gen)
    wq = quantize_weight(w, fp8_activations=False)
    reference = x.float() @ wq.dequantize().t()  # x itself, not x rounded to FP8
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 6e-2)  # bf16: weight and output rounding
    torch.testing.assert_close(fp8_linear(x, wq).float(), reference, rtol=rtol, atol=atol)
    assert fp8_linear(x, wq).dtype == dtype
    def rel_err(y):
        return float((y.float() - reference).norm() / reference.norm())
    # FP8 activations add e4m3's ~2% noise: well above the weight-only path's own rounding
    assert rel_err(fp8_linear(x, quantize_weight(w))) > max(0.005, 3 * rel_err(fp8_linear(x, wq)))


@pytest.mark.parametrize("scheme,fp8_names,dense_names", [
    ("fp8-partial", ("o", "gate_up"), ("qkv", "down")), ("fp8", ("qkv", "o", "gate_up", "down"), ())])
def test_each_scheme_quantizes_its_projections(scheme, fp8_names, dense_names):
    cfg = tiny_cfg("llama")
    model = ours_from(hf_reference(cfg), cfg)
    model.quantization = scheme
    for layer in model.decoder_weights().layers:
        assert all(isinstance(getattr(layer, n), Fp8Weight) for n in fp8_names)
        assert all(getattr(layer, n).fp8_activations == SCHEMES[scheme].fp8_activations for n in fp8_names)
        assert all(isinstance(getattr(layer, n), torch.Tensor) for n in dense_names)


@pytest.mark.parametrize("kind,scheme", [("llama", "fp8"), ("qwen2", "fp8"), ("llama", "fp8-partial")])
def test_an_fp8_model_stays_close_to_its_dense_twin(kind, scheme):
    cfg = tiny_cfg(kind)
    hf = hf_reference(cfg)
    dense, fp8 = ours_from(hf, cfg), ours_from(hf, cfg)
    fp8.quantization = scheme
    ids = [5, 17, 42, 3, 88, 61, 9, 30, 71, 12]
    a = PagedRun(dense).step([SeqState(list(ids))], [len(ids)])[0]
    b = PagedRun(fp8).step([SeqState(list(ids))], [len(ids)])[0]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) > 0.99 and not torch.equal(a, b)


def _fp8_checkpoint(tmp_path, cfg, model: LlamaModel) -> dict[str, Fp8Weight]:
    """Save `model` as a compressed-tensors FP8 folder (channel scales, a static input scale); returns the
    quantized projections it wrote, by parameter name."""
    tensors, written = {}, {}
    for name, t in model.state_dict().items():
        t = t.contiguous()
        if name.endswith("_proj.weight"):
            q = quantize_weight(t)
            tensors[name], tensors[name + "_scale"] = q.q, q.scale[:, None].contiguous()
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor([0.05])
            written[name] = q
        elif not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = t
    save_file(tensors, tmp_path / "model.safetensors")
    hf = cfg.to_hf() | {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return written


def test_a_compressed_tensors_fp8_checkpoint_loads_back_bit_for_bit(tmp_path):
    cfg = tiny_cfg("llama")
    written = _fp8_checkpoint(tmp_path, cfg, ours_from(hf_reference(cfg), cfg))
    _, model, _ = load_model(str(tmp_path), progress=False)
    assert model.quantization == "fp8"  # implied by the checkpoint: every projection is FP8 already
    layer = model.decoder_weights().layers[1]
    parts = [written[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(layer.qkv.q.view(torch.uint8), torch.cat([p.q for p in parts]).view(torch.uint8))
    torch.testing.assert_close(layer.qkv.scale, torch.cat([p.scale for p in parts]), rtol=0, atol=0)


def test_an_unknown_checkpoint_quantization_and_flag_are_refused(tmp_path):
    cfg = tiny_cfg("llama")
    _fp8_checkpoint(tmp_path, cfg, ours_from(hf_reference(cfg), cfg))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "awq"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="awq"):
        load_model(str(tmp_path), progress=False)
    with pytest.raises(ValueError, match="--quantization 'int4'"):
        load_model("random:smollm2-135m", quantization="int4", progress=False)
    with pytest.raises(ConfigError, match="quantization"):
        BackendConfig(quantization="int4")


def test_releasing_the_dense_projections_keeps_the_fp8_ones():
    cfg = tiny_cfg("llama")
    model = ours_from(hf_reference(cfg), cfg)
    model.quantization = "fp8"
    weights = fuse_weights(model)
    release_dense_projections_(model, weights)
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0
    assert weights.layers[0].down.q.shape == (cfg.hidden_size, cfg.intermediate_size)


def test_releasing_keeps_the_projections_a_scheme_leaves_dense():
    cfg = tiny_cfg("llama")
    model = ours_from(hf_reference(cfg), cfg)
    model.quantization = "fp8-partial"  # q/k/v and down stay dense: down_proj's weight is what the step reads
    weights = fuse_weights(model)
    down = weights.layers[0].down.clone()
    release_dense_projections_(model, weights)
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.weight.numel() == 0 and layer.mlp.gate_proj.weight.numel() == 0
    assert torch.equal(weights.layers[0].down, down) and layer.mlp.down_proj.weight.numel() == down.numel()
    assert layer.self_attn.q_proj.weight.numel() > 0 and weights.layers[0].qkv.numel() > 0
