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


class ToolCallStream:
    """One choice's text in, content and calls out (`feed` per piece, `finish` at the end)."""

    def __init__(self, fmt: ToolFormat, names: Collection[str]):
        self.fmt, self.names = fmt, frozenset(names)
        self._buffer = ""  # text held back: a call (or what may be the start of one)
        self._in_calls = False  # llama3_json / mistral: the output opened as calls
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content that can go out now, and the calls completed by this piece."""
        self._buffer += text
        if self.fmt == "hermes":
            return self._feed_hermes()
        return self._feed_json()

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The rest, at the end of the output: what did not parse as calls is content."""
        rest, self._buffer = self._buffer, ""
        if self.fmt == "hermes":  # a call cut short stays text; whitespace after calls goes
            return ("" if self.calls and not rest.strip() else rest), []
        calls = parse_json_calls(rest, self.fmt, self.names) if rest.strip() else None
        if calls is None:
            return rest, []
        self.calls += calls
        return "", calls

    def _feed_hermes(self) -> tuple[str, list[ParsedCall]]:
        content, calls = "", []
        while True:
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:  # hold back only what may begin the opening tag
                cut = len(self._buffer) - _partial_suffix(self._buffer, TOOL_CALL_OPEN)
                if self.calls and not self._buffer[:cut].strip():
                    return content, calls  # whitespace after a call: held until what follows says whether it goes
                content += self._buffer[:cut]
                self._buffer = self._buffer[cut:]
                return content, calls
            if start:
                before = self._buffer[:start]
                content += before if not (self.calls and not before.strip()) else ""  # no newlines between calls
                self._buffer = self._buffer[start:]
            match = _HERMES_CALL.match(self._buffer)
            if match is None:
                return content, calls  # the call is not complete yet
            call = parse_hermes_call(match.group(1), self.names)
            if call is None:  # not a call of an offered tool: its text is content
                content += match.group(0)
            else:
                calls.append(call)
                self.calls.append(call)
            self._buffer = self._buffer[match.end():]

    def _feed_json(self) -> tuple[str, list[ParsedCall]]:
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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
