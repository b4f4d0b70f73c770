"""Streaming detokenization: multi-byte characters split over tokens, stop strings over token boundaries."""

from __future__ import annotations

import codecs
import random

import pytest

from gateway.request.detokenize import IncrementalDetokenizer, PieceDetokenizer, StopMatcher, TextStream, TokenPieces

MIXED = "ok 🙂 héllo 世界 done 👩‍💻!"


def pieces(tokenizer, ids, context=()):
    detok = IncrementalDetokenizer(tokenizer, context)
    out = [detok.add(t) for t in ids]
    return out, detok.flush()


def test_multibyte_split_over_tokens_is_never_emitted_in_halves(byte_tokenizer):
    ids = byte_tokenizer.encode(MIXED).ids
    emoji_ids = byte_tokenizer.encode("🙂").ids
    assert len(emoji_ids) == 4  # the test means something only if the emoji spans several tokens
    out, tail = pieces(byte_tokenizer, ids)
    assert all("\ufffd" not in p for p in out)
    assert "".join(out) + tail == MIXED
    assert tail == ""
    assert "🙂" in out and "世" in out  # each character comes out whole, in one piece


def test_held_bytes_come_out_when_the_character_completes(byte_tokenizer):
    ids = byte_tokenizer.encode("世").ids
    assert len(ids) == 3
    detok = IncrementalDetokenizer(byte_tokenizer)
    assert [detok.add(t) for t in ids] == ["", "", "世"]


def test_truncated_character_is_flushed_at_the_end(byte_tokenizer):
    ids = byte_tokenizer.encode("a世").ids[:-1]  # the engine stopped mid-character
    out, tail = pieces(byte_tokenizer, ids)
    assert "".join(out) == "a"
    assert tail == "\ufffd"


def test_random_unicode_round_trips(byte_tokenizer):
    rng = random.Random(0)
    alphabet = list("abc xyz,.") + ["é", "ß", "世", "界", "🙂", "🚀", "ü", "\n", "Ω"]
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = byte_tokenizer.encode(text).ids
        out, tail = pieces(byte_tokenizer, ids)
        assert "".join(out) + tail == text
        assert all("\ufffd" not in p for p in out)


def test_context_ids_do_not_leak_into_output(byte_tokenizer):
    prompt = byte_tokenizer.encode("hello world").ids
    ids = byte_tokenizer.encode(" the fox").ids
    out, tail = pieces(byte_tokenizer, ids, context=prompt)
    assert "".join(out) + tail == " the fox"


def test_special_tokens_are_skipped(byte_tokenizer):
    ids = byte_tokenizer.encode("hi").ids + [byte_tokenizer.token_to_id("<|im_end|>")]
    out, tail = pieces(byte_tokenizer, ids)
    assert "".join(out) + tail == "hi"


@pytest.mark.parametrize("chunks,stops,expected,matched", [
    (["hel", "lo wo", "rld"], ["o w"], "hell", True),
    (["abc", "xy", "q"], ["xyz"], "abcxyq", False),
    (["ab", "c"], ["abc", "b"], "a", True),  # the earliest match wins
    (["a", "E", "N", "D", "tail"], ["END"], "a", True),
    (["世", "界!"], ["界"], "世", True),
    (["no stop"], [], "no stop", False),
])
def test_stop_matcher(chunks, stops, expected, matched):
    m = StopMatcher(stops)
    out, hit = [], False
    for c in chunks:
        text, hit = m.feed(c)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    assert ("".join(out), hit) == (expected, matched)


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)  # "ST" could start "STOP"
    assert m.feed("x") == ("STx", False)  # it did not


def test_text_stream_stop_across_token_boundaries(byte_tokenizer):
    text = "hello world, the quick brown fox"
    ids = byte_tokenizer.encode(text).ids
    stop = "d, the q"
    stop_ids = byte_tokenizer.encode(stop).ids
    assert len(stop_ids) > 1
    stream = TextStream(byte_tokenizer, [stop])
    out = "".join(stream.add([t]) for t in ids)
    assert stream.stopped
    assert out == "hello worl"
    # tokens were consumed up to the one that completed the stop string, no further
    consumed_text = byte_tokenizer.decode(ids[:stream.num_tokens])
    assert stop in consumed_text and stop not in byte_tokenizer.decode(ids[:stream.num_tokens - 1])
    assert stream.add(ids) == "" and stream.finish() == ""


def test_text_stream_stop_inside_one_update(byte_tokenizer):
    ids = byte_tokenizer.encode("the lazy dog jumps").ids
    stream = TextStream(byte_tokenizer, ["dog"])
    assert stream.add(ids) == "the lazy "
    assert stream.stopped and stream.num_tokens < len(ids)


def test_text_stream_releases_held_text_at_finish(byte_tokenizer):
    stream = TextStream(byte_tokenizer, ["the end"])
    text = stream.add(byte_tokenizer.encode("so the").ids)
    assert text == "so " and not stream.stopped
    assert stream.finish() == "the"


def test_text_stream_multibyte_stop(byte_tokenizer):
    ids = byte_tokenizer.encode("ok 世界 bye").ids
    stream = TextStream(byte_tokenizer, ["界"])
    out = "".join(stream.add([t]) for t in ids)
    assert out == "ok 世" and stream.stopped


# ---------------------------------------------------------------- the per-token pieces path


def _wordpiece_tokenizer():
    """The random-weights vocabulary's decoder (WordPiece, cleanup on) over words, suffixes, punctuation
    that cleanup rewrites, and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = ["w0", "w1", "w22", "hello", "do", "not", "n't", "'", "'s", "'m", ".", ",", "?", "!", "##ing",
             "##s", "é", "世界", "a b"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken("[SEP]", special=True)])
    tok.add_tokens([AddedToken("<plain>", special=False)])
    return tok


def _both(tokenizer, ids, context=()):
    """Each token's text and the flush, by the window decoder and by the pieces."""
    generic = IncrementalDetokenizer(tokenizer, context)
    fast = PieceDetokenizer(TokenPieces.for_tokenizer(tokenizer), context)
    return ([generic.add(t) for t in ids], generic.flush()), ([fast.add(t) for t in ids], fast.flush())


def test_pieces_give_the_window_decoders_text_token_by_token(byte_tokenizer):
    rng = random.Random(1)
    alphabet = list("abc xyz,.'\n") + ["é", "ß", "世", "🙂", "👩‍💻", "<|im_end|>", "<|endoftext|>"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = byte_tokenizer.encode(text).ids
        context = byte_tokenizer.encode(rng.choice(["", "hi", "<|im_start|>", "prompt 世界"])).ids
        generic, fast = _both(byte_tokenizer, ids, context)
        assert fast == generic, text


def test_pieces_match_on_wordpiece_with_specials_and_cleanup():
    tok = _wordpiece_tokenizer()
    rng = random.Random(2)
    vocab = range(tok.get_vocab_size(with_added_tokens=True))
    for _ in range(300):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 12))]
        context = [rng.choice(vocab) for _ in range(rng.randint(0, 3))]
        generic, fast = _both(tok, ids, context)
        assert fast == generic, (ids, context)
        assert "".join(fast[0]) == tok.decode(context + ids)[len(tok.decode(context)):]


@pytest.mark.parametrize("kind", ["byte_level", "wordpiece"])
def test_warm_pieces_are_the_pieces_made_on_first_use(byte_tokenizer, kind):
    tok = byte_tokenizer if kind == "byte_level" else _wordpiece_tokenizer()
    lazy, warm = TokenPieces.for_tokenizer(tok), TokenPieces.for_tokenizer(tok)
    warm.warm()
    size = tok.get_vocab_size(with_added_tokens=True)
    assert len(warm._pieces) == size  # every id, before any stream asked
    assert [warm.piece(t) for t in range(size)] == [lazy.piece(t) for t in range(size)]


def test_invalid_bytes_give_the_same_text(byte_tokenizer):
    """Byte tokens in any order (invalid UTF-8 too): the same text in the end, U+FFFD where bytes are bad."""
    byte_ids = [byte_tokenizer.token_to_id(c) for c in ("\u0100", "Ã", "ł", "Ĥ", "¤", "ð", "Ł")]
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice(byte_ids + byte_tokenizer.encode("ab").ids) for _ in range(rng.randint(1, 10))]
        (generic, g_tail), (fast, f_tail) = _both(byte_tokenizer, ids)
        assert "".join(fast) + f_tail == "".join(generic) + g_tail == byte_tokenizer.decode(ids)


def test_other_decoders_keep_the_window():
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"▁a": 0, "b": 1}, unk_token="b"))
    tok.decoder = decoders.Metaspace()
    assert TokenPieces.for_tokenizer(tok) is None
    assert isinstance(TextStream(tok)._detok, IncrementalDetokenizer)


# ---------------------------------------------------------------- handing a stream to the native round and back


@pytest.mark.parametrize("kind", ["byte_level", "wordpiece"])
def test_a_stream_handed_over_and_back_gives_the_same_text(byte_tokenizer, kind):
    """A reader that takes over mid-stream (the native round) joins the table's pieces from the pending bytes
    it was handed; what it hands back goes on as if the stream had never left."""
    tok = byte_tokenizer if kind == "byte_level" else _wordpiece_tokenizer()
    pieces = TokenPieces.for_tokenizer(tok)
    table = pieces.utf8_pieces()
    rng = random.Random(4)
    if kind == "byte_level":
        ids = byte_tokenizer.encode("héllo 世界 🙂 👩‍💻 " * 4).ids
    else:
        ids = [rng.randrange(tok.get_vocab_size(with_added_tokens=True)) for _ in range(40)]
    for _ in range(50):
        a, b = sorted(rng.sample(range(1, len(ids)), 2))
        whole = TextStream(tok, pieces=pieces)
        expected = whole.add(ids) + whole.finish()
        stream = TextStream(tok, pieces=pieces)
        text = stream.add(ids[:a])
        given = stream.hand_over()
        assert given is not None and given[0] is pieces
        other = codecs.getincrementaldecoder("utf-8")()  # the other reader: whole characters out, the rest held
        text += other.decode(given[1] + b"".join(table[t] for t in ids[a:b]))
        stream.take_over(b, other.getstate()[0])
        text += stream.add(ids[b:]) + stream.finish()
        assert text == expected and stream.num_tokens == len(ids)


def test_only_plain_piece_streams_are_handed_over(byte_tokenizer):
    assert TextStream(byte_tokenizer, stops=["x"], pieces=TokenPieces.for_tokenizer(byte_tokenizer)).hand_over() is None
    assert TextStream(byte_tokenizer).hand_over() is None  # the window decoder
    wordpiece = _wordpiece_tokenizer()
    assert TextStream(wordpiece, pieces=TokenPieces.for_tokenizer(wordpiece)).hand_over() is None  # not begun
