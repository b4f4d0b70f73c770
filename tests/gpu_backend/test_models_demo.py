"""The demo model (SmolLM2-135M-Instruct imported from GGUF) against transformers on the same folder."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from gpu_backend.models import default_cache_dir, ensure_demo_model, greedy_generate, load_model, model_fingerprint

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="session")
def demo_dir():
    return ensure_demo_model(default_cache_dir(), progress=False)


@pytest.fixture(scope="session")
def tokenizer(demo_dir):
    return transformers.AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="session")
def blink_model(demo_dir):
    return load_model(str(demo_dir), progress=False)


def _chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


def test_demo_folder_is_cached(demo_dir):
    assert demo_dir == default_cache_dir() / "models" / "smollm2-135m-instruct"
    assert ensure_demo_model(default_cache_dir(), progress=False) == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_size > 500e6   # float32, 135M parameters


def test_tokenizers_agree_and_template_renders(demo_dir, tokenizer):
    raw = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    for text in ["Hello, world! 2024 was 365 days.", "  indented\n\tcode = f(x) ** 2", "naïve café 🤗",
                 "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tokenizer(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert raw.encode("2024").ids == [raw.token_to_id(d) for d in "2024"]   # digits split one by one
    assert raw.encode("<|im_end|>").ids == [2]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_generation_matches_transformers(demo_dir, tokenizer, blink_model):
    cfg, model, _ = blink_model
    hf = transformers.LlamaForCausalLM.from_pretrained(demo_dir).eval()
    prompts = [_chat_ids(tokenizer, q) for q in QUESTIONS]
    ours = greedy_generate(model, prompts, max_new_tokens=20, stop_token_ids=cfg.eos_token_ids)
    for prompt, got in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt):]
        assert got == ref.tolist(), (tokenizer.decode(got), tokenizer.decode(ref))
    assert all(len(g) >= 5 for g in ours)


def test_imported_weights_know_a_fact(tokenizer, blink_model):
    # independent of transformers: a wrong Q/K un-permutation or dequantisation gives gibberish
    cfg, model, _ = blink_model
    (out,) = greedy_generate(model, [_chat_ids(tokenizer, QUESTIONS[0])], 16, stop_token_ids=cfg.eos_token_ids)
    assert "Paris" in tokenizer.decode(out)


def test_demo_fingerprint_is_stable(demo_dir):
    fp = model_fingerprint(demo_dir)
    assert fp == model_fingerprint(str(demo_dir)) and len(fp) == 32
