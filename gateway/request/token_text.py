"""Token ids as logprobs show them: each token's own bytes, and its text as OpenAI writes it.

A token of a byte-level BPE vocabulary (GPT-2, Llama 3, Qwen, SmolLM) can hold part of a UTF-8
character; its text is then its bytes as `\\xNN` escapes and `bytes` says which bytes they are, as
OpenAI reports such tokens. Decoding one token alone (`tokenizer.decode([id])`) would give U+FFFD.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer, decoders

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_DECODER = _byte_level_alphabet()


class TokenTexts:
    """Bytes and display text of token ids, cached (a vocabulary is small; logprobs repeat tokens)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._bytes_of(token_id)
            entry = self._cache[token_id] = (raw.decode("utf-8", "backslashreplace"), raw)
        return entry

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
