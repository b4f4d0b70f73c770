"""Response shapes of the two endpoints: the full object, stream chunks, and the usage chunk.

A request with n choices streams each choice's chunks with its `index` (interleaved as they come);
the full object lists the choices in index order. Logprobs appear when the request asked for them
(the format is given the `TokenTexts` to spell tokens with); the finish chunk carries none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from json.encoder import encode_basestring
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel

from protocols.openai import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                              ChatCompletionChunk, ChatDelta, ChatLogprobs, ChatTokenLogprob, Completion,
                              CompletionChoice, CompletionLogprobs, TopLogprob, Usage)
from protocols.ring import TokenLogprob

from ..request.token_text import TokenTexts

MIN_LOGPROB = -9999.0  # what a logprob that underflowed float32 (-inf) is reported as: JSON has no -inf
LogprobItem = tuple[int, TokenLogprob]  # (token id, its entry)
_MARK = "blink-chunk-text-7d1e"  # stands for the text in a rendered template; never escaped by JSON


class TextTemplate:
    """A plain text chunk (no role, echo, logprobs or finish) as JSON bytes without a model per token.

    The schema renders the chunk once with a marker for its text; each token's chunk is then the bytes
    around the marker with the text in between as a JSON string (`encode_basestring` escapes exactly as
    pydantic does, non-ASCII left as UTF-8: tests compare the two byte for byte). The streamed path
    spends a few hundred ns here instead of building and serializing two models."""

    __slots__ = ("_head", "_tail", "_usable")

    def __init__(self, rendered: BaseModel):
        """`rendered`: the chunk made with `_MARK` for its text."""
        head, sep, tail = rendered.model_dump_json().partition(f'"{_MARK}"')
        self._usable = bool(sep) and _MARK not in tail  # else (a model name holding the marker): no template
        self._head, self._tail = head.encode(), tail.encode()

    @property
    def parts(self) -> tuple[bytes, bytes] | None:
        """The bytes before and after the text's JSON string; None when chunks cannot come from the template."""
        return (self._head, self._tail) if self._usable else None

    def json(self, text: str) -> bytes | None:
        """The chunk of `text`; None when it cannot come from the template (the caller renders it)."""
        if self._usable:
            return b"%s%s%s" % (self._head, encode_basestring(text).encode(), self._tail)
        return None


class TextTemplates:
    """A format's TextTemplate per choice index, made on first use from `render(index, text)`.

    `render` comes with each call rather than being kept: a format (which holds its TextTemplates) would
    otherwise hold itself through it, a reference cycle per request that only the cyclic GC frees, and
    the gateway keeps that collector out of the streaming path (`gateway.gc_policy`)."""

    __slots__ = ("_by_index",)

    def __init__(self):
        self._by_index: dict[int, TextTemplate] = {}

    def get(self, index: int, render: Callable[[int, str], BaseModel]) -> TextTemplate:
        template = self._by_index.get(index)
        if template is None:
            template = self._by_index[index] = TextTemplate(render(index, _MARK))
        return template

    def parts(self, index: int, plain: bool, started: bool,
              render: Callable[[int, str], BaseModel]) -> tuple[bytes, bytes] | bool | None:
        """OutputFormat.text_parts: False unless the request's chunks can be `plain` (no logprobs), None
        until the choice has `started` (its first chunk made), then the template's parts (False if none)."""
        if not plain:
            return False
        if not started:
            return None
        return self.get(index, render).parts or False


@dataclass
class ChoiceOutput:
    """One finished choice, for the non-streamed object."""

    text: str = ""
    finish_reason: str = "stop"
    logprobs: list[LogprobItem] = field(default_factory=list)


class OutputFormat(Protocol):
    def chunk(self, index: int, text: str = "", finish_reason: str | None = None,
              logprobs: Sequence[LogprobItem] = ()) -> BaseModel: ...
    def chunk_json(self, index: int, text: str = "", finish_reason: str | None = None,
                   logprobs: Sequence[LogprobItem] = ()) -> bytes: ...
    def text_parts(self, index: int) -> tuple[bytes, bytes] | bool | None: ...
    def usage_chunk(self, prompt_len: int, completion_len: int, cached_len: int = 0) -> BaseModel: ...
    def full(self, choices: Sequence[ChoiceOutput], prompt_len: int, completion_len: int,
             cached_len: int = 0) -> BaseModel: ...


def clamp_logprob(value: float) -> float:
    """A logprob as the APIs report it: -inf (underflow) becomes MIN_LOGPROB."""
    return max(value, MIN_LOGPROB)


class ChatFormat:
    """chat.completion objects; each choice's first streamed chunk carries the role."""

    def __init__(self, response_id: str, model: str, texts: TokenTexts | None = None):
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.texts = texts  # set when the request asked for logprobs
        self._role_sent: set[int] = set()
        self._templates = TextTemplates()

    def chunk_json(self, index: int, text: str = "", finish_reason: str | None = None,
                   logprobs: Sequence[LogprobItem] = ()) -> bytes:
        """`chunk(...)` as JSON bytes; a plain text chunk from its template."""
        if text and finish_reason is None and self.texts is None and index in self._role_sent:
            data = self._templates.get(index, self.chunk).json(text)
            if data is not None:
                return data
        return self.chunk(index, text, finish_reason, logprobs).model_dump_json().encode()

    def text_parts(self, index: int) -> tuple[bytes, bytes] | bool | None:
        """What surrounds the JSON string of a non-empty text in this choice's plain chunks (no logprobs,
        no finish), as `chunk_json` would write them: (before, after); None while its first chunk (the
        role's) has not been made, False when they never come from a template (logprobs were asked)."""
        return self._templates.parts(index, self.texts is None, index in self._role_sent, self.chunk)

    def chunk(self, index: int, text: str = "", finish_reason: str | None = None,
              logprobs: Sequence[LogprobItem] = ()) -> ChatCompletionChunk:
        delta = ChatDelta(content=text) if text else ChatDelta()
        if index not in self._role_sent:
            self._role_sent.add(index)
            delta.role, delta.content = "assistant", text
        lps = self._logprobs(logprobs) if finish_reason is None else None
        return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=lps, finish_reason=finish_reason)])

    def usage_chunk(self, prompt_len: int, completion_len: int, cached_len: int = 0) -> ChatCompletionChunk:
        return self._chunk([], Usage.of(prompt_len, completion_len, cached_len))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def full(self, choices: Sequence[ChoiceOutput], prompt_len: int, completion_len: int,
             cached_len: int = 0) -> ChatCompletion:
        listed = [ChatChoice(index=i, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                             logprobs=self._logprobs(c.logprobs)) for i, c in enumerate(choices)]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=listed,
                              usage=Usage.of(prompt_len, completion_len, cached_len))

    def _logprobs(self, items: Sequence[LogprobItem]) -> ChatLogprobs | None:
        if self.texts is None:
            return None
        return ChatLogprobs(content=[ChatTokenLogprob(**self._top(token_id, entry.logprob).model_dump(),
                                                      top_logprobs=[self._top(t, lp) for t, lp in entry.top])
                                     for token_id, entry in items])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.texts.text(token_id), logprob=clamp_logprob(logprob),
                          bytes=list(self.texts.bytes(token_id)))


class CompletionFormat:
    """text_completion objects, streamed as the same object with a piece of text each. With `echo`,
    each choice's text starts with the prompt (its first streamed chunk carries it)."""

    def __init__(self, response_id: str, model: str, texts: TokenTexts | None = None,
                 echo: str | Sequence[str] = ""):
        """`echo`: the prompt every choice starts with, or one per choice (a batch of prompts)."""
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.texts, self.echo = texts, echo
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}  # per choice: characters streamed so far (text_offset)
        self._templates = TextTemplates()

    def chunk_json(self, index: int, text: str = "", finish_reason: str | None = None,
                   logprobs: Sequence[LogprobItem] = ()) -> bytes:
        """`chunk(...)` as JSON bytes; a plain text chunk from its template."""
        if finish_reason is None and self.texts is None and index in self._echoed:
            self._offsets[index] = self._offsets.get(index, 0) + len(text)
            data = self._templates.get(index, self._text_chunk).json(text)
            return data if data is not None else self._text_chunk(index, text).model_dump_json().encode()
        return self.chunk(index, text, finish_reason, logprobs).model_dump_json().encode()

    def text_parts(self, index: int) -> tuple[bytes, bytes] | bool | None:
        """What surrounds the JSON string of a text in this choice's plain chunks (no logprobs, no finish),
        as `chunk_json` would write them: (before, after); None while its first chunk (the echo's) has not
        been made, False when they never come from a template (logprobs were asked: text offsets count)."""
        return self._templates.parts(index, self.texts is None, index in self._echoed, self._text_chunk)

    def chunk(self, index: int, text: str = "", finish_reason: str | None = None,
              logprobs: Sequence[LogprobItem] = ()) -> Completion:
        if index not in self._echoed:
            self._echoed.add(index)
            text = self._echo(index) + text
        lps = self._logprobs(logprobs, self._offsets.get(index, 0)) if finish_reason is None else None
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return self._make([CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=finish_reason)])

    def _text_chunk(self, index: int, text: str) -> Completion:
        """A plain text chunk of a choice whose first chunk (the echo's) has gone."""
        return self._make([CompletionChoice(index=index, text=text)])

    def usage_chunk(self, prompt_len: int, completion_len: int, cached_len: int = 0) -> Completion:
        return self._make([], Usage.of(prompt_len, completion_len, cached_len))

    def full(self, choices: Sequence[ChoiceOutput], prompt_len: int, completion_len: int,
             cached_len: int = 0) -> Completion:
        listed = [CompletionChoice(index=i, text=self._echo(i) + c.text, finish_reason=c.finish_reason,
                                   logprobs=self._logprobs(c.logprobs, len(self._echo(i))))
                  for i, c in enumerate(choices)]
        return self._make(listed, Usage.of(prompt_len, completion_len, cached_len))

    def _echo(self, index: int) -> str:
        return self.echo if isinstance(self.echo, str) else self.echo[index]

    def _make(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _logprobs(self, items: Sequence[LogprobItem], offset: int) -> CompletionLogprobs | None:
        """The top dict holds the `logprobs` most likely tokens and the chosen one (so up to logprobs + 1)."""
        if self.texts is None:
            return None
        tokens = [self.texts.text(token_id) for token_id, _ in items]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops = [{**{self.texts.text(t): clamp_logprob(lp) for t, lp in entry.top},
                 self.texts.text(token_id): clamp_logprob(entry.logprob)} for token_id, entry in items]
        return CompletionLogprobs(tokens=tokens, token_logprobs=[clamp_logprob(e.logprob) for _, e in items],
                                  top_logprobs=tops, text_offset=offsets)
