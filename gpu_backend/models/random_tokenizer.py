"""A tokenizer folder for `random:<preset>` models, so the gateway can serve them (benchmarks).

Random weights have no tokenizer. This writes a `tokenizers` WordLevel vocabulary of words `w0 .. wN`
(one word = one token id, split on whitespace) and a plain chat template, under the cache. Benchmarks
send token-id prompts or `w<id>` text; generated ids come back as `w<id>` words.
"""
from __future__ import annotations

import json
from pathlib import Path

from .config import ModelConfig

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def ensure_random_tokenizer(cfg: ModelConfig, cache_dir: Path) -> Path:
    """Folder with tokenizer.json and tokenizer_config.json for cfg's vocabulary (written once)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    target = Path(cache_dir) / "random-tokenizers" / f"{cfg.name}-v{cfg.vocab_size}"
    if (target / "tokenizer.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tmp = target / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(target / "tokenizer.json")
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return target
