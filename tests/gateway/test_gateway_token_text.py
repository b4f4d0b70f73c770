"""Token texts for logprobs: a token's own bytes, partial UTF-8 characters as \\xNN escapes."""
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from gateway.request.token_text import TokenTexts


def test_byte_level_tokens_give_their_bytes(byte_tokenizer):
    texts = TokenTexts(byte_tokenizer)
    ids = byte_tokenizer.encode("hello 日").ids
    assert b"".join(texts.bytes(i) for i in ids) == "hello 日".encode()
    partial = [i for i in ids if len(texts.bytes(i)) == 1 and texts.bytes(i)[0] >= 0x80]
    assert partial, "the CJK character should be split over single-byte tokens"
    assert texts.text(partial[0]).startswith("\\x") and len(texts.text(partial[0])) == 4
    assert texts.text(byte_tokenizer.token_to_id("<|im_end|>")) == "<|im_end|>"


def test_space_prefixed_token_is_a_space(byte_tokenizer):
    texts = TokenTexts(byte_tokenizer)
    [first, *rest] = byte_tokenizer.encode(" the").ids
    assert "".join(texts.text(i) for i in [first, *rest]) == " the"


def test_byte_fallback_and_plain_vocabularies():
    tok = Tokenizer(models.WordLevel({"<0xE2>": 0, "hi": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    texts = TokenTexts(tok)
    assert texts.bytes(0) == b"\xe2" and texts.text(0) == "\\xe2"
    assert texts.text(1) == "hi" and texts.bytes(99) == b""
