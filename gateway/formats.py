"""Response shapes of the two endpoints: the full object, stream chunks, and the usage chunk."""

from __future__ import annotations

import time
from typing import Protocol

from pydantic import BaseModel

from protocols.openai import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                              ChatCompletionChunk, ChatDelta, Completion, CompletionChoice, Usage)


class OutputFormat(Protocol):
    def chunk(self, text: str = "", finish_reason: str | None = None) -> BaseModel: ...
    def usage_chunk(self, prompt_len: int, completion_len: int) -> BaseModel: ...
    def full(self, text: str, finish_reason: str, prompt_len: int, completion_len: int) -> BaseModel: ...


class ChatFormat:
    """chat.completion objects; the first streamed chunk carries the role with the first text."""

    def __init__(self, response_id: str, model: str):
        self.id, self.model, self.created = response_id, model, int(time.time())
        self._role_sent = False

    def chunk(self, text: str = "", finish_reason: str | None = None) -> ChatCompletionChunk:
        delta = ChatDelta(content=text) if text else ChatDelta()
        if not self._role_sent:
            delta.role, self._role_sent = "assistant", True
            delta.content = text
        return self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

    def usage_chunk(self, prompt_len: int, completion_len: int) -> ChatCompletionChunk:
        return self._chunk([], Usage.of(prompt_len, completion_len))

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def full(self, text: str, finish_reason: str, prompt_len: int, completion_len: int) -> ChatCompletion:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                              usage=Usage.of(prompt_len, completion_len))


class CompletionFormat:
    """text_completion objects, streamed as the same object with a piece of text each."""

    def __init__(self, response_id: str, model: str):
        self.id, self.model, self.created = response_id, model, int(time.time())

    def chunk(self, text: str = "", finish_reason: str | None = None) -> Completion:
        return self._make([CompletionChoice(text=text, finish_reason=finish_reason)])

    def usage_chunk(self, prompt_len: int, completion_len: int) -> Completion:
        return self._make([], Usage.of(prompt_len, completion_len))

    def full(self, text: str, finish_reason: str, prompt_len: int, completion_len: int) -> Completion:
        return self._make([CompletionChoice(text=text, finish_reason=finish_reason)],
                          Usage.of(prompt_len, completion_len))

    def _make(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
