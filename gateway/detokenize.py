"""Streaming detokenization: token ids in, text out, never half a character, cut at stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_LEN = 6  # prompt tokens kept as decoding context, so the first output token decodes in place


class IncrementalDetokenizer:
    """Decodes a growing id sequence through a small sliding window.

    Each step decodes `ids[prefix:]` and `ids[prefix:read]` with the tokenizer's own decoder and emits
    the difference. While the new text ends in U+FFFD, the last token(s) hold an incomplete UTF-8
    sequence (an emoji or CJK character split over byte-level tokens): nothing is emitted and the
    window grows until the character is whole. The window around the new tokens keeps decoders that
    strip a leading space (SentencePiece) from changing text mid-sequence.

    `single_texts` (shared by the streams of one tokenizer, same `skip_special_tokens`) caches the
    decode of one id alone: the window restarts at one token after most steps, so each token then
    costs one decode instead of two.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, single_texts: dict[int, str] | None = None):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._single_texts = {} if single_texts is None else single_texts
        self._ids = list(context_ids[-CONTEXT_LEN:])  # [prefix .. read) decoded already, [read ..) pending
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became final (may be empty)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text):]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode_one(token_id) if self._read == 1 else self._decode(self._ids)
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is pending, replacement characters included."""
        text = self._decode(self._ids)
        delta = text[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _decode_one(self, token_id: int) -> str:
        text = self._single_texts.get(token_id)
        if text is None:
            text = self._single_texts[token_id] = self._decode([token_id])
        return text


class StopMatcher:
    """Finds stop strings across chunk boundaries.

    Text that could be the start of a stop string is held back until the next chunk decides it; on a
    match the text before the stop string is released and the stop string itself is dropped.
    """

    def __init__(self, stops: Iterable[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, matched)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(len(buf), longest), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


class TextStream:
    """One request's output: ids -> final text, cut at the first stop string.

    `num_tokens` counts the tokens consumed, up to and including the one that completed a stop string;
    tokens after a stop match are not consumed.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Iterable[str] = (), context_ids: Sequence[int] = (),
                 single_texts: dict[int, str] | None = None):
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, single_texts=single_texts)
        self._matcher = StopMatcher(stops)
        self.num_tokens = 0
        self.stopped = False  # a stop string matched

    def add(self, token_ids: Iterable[int]) -> str:
        out = []
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            text, self.stopped = self._matcher.feed(self._detok.add(token_id))
            out.append(text)
        return "".join(out)

    def finish(self) -> str:
        """The text still held back, once the engine has finished."""
        if self.stopped:
            return ""
        text, self.stopped = self._matcher.feed(self._detok.flush())
        return text if self.stopped else text + self._matcher.flush()
