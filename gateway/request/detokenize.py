"""Streaming detokenization: token ids in, text out, never half a character, cut at stop strings.

Two ways, one result. Most tokenizers' decoders turn each token into a piece of its own whatever came
before (`TokenPieces`): the text is then the pieces joined, bytes for byte-level BPE (decoded as UTF-8 as
they complete), and a stream costs a cached lookup per token (`PieceDetokenizer`). For the others, a
stream decodes a small sliding window per token with the tokenizer's own decoder (`IncrementalDetokenizer`).
Tests hold the two to the same output, token by token.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders

from .token_text import TokenTexts

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


class TokenPieces:
    """What each token adds to a text, for decoders where that depends on the token alone (cached per id;
    one per tokenizer, shared by its streams). `for_tokenizer` gives None for other decoders.

    - ByteLevel (GPT-2, Llama 3, Qwen, SmolLM): the token's bytes (`TokenTexts`, as the decoder maps
      them); the text is their UTF-8 decoding, lossy as the decoder's.
    - WordPiece (BERT; the `w123` vocabulary of random-weights models): the decoder handles each token
      on its own (a space before it, or its "##" prefix dropped; cleanup), then joins them: a token's
      piece is what it adds after any token, the first token of a text its own decoding.
    Special tokens add nothing, as with `decode(ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer: Tokenizer, texts: TokenTexts | None = None):
        self._tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._texts = (texts or TokenTexts(tokenizer)) if self.byte_level else None  # the tokenizer's, shared
        self._pieces: dict[int, bytes | str] = {}  # id -> its piece after another token
        self._firsts: dict[int, str] = {}  # id -> its piece at the start of a text (WordPiece)
        # WordPiece: a piece is what a token adds after some other token, any one (here the first not special).
        self._ref = None if self.byte_level else \
            next(i for i in range(tokenizer.get_vocab_size()) if i not in self.special_ids)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, texts: TokenTexts | None = None) -> TokenPieces | None:
        """`texts`: the tokenizer's `TokenTexts`, whose byte cache this shares."""
        if isinstance(tokenizer.decoder, (decoders.ByteLevel, decoders.WordPiece)):
            return cls(tokenizer, texts)
        return None

    def warm(self) -> None:
        """Every id's piece now (about 0.1 s per 50k ids, at start-up), so that no stream pays a tokenizer
        call in the poller for a token's first appearance; a gateway that freezes what start-up built
        then keeps them out of its collector's walks."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if self.byte_level:
            for token_id in range(size):
                self.piece(token_id)
            return
        ref_len = len(self._decode([self._ref]))  # WordPiece: what each id adds after `_ref`, in one batch
        texts = self._tokenizer.decode_batch([[self._ref, t] for t in range(size)], skip_special_tokens=True)
        for token_id, text in enumerate(texts):
            self._pieces.setdefault(token_id, "" if token_id in self.special_ids else text[ref_len:])

    def utf8_pieces(self) -> list[bytes]:
        """Every id's piece after another token as UTF-8 bytes (ByteLevel: its bytes), for the native
        stream round's table (`gateway/streaming/stream_round.py`)."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return [p if isinstance(p, bytes) else p.encode() for p in map(self.piece, range(size))]

    def piece(self, token_id: int) -> bytes | str:
        """After another (non-special) token: bytes (ByteLevel) or text (WordPiece); empty for a special token."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make(token_id)
        return piece

    def first(self, token_id: int) -> str:
        """At the start of a text (WordPiece)."""
        text = self._firsts.get(token_id)
        if text is None:
            text = self._firsts[token_id] = self._decode([token_id])
        return text

    def _make(self, token_id: int) -> bytes | str:
        if token_id in self.special_ids:
            return b"" if self.byte_level else ""
        if self.byte_level:
            return self._texts.bytes(token_id)
        return self._decode([self._ref, token_id])[len(self._decode([self._ref])):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class PieceDetokenizer:
    """`IncrementalDetokenizer`'s job for tokenizers with `TokenPieces`: a cached piece per token.
    Bytes are decoded as they complete a character (never half a character; invalid bytes become U+FFFD)."""

    __slots__ = ("_pieces", "_utf8", "_started")

    def __init__(self, pieces: TokenPieces, context_ids: Sequence[int] = ()):
        self._pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if pieces.byte_level else None
        context = [t for t in context_ids[-CONTEXT_LEN:] if t not in pieces.special_ids]
        if self._utf8 is not None:
            self._utf8.decode(b"".join(pieces.piece(t) for t in context))  # a character the prompt left open
        self._started = bool(context)  # a text has begun: tokens are not first any more

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became final (may be empty)."""
        if self._utf8 is not None:
            return self._utf8.decode(self._pieces.piece(token_id))
        if self._started:
            return self._pieces.piece(token_id)
        if token_id in self._pieces.special_ids:
            return ""
        self._started = True
        return self._pieces.first(token_id)

    def flush(self) -> str:
        """At the end of the sequence: a character left incomplete, as U+FFFD."""
        return self._utf8.decode(b"", final=True) if self._utf8 is not None else ""

    def hand_over(self) -> tuple[TokenPieces, bytes] | None:
        """For another reader that goes on where this one is (the native stream round): the pieces and the
        bytes of a character still incomplete, which this one forgets; None when the next token's piece
        depends on more than the token (a WordPiece text not begun)."""
        if self._utf8 is None:
            return (self._pieces, b"") if self._started else None
        pending, _ = self._utf8.getstate()
        self._utf8.reset()
        return self._pieces, pending

    def take_over(self, pending: bytes) -> None:
        """Back from that reader: it left `pending`, the bytes of a character not complete yet."""
        if self._utf8 is not None:
            if self._utf8.decode(pending):
                raise ValueError(f"bytes {pending!r} handed back hold a whole character")
        elif pending:
            raise ValueError("a WordPiece stream has no pending bytes")


class StopMatcher:
    """Finds stop strings across chunk boundaries.

    Text that could be the start of a stop string is held back until the next chunk decides it; on a
    match the text before the stop string is released and the stop string itself is dropped.
    """

    __slots__ = ("_stops", "_held")

    def __init__(self, stops: Iterable[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    @property
    def stops(self) -> bool:
        """It has stop strings to look for (without, `feed` passes text through)."""
        return bool(self._stops)

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

    __slots__ = ("_detok", "_matcher", "_plain", "num_tokens", "stopped")

    def __init__(self, tokenizer: Tokenizer, stops: Iterable[str] = (), context_ids: Sequence[int] = (),
                 single_texts: dict[int, str] | None = None, pieces: TokenPieces | None = None):
        """`single_texts` and `pieces`: the tokenizer's shared caches (`TokenizerService`); with `pieces`,
        a stream costs a lookup per token instead of a decode."""
        self._detok = PieceDetokenizer(pieces, context_ids) if pieces is not None else \
            IncrementalDetokenizer(tokenizer, context_ids, single_texts=single_texts)
        self._matcher = StopMatcher(stops)
        self._plain = not self._matcher.stops  # no stop string: nothing is ever held back
        self.num_tokens = 0
        self.stopped = False  # a stop string matched

    def add(self, token_ids: Iterable[int]) -> str:
        if self._plain:  # no stop string: one cached piece per token, nothing held back
            if self.stopped:
                return ""
            add, text, num_tokens = self._detok.add, "", self.num_tokens
            for token_id in token_ids:
                text += add(token_id)
                num_tokens += 1
            self.num_tokens = num_tokens
            return text
        out = []
        for token_id in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            text, self.stopped = self._matcher.feed(self._detok.add(token_id))
            out.append(text)
        return "".join(out)

    @property
    def can_hand_over(self) -> bool:
        """Another reader could go on with it: no stop strings, a piece per token, not stopped."""
        return self._plain and not self.stopped and isinstance(self._detok, PieceDetokenizer)

    def hand_over(self) -> tuple[TokenPieces, bytes] | None:
        """`PieceDetokenizer.hand_over` for a stream that `can_hand_over`; None otherwise."""
        return self._detok.hand_over() if self.can_hand_over else None

    def take_over(self, num_tokens: int, pending: bytes) -> None:
        """Back from that reader, which took the stream to `num_tokens` tokens and left `pending` bytes."""
        self._detok.take_over(pending)
        self.num_tokens = num_tokens

    def finish(self) -> str:
        """The text still held back, once the engine has finished."""
        if self.stopped:
            return ""
        text, self.stopped = self._matcher.feed(self._detok.flush())
        return text if self.stopped else text + self._matcher.flush()
