"""Rebuild a Hugging Face `tokenizer.json` (+ tokenizer_config.json) from a GGUF vocabulary.

Supports GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizers named
by `tokenizer.ggml.pre`: smollm, gpt2/default, llama-bpe (Llama 3), qwen2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Llama 3 (tiktoken cl100k-style) split: letters, numbers up to 3 digits, punctuation runs, newlines
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, _byte_level(use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer factory, BPE ignore_merges, NFC normalizer)
_PRE_TOKENIZERS = {
    "smollm": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                _byte_level(use_regex=True)]), False, False),
    "gpt2": (lambda: _byte_level(use_regex=True), False, False),
    "default": (lambda: _byte_level(use_regex=True), False, False),
    "llama-bpe": (lambda: _regex_then_bytes(_LLAMA3_SPLIT), True, False),
    "qwen2": (lambda: _regex_then_bytes(_QWEN2_SPLIT), False, True),
}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """meta: the GGUF key/values (tokenizer.ggml.*). Returns a byte-level BPE tokenizers.Tokenizer."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (only 'gpt2' byte-level BPE; "
                         f"SentencePiece 'llama' vocabularies are not)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(_PRE_TOKENIZERS)}")
    make_pre, ignore_merges, nfc = _PRE_TOKENIZERS[pre]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    _add_special_tokens(tok, tokens, meta.get("tokenizer.ggml.token_type"))
    return tok


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token") or bos_id is None:
        return byte_level
    bos = tokens[bos_id]
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, bos_id)])
    return processors.Sequence([byte_level, template])


def _add_special_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int] | None) -> None:
    if token_types is None:
        return
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(token_types) if t == TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(token_types) if t == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def special_token_ids(meta: dict[str, Any]) -> dict[str, int | None]:
    keys = ("bos", "eos", "eot", "eom", "unknown", "padding")
    return {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in keys}


def write_tokenizer_files(meta: dict[str, Any], tok: Tokenizer, out_dir: Path, max_len: int) -> None:
    """Writes tokenizer.json (from build_tokenizer), tokenizer_config.json and special_tokens_map.json."""
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    ids = special_token_ids(meta)
    name = lambda key: None if ids[key] is None else tokens[ids[key]]  # noqa: E731
    special = {"bos_token": name("bos"), "eos_token": name("eos"), "unk_token": name("unknown"),
               "pad_token": name("padding")}
    special = {k: v for k, v in special.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))
