"""Streaming detokenization: multi-byte characters split over tokens, stop strings over token boundaries."""

from __future__ import annotations

import random

import pytest

from gateway.detokenize import IncrementalDetokenizer, StopMatcher, TextStream

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
