"""A Hugging Face folder with random weights of a preset's shapes, for peers that load only from disk.

    python bench/peer_hf_model.py random:llama-3-8b /tmp/peer-model

Writes config.json, model.safetensors (bf16, the same random init as `random:<preset>`), a WordLevel
tokenizer (words w0..wN, one word = one token, with a chat template) and a generation config with no EOS,
so a peer such as `transformers serve` generates every requested token, as `ignore_eos` does here.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_backend.models import load_model  # noqa: E402
from gpu_backend.models.random_tokenizer import CHAT_TEMPLATE, ensure_random_tokenizer  # noqa: E402


def main(spec: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, model, _ = load_model(spec, device="cuda" if torch.cuda.is_available() else "cpu")
    tensors = {k: v.contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = {**cfg.to_hf(), "torch_dtype": "bfloat16", "eos_token_id": None}
    (out_dir / "config.json").write_text(json.dumps(hf, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": None}))
    tok_dir = ensure_random_tokenizer(cfg, out_dir / ".tok")
    shutil.copy(tok_dir / "tokenizer.json", out_dir / "tokenizer.json")
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "unk_token": "w0",
        "pad_token": "w0", "model_max_length": cfg.max_position_embeddings}))
    print(out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:3])
