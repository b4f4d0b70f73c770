"""Tool calls out of a model's text, per call format (`tools.ToolFormat`), as the text streams.

`ToolCallStream` takes a choice's text piece by piece and gives back what the client sees: content text and
finished calls (name, arguments as a JSON string). Streamed and non-streamed responses both come from it, so
the deltas of one assemble to the message of the other. Text that is not a well-formed call of an offered
tool stays text (tool_choice "auto" with a model that answers in prose).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from .tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolFormat

_HERMES_HEAD = re.compile(re.escape(TOOL_CALL_OPEN) + r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_HERMES_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_LEADS = {"llama3_json": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]", "[")}  # how a calls-only output opens


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object as a string


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_of(obj, args_keys: tuple[str, ...], names: Collection[str]) -> ParsedCall | None:
    """A call from a decoded JSON object, or None when it is not one of an offered tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list | None:
    """The JSON values `text` holds one after another (separated by whitespace, ';' or ','), or None."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def parse_json_calls(text: str, fmt: ToolFormat, names: Collection[str]) -> list[ParsedCall] | None:
    """Llama 3.x JSON calls or Mistral's list: every value must be a call of an offered tool, else None."""
    body = text.strip()
    lead = _LEADS[fmt][0]
    body = body[len(lead):] if body.startswith(lead) else body
    values = _json_values(body)
    if not values:
        return None
    if fmt == "mistral":
        if len(values) != 1 or not isinstance(values[0], list):
            return None
        values = values[0]
    calls = [_call_of(v, ("parameters", "arguments"), names) for v in values]
    return calls if calls and all(calls) else None


def parse_hermes_call(body: str, names: Collection[str]) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj, ("arguments", "parameters"), names)


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index` of the message: its head (`id` and `name` set, no arguments yet) or a fragment
    of its arguments (`id` and `name` None). A call's fragments joined are its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """One choice's text in, content and call deltas out (`feed` per piece, `finish` at the end).

    Hermes calls stream as they are written: the head once `<tool_call>{"name": ..., "arguments": ` names an
    offered tool, then the arguments as they come (what may be the call's closing is held back). The other
    formats give each call whole at the end (only a complete parse says an output is calls)."""

    def __init__(self, fmt: ToolFormat, names: Collection[str]):
        self.fmt, self.names = fmt, frozenset(names)
        self._buffer = ""  # text held back: a call (or what may be the start of one)
        self._in_calls = False  # llama3_json / mistral: the output opened as calls
        self.num_calls = 0
        self._open: CallDelta | None = None  # the Hermes call whose arguments are streaming
        self._args_sent = 0  # characters of `_buffer` (its arguments) sent so far

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content that can go out now, and the call deltas this piece completes."""
        self._buffer += text
        if self.fmt == "hermes":
            return self._feed_hermes()
        return self._feed_json()

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest, at the end of the output: what did not parse as calls is content."""
        if self._open is not None:  # cut short (max_tokens): its arguments as far as they got, less the `}` that
            # closed the call's object when the cut came just before its closing tag
            body = self._buffer.rstrip()
            end = len(body)
            if not _is_json(body) and _is_json(body[:_arguments_end(body)]):  # the held-back `}` closed the call
                end = _arguments_end(body)
            rest, self._buffer = self._buffer[self._args_sent:max(end, self._args_sent)], ""
            return "", [CallDelta(self._open.index, arguments=rest)] if rest else []
        rest, self._buffer = self._buffer, ""
        if self.fmt == "hermes":  # a call cut short before its arguments stays text; whitespace after calls goes
            return ("" if self.num_calls and not rest.strip() else rest), []
        calls = parse_json_calls(rest, self.fmt, self.names) if rest.strip() else None
        if calls is None:
            return rest, []
        return "", [d for call in calls for d in self._whole(call)]

    def _whole(self, call: ParsedCall) -> list[CallDelta]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [CallDelta(index, call.id, call.name), CallDelta(index, arguments=call.arguments)]

    def _feed_hermes(self) -> tuple[str, list[CallDelta]]:
        content, deltas = "", []
        while True:
            if self._open is not None:
                if not self._stream_arguments(deltas):
                    return content, deltas
                continue
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:  # hold back only what may begin the opening tag
                cut = len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_OPEN)
                if self.num_calls and not self._buffer[:cut].strip():
                    return content, deltas  # whitespace after a call: held until what follows says whether it goes
                content += self._buffer[:cut]
                self._buffer = self._buffer[cut:]
                return content, deltas
            if start:
                before = self._buffer[:start]
                content += before if not (self.num_calls and not before.strip()) else ""  # none between calls
                self._buffer = self._buffer[start:]
            text = self._open_call(deltas)
            if text is None:
                return content, deltas
            content += text

    def _open_call(self, deltas: list[CallDelta]) -> str | None:
        """At an opening tag: start streaming the call, or take a whole one (""), or give the text of one that
        is not a call of an offered tool; None: wait for more text."""
        head = _HERMES_HEAD.match(self._buffer)
        if head is not None and head.group(1) in self.names:
            self._open = CallDelta(self.num_calls, new_call_id(), head.group(1))
            self.num_calls += 1
            deltas.append(self._open)
            self._buffer, self._args_sent = self._buffer[head.end():], 0
            return ""
        match = _HERMES_CALL.match(self._buffer)
        if match is None:
            return None  # the call is not complete yet
        self._buffer = self._buffer[match.end():]
        call = parse_hermes_call(match.group(1), self.names)  # another key order, or not an offered tool
        if call is None:
            return match.group(0)
        deltas += self._whole(call)
        return ""

    def _stream_arguments(self, deltas: list[CallDelta]) -> bool:
        """The open call's arguments so far; True once its closing tag was met (the call is done)."""
        close = self._buffer.find(TOOL_CALL_CLOSE)
        held = close if close >= 0 else len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_CLOSE)
        self._send(deltas, _arguments_end(self._buffer[:held]))
        if close < 0:
            return False
        self._buffer, self._open = self._buffer[close + len(TOOL_CALL_CLOSE):], None
        return True

    def _send(self, deltas: list[CallDelta], end: int) -> None:
        if end > self._args_sent:
            deltas.append(CallDelta(self._open.index, arguments=self._buffer[self._args_sent:end]))
            self._args_sent = end

    def _feed_json(self) -> tuple[str, list[CallDelta]]:
        if not self._in_calls:
            head = self._buffer.lstrip()
            if not head:
                return "", []
            leads = _LEADS[self.fmt]
            if any(head.startswith(lead) or lead.startswith(head) for lead in leads):
                self._in_calls = True  # held until the end: only a whole parse says it is calls
            else:
                content, self._buffer = self._buffer, ""
                self._in_calls = None  # prose: it all goes out as content
                return content, []
        if self._in_calls is None:
            content, self._buffer = self._buffer, ""
            return content, []
        return "", []


def _arguments_end(body: str) -> int:
    """Where a Hermes call's arguments end in `body` (the text after `"arguments": `): before trailing whitespace
    and a last `}` that may close the call's object (held until more text shows whether it does)."""
    body = body.rstrip()
    return len(body[:-1].rstrip()) if body.endswith("}") else len(body)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
