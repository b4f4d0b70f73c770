"""A byte-level tokenizer for `random:<preset>` models that JSON can be spelled in (structured-output benchmarks).

The tokenizer `random:<preset>` serves by default is a WordLevel vocabulary of words `w0 .. wN`: no token spells
`{`, and llguidance cannot read its decoder, so every constrained request fails there. This one has the model's
vocabulary size and EOS ids and is one llguidance reads (a BPE model, byte-level decoder):
- the 256 byte tokens (any text can be spelled), the chat template's role words, and ` w0 .. w10000` (a leading
  space) with the merges that make them: a `w<id>` word of a benchmark prompt is still one token, so prompt
  lengths stay exact (the template's role words and spaces add a few). Tokenizing loses nothing (no whitespace
  split): llguidance tokenizes forced text with it, and a lossy tokenizer breaks its masks;
- JSON pieces (`{"`, `": "`, `", "`, `true`, digit runs, ...), then seeded lowercase words with and without a
  leading space, as a real vocabulary's bulk, up to the vocabulary size;
- the model's BOS and EOS ids as special tokens.
The logits of random weights are noise, so what the masks allow is what the model writes, and a benchmark
measures the masks' cost over a vocabulary of the model's size made of word-like pieces. A real tokenizer's trie
differs (more punctuation pieces, more shared prefixes): figures from here are the mechanism's, not Llama 3's
tokenizer's exactly.

    python bench/structured_vocab.py --preset llama-3-8b --cache /tmp/blink-cache

writes the folder `random:llama-3-8b` reads its tokenizer from under that cache (BLINK_CACHE), so a backend
started with BLINK_CACHE=/tmp/blink-cache serves it: the folder the backend's own `ensure_random_tokenizer`
names, with its tokenizer.json replaced (the backend writes one only where none is).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_WORD_IDS = 10_001  # blink bench's workloads draw prompt ids in 0..10000 (workloads.TOKEN_ID_HIGH)
ROLE_WORDS = ("system", "user", "assistant", "tool")
JSON_PIECES = ('{"', '"}', '":', '",', '", "', '": "', '": ', '["', '"]', '[{', '}]', '}, {', '},', '], ', '": [',
               '": {', ': ', ', ', 'true', 'false', 'null', ' "')
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MARKER = "blink-structured-vocab"  # in tokenizer_config.json: tells this folder from the default one


def byte_chars() -> list[str]:
    """The byte-level alphabet (GPT-2's): byte b is spelled by the character byte_chars()[b]."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def spelled(text: str, alphabet: list[str]) -> str:
    return "".join(alphabet[b] for b in text.encode())


def word_merges(words) -> tuple[list[str], list[tuple[str, str]]]:
    """Every prefix of `words` (2 characters on) as a token, and the merges building each from the one before."""
    tokens, merges, seen = [], [], set()
    for word in words:
        for end in range(2, len(word) + 1):
            if word[:end] not in seen:
                seen.add(word[:end])
                tokens.append(word[:end])
                merges.append((word[:end - 1], word[end - 1]))
    return tokens, merges


def bulk_words(rng: random.Random, alphabet: list[str]):
    """Endless seeded words of 2-9 letters, half with a leading space, some capitalised (byte-level spelled)."""
    while True:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 9)))
        word = word.capitalize() if rng.random() < 0.2 else word
        yield spelled((" " if rng.random() < 0.5 else "") + word, alphabet)


def vocabulary(vocab_size: int, special_ids: dict[int, str], seed: int = 0) -> tuple[dict[str, int], list]:
    """(token -> id, merges): the pieces above at the ids the special tokens leave free."""
    alphabet = byte_chars()
    space = alphabet[ord(" ")]
    # the spaced role words first: their merges must outrank the bare words' (" assistant" is one token)
    words = [*(space + w for w in ROLE_WORDS), *ROLE_WORDS, *(f"{space}w{i}" for i in range(PROMPT_WORD_IDS))]
    built, merges = word_merges(words)
    pieces = [*alphabet, *built, *(spelled(p, alphabet) for p in JSON_PIECES),
              *(f"{n:02d}" for n in range(100)), *(f"{n:03d}" for n in range(1000))]
    vocab: dict[str, int] = {}
    free_ids = (i for i in range(vocab_size) if i not in special_ids)
    filler = bulk_words(random.Random(seed), alphabet)
    for token_id in free_ids:
        token = pieces[len(vocab)] if len(vocab) < len(pieces) else next(filler)
        while token in vocab:
            token = next(filler)
        vocab[token] = token_id
    if len(vocab) < len(pieces):
        raise ValueError(f"a vocabulary of {vocab_size} tokens has no room for the {len(pieces)} base pieces")
    vocab.update({name: i for i, name in special_ids.items()})
    return vocab, merges


def build_tokenizer(vocab_size: int, bos_id: int | None, eos_ids, seed: int = 0) -> Tokenizer:
    """The tokenizer (see the module docstring): byte-level BPE over the whole text, merging prompt words only."""
    special = {i: f"<|special_{i}|>" for i in eos_ids}
    if bos_id is not None:
        special[bos_id] = f"<|special_{bos_id}|>"
    vocab, merges = vocabulary(vocab_size, special, seed)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in special.values()])
    return tok


def write_for_preset(preset: str, cache_dir: Path) -> Path:
    """Put this tokenizer where `random:<preset>` takes its tokenizer from under `cache_dir`; its folder."""
    from gpu_backend.models.presets import preset_config
    from gpu_backend.models.random_tokenizer import CHAT_TEMPLATE, ensure_random_tokenizer

    cfg = preset_config(preset)
    target = ensure_random_tokenizer(cfg, cache_dir)  # the folder the backend will read
    tok = build_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids)
    tmp = target / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(target / "tokenizer.json")
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, MARKER: True}))
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b", help="the `random:<preset>` model's preset")
    p.add_argument("--cache", required=True, help="the backend's BLINK_CACHE")
    args = p.parse_args(argv)
    print(write_for_preset(args.preset, Path(args.cache)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
