"""chat.completion objects of a request with tools: the choice's text read by its `ToolCallStream`, calls
out as `message.tool_calls` (finish_reason "tool_calls"), or streamed in OpenAI's shape: per call, a delta
with its index, id, type and name, then one with its arguments. Streams of this format are written by
the request's task (`SseBody`), piece by piece, never by the poller's sink or the native round."""

from __future__ import annotations

from collections.abc import Sequence

from protocols.openai import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatDelta,
                              FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta, Usage)

from ..request.generate import Piece
from ..request.token_text import TokenTexts
from ..structured.tool_parsers import CallDelta, ToolCallStream
from ..structured.tools import ToolFormat
from .formats import ChatFormat, ChoiceOutput, LogprobItem


def assemble(deltas: list[CallDelta]) -> list[CallDelta]:
    """Call deltas joined into whole calls (id, name, every argument fragment), in index order."""
    calls: dict[int, CallDelta] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = CallDelta(delta.index, delta.id, delta.name, delta.arguments)
        else:
            calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def finish_reason_of(reason: str | None, num_calls: int) -> str | None:
    """A stop after tool calls is OpenAI's "tool_calls"."""
    return "tool_calls" if num_calls and reason == "stop" else reason


class ToolChatFormat(ChatFormat):
    streams_in_task = True  # SseBody: no sink, no native round

    def __init__(self, response_id: str, model: str, texts: TokenTexts | None, fmt: ToolFormat,
                 names: Sequence[str]):
        super().__init__(response_id, model, texts)
        self.tool_format, self.names = fmt, tuple(names)
        self._streams: dict[int, ToolCallStream] = {}
        self._pending_lps: dict[int, list[LogprobItem]] = {}  # logprobs of text held back, for the next chunk

    def text_parts(self, index: int) -> bool:
        return False

    def _stream(self, index: int) -> ToolCallStream:
        if index not in self._streams:
            self._streams[index] = ToolCallStream(self.tool_format, self.names)
        return self._streams[index]

    def piece_events(self, index: int, piece: Piece) -> bytes:
        """SSE events of one piece: content that can go out, call heads and argument fragments, the finish."""
        stream = self._stream(index)
        content, deltas = stream.feed(piece.text)
        if piece.finish_reason:
            rest, more = stream.finish()
            content, deltas = content + rest, deltas + more
        lps = self._pending_lps.setdefault(index, [])
        lps += zip(piece.token_ids, piece.logprobs) if piece.logprobs else ()
        chunks = []
        if content or (lps and piece.finish_reason and not deltas):
            chunks.append(self.chunk(index, content, logprobs=lps))
            lps.clear()
        for delta in deltas:
            chunks.append(self._call_chunk(index, delta, lps))
            lps.clear()
        if piece.finish_reason:
            chunks.append(self.chunk(index, finish_reason=finish_reason_of(piece.finish_reason, stream.num_calls)))
        return b"".join(b"data: %s\n\n" % c.model_dump_json().encode() for c in chunks)

    def _call_chunk(self, index: int, delta: CallDelta, lps: list[LogprobItem]):
        """A call's head (id, type, name, arguments "") or a fragment of its arguments, as OpenAI streams them."""
        if delta.id is not None:
            call = ToolCallDelta(index=delta.index, id=delta.id, type="function",
                                 function=FunctionCallDelta(name=delta.name, arguments=""))
        else:
            call = ToolCallDelta(index=delta.index, function=FunctionCallDelta(arguments=delta.arguments))
        first = index not in self._role_sent
        self._role_sent.add(index)
        message = ChatDelta(role="assistant" if first else None, tool_calls=[call])
        return self._chunk([ChatChunkChoice(index=index, delta=message, logprobs=self._logprobs(lps) if lps else None)])

    def full(self, choices: Sequence[ChoiceOutput], prompt_len: int, completion_len: int,
             cached_len: int = 0) -> ChatCompletion:
        listed = [self._full_choice(i, c) for i, c in enumerate(choices)]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=listed,
                              usage=Usage.of(prompt_len, completion_len, cached_len))

    def _full_choice(self, index: int, out: ChoiceOutput) -> ChatChoice:
        stream = ToolCallStream(self.tool_format, self.names)
        content, deltas = stream.feed(out.text)
        rest, more = stream.finish()
        content, calls = content + rest, assemble(deltas + more)
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        message = AssistantMessage(content=content if content or not calls else None, tool_calls=tool_calls or None)
        return ChatChoice(index=index, message=message, finish_reason=finish_reason_of(out.finish_reason, len(calls)),
                          logprobs=self._logprobs(out.logprobs))
