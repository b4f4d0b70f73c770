"""The OpenAI (and vLLM) schemas of structured outputs and tool calling: `response_format`, vLLM's
`structured_outputs`, `tools` and `tool_choice`, a history's tool calls, and the tool calls of a response;
with the checks of `protocols/openai.py`'s requests that concern them. The gateway's side:
gateway/structured/."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .openai_base import InvalidRequest, StrictRequest, omit_none
from .openai_fields import RESPONSE_FORMAT_TYPES, TOOL_CHOICES, short_value


class JsonSchemaFormat(StrictRequest):
    """response_format's json_schema: the schema the message content must match."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")  # absent: any JSON
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictRequest):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictRequest):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(StrictRequest):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(StrictRequest):
    name: str
    arguments: str  # JSON, as the model wrote it


class MessageToolCall(StrictRequest):
    """An assistant turn's tool call, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ---------------------------------------------------------------- checks


def check_response_format(req) -> None:
    """A 400 for a response_format of an unknown type, or json_schema without its schema."""
    kind = req.response_format.type if req.response_format else "text"
    if kind not in RESPONSE_FORMAT_TYPES:
        raise InvalidRequest(f"invalid value for 'response_format.type': {short_value(kind)}; OpenAI's types are "
                             f"{', '.join(map(json.dumps, RESPONSE_FORMAT_TYPES))}", "response_format.type")
    if kind == "json_schema" and req.response_format.json_schema is None:
        raise InvalidRequest("'response_format.json_schema' is required with type \"json_schema\"",
                             "response_format.json_schema")


def constraint_spec(req) -> tuple[str, Any, str] | None:
    """The output's constraint as (kind, value, field): kind "json_schema" (value a schema, a dict or a
    bool, or its JSON text), "regex", "choice" (a list of strings) or "grammar" (Lark or GBNF); None when
    the output is free. A 400 when the request sets more than one."""
    found = [spec for spec in _constraint_specs(req) if spec is not None]
    if len(found) > 1:
        raise InvalidRequest(f"'{found[0][2]}' and '{found[1][2]}' both constrain the output: send one",
                             found[1][2])
    return found[0] if found else None


def _constraint_specs(req):
    """Each constraint the request sets, as (kind, value, field)."""
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        yield "json_schema", {"type": "object"}, "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        yield "json_schema", fmt.json_schema.json_schema, "response_format.json_schema.schema"
    so = req.structured_outputs
    if so is not None:
        named = [(n, v) for n, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar)) if v is not None]
        if so.json_object:
            named.append(("json_object", {"type": "object"}))
        if len(named) != 1:
            raise InvalidRequest("'structured_outputs' must set exactly one of json, regex, choice, grammar "
                                 "or json_object", "structured_outputs")
        name, value = named[0]
        kind = {"json": "json_schema", "json_object": "json_schema"}.get(name, name)
        yield kind, value, f"structured_outputs.{name}"
    for kind, name in (("json_schema", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                       ("grammar", "guided_grammar")):
        if getattr(req, name) is not None:
            yield kind, getattr(req, name), name


def check_message_tools(i: int, message) -> None:
    """A 400 for a history message whose tool fields do not fit its role."""
    if message.function_call is not None:
        raise InvalidRequest(f"'messages[{i}].function_call' (the legacy form) is not supported: send "
                             f"'tool_calls'", f"messages[{i}].function_call")
    if message.tool_calls and message.role != "assistant":
        raise InvalidRequest(f"'messages[{i}].tool_calls' belongs to an assistant message, not a "
                             f"{message.role!r} one", f"messages[{i}].tool_calls")
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequest(f"'messages[{i}].tool_call_id' is required in a tool message",
                             f"messages[{i}].tool_call_id")


def check_tools(req) -> None:
    """A 400 for tools of one name, or a tool_choice that does not fit the tools."""
    names = [tool.function.name for tool in req.tools or ()]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"'tools[{i}].function.name': {name!r} names two tools",
                                 f"tools[{i}].function.name")
    choice = req.tool_choice
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise InvalidRequest(f"invalid value for 'tool_choice': {short_value(choice)}; send "
                             f"{', '.join(map(json.dumps, TOOL_CHOICES))} or a named function", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequest(f"'tool_choice.function.name': {choice.function.name!r} is not among 'tools'",
                             "tool_choice.function.name")
    if choice == "required" and not names:
        raise InvalidRequest("'tool_choice' \"required\" needs 'tools'", "tool_choice")
    if req.forced_tools and (spec := constraint_spec(req)) is not None:
        forcing = short_value(choice) if isinstance(choice, str) else "naming a function"
        raise InvalidRequest(f"'tool_choice' {forcing} and '{spec[2]}' both constrain the output: send one",
                             "tool_choice")


# ---------------------------------------------------------------- responses


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = omit_none()
    arguments: str | None = omit_none()


class ToolCallDelta(BaseModel):
    """A streamed tool call: the first delta of a call carries its id, type and name, the next ones pieces
    of its arguments; `index` says which call of the message."""

    index: int
    id: str | None = omit_none()
    type: Literal["function"] | None = omit_none()
    function: FunctionCallDelta
