"""Tool calling on the request side: which call format the model writes, the prompt (the model's chat template
with `tools=`, or the fallback convention of docs/api.md for a template without tool support), and the
grammar that holds `tool_choice` "required" or a named function to that format (so the output always parses).

Formats (`ToolFormat`): "hermes" (`<tool_call>{"name", "arguments"}</tool_call>`: Qwen2.5/Qwen3 and the
fallback), "llama3_json" (`{"name", "parameters"}`, calls separated by "; ") and "mistral"
(`[TOOL_CALLS][{"name", "arguments"}, ...]`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from protocols.openai import ChatCompletionRequest, ChatMessage, SamplingFields, Tool

from ..errors import bad_request
from .constraint import Constraint
from .grammar import JSON_OPTIONS
from .setup import constraint_of

ToolFormat = Literal["hermes", "llama3_json", "mistral"]
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FALLBACK_PREAMBLE = ("You can call the following tools. Each is described by a JSON object:\n<tools>\n{tools}\n"
                     "</tools>\n{instruction}")
FALLBACK_AUTO = ("To call a tool, answer with <tool_call>{\"name\": <the tool's name>, \"arguments\": <its "
                 "arguments as a JSON object>}}</tool_call>, one such block per call. If no tool is needed, "
                 "answer normally.")


def template_takes_tools(source: str | None) -> bool:
    """The chat template renders a `tools` list itself (transformers' convention)."""
    return bool(source) and "tools" in source


def tool_format_of(source: str | None) -> ToolFormat:
    """The call format the model was trained on, read from its chat template; "hermes" by default (the
    fallback convention's)."""
    if template_takes_tools(source):
        if "[TOOL_CALLS]" in source:
            return "mistral"
        if "<|python_tag|>" in source or "ipython" in source:
            return "llama3_json"
    return "hermes"


def tool_dicts(tools: Sequence[Tool]) -> list[dict]:
    """Tools as chat templates read them (OpenAI's shape)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_messages(messages: Sequence[ChatMessage], takes_tools: bool) -> list[dict]:
    """Chat messages as chat templates read them. A template with tool support gets the calls as
    transformers passes them (arguments as an object); one without gets the fallback's text forms."""
    return [_template_message(m, takes_tools) for m in messages]


def _template_message(m: ChatMessage, takes_tools: bool) -> dict:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_calls and takes_tools:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}} for c in m.tool_calls]
    elif m.tool_calls:
        calls = "".join(f"{TOOL_CALL_OPEN}{_call_json(c.function.name, c.function.arguments)}{TOOL_CALL_CLOSE}"
                        for c in m.tool_calls)
        out["content"] = out["content"] + calls
    if m.role == "tool":
        if takes_tools:
            out["tool_call_id"] = m.tool_call_id
        else:  # the fallback: a tool's result is a user turn the model reads (any template knows "user")
            out = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    return out


def template_inputs(messages: Sequence[ChatMessage], req: ChatCompletionRequest | None,
                    source: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and the `tools` argument a chat template renders: the offered tools go to a template
    that takes them, else into the fallback's system preamble (then `tools` is None)."""
    takes_tools = template_takes_tools(source)
    rendered = template_messages(messages, takes_tools)
    if req is None or req.tool_mode == "none":
        return rendered, None
    if takes_tools:
        return rendered, tool_dicts(_offered_tools(req))
    return with_fallback_preamble(rendered, fallback_preamble(req)), None


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call_json(name: str, arguments: str) -> str:
    return json.dumps({"name": name, "arguments": _arguments_object(arguments)}, ensure_ascii=False)


def fallback_preamble(req: ChatCompletionRequest) -> str:
    """The system text that lists the tools for a template without tool support (docs/api.md)."""
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts(_offered_tools(req)))
    return FALLBACK_PREAMBLE.format(tools=tools, instruction=FALLBACK_AUTO)


def with_fallback_preamble(messages: list[dict], preamble: str) -> list[dict]:
    """The preamble joins the first system message, or becomes one."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def _offered_tools(req: ChatCompletionRequest) -> list[Tool]:
    """The tools the prompt lists: all of them, or only the one a named tool_choice forces."""
    if req.tool_mode == "named":
        return [t for t in req.tools if t.function.name == req.tool_choice.function.name]
    return list(req.tools or ())


# ---------------------------------------------------------------- the output's constraint


def output_constraint(req: SamplingFields, tokenizer) -> Constraint | None:
    """What the output must match: the request's structured-output field, or the tool-call form when
    tool_choice is "required" or names a function; None for free output."""
    spec = req.constraint_spec()
    if spec is not None:
        constraint = constraint_of(*spec)
    elif isinstance(req, ChatCompletionRequest) and req.forced_tools:
        constraint = tool_call_constraint(req, tool_format_of(tokenizer.template_source))
    else:
        return None
    if req.ignore_eos:  # a finished grammar allows EOS only: the output must be able to end there
        raise bad_request(f"'ignore_eos' cannot go with '{constraint.param}': a constrained output ends with EOS "
                          f"once it is complete", "ignore_eos")
    return constraint


def _strict_json(schema: dict) -> dict:
    """An inline schema of a Lark grammar, with the compact JSON options of top-level schemas."""
    return {**schema, "x-guidance": JSON_OPTIONS}


def _call_schema(tool: Tool, fmt: ToolFormat) -> dict:
    args = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    return _strict_json({"type": "object", "properties": {"name": {"const": tool.function.name}, args_key: args},
                         "required": ["name", args_key], "additionalProperties": False})


def tool_call_grammar(tools: Sequence[Tool], fmt: ToolFormat, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with inline %json) of one call of `tools`, or one or more if `parallel`."""
    rules = [f"fn{i}: %json {json.dumps(_call_schema(t, fmt))}" for i, t in enumerate(tools)]  # name first
    fns = " | ".join(f"fn{i}" for i in range(len(tools)))
    if fmt == "hermes":
        call, sep, head, tail = f'"{TOOL_CALL_OPEN}\\n" ({fns}) "\\n{TOOL_CALL_CLOSE}"', '"\\n"', "", ""
    elif fmt == "llama3_json":
        call, sep, head, tail = f"({fns})", '"; "', "", ""
    else:  # mistral: [TOOL_CALLS] is a special token the template's format puts first; the list follows
        call, sep, head, tail = f"({fns})", '", "', '"[" ', ' "]"'
    body = f"call ({sep} call)*" if parallel else "call"
    return "\n".join([f"start: {head}{body}{tail}", f"call: {call}", *rules]) + "\n"


def tool_call_constraint(req: ChatCompletionRequest, fmt: ToolFormat) -> Constraint:
    tools = _offered_tools(req)
    parallel = req.parallel_tool_calls is not False and req.tool_mode == "required"
    param = "tool_choice.function.name" if req.tool_mode == "named" else "tools"
    return Constraint("grammar", tool_call_grammar(tools, fmt, parallel), param)


def tools_param_constraints(req: ChatCompletionRequest) -> list[Constraint]:
    """Each tool's parameters as a constraint to compile (an invalid schema gets its 400 by name)."""
    return [Constraint.json_schema(t.function.parameters, f"tools[{i}].function.parameters")
            for i, t in enumerate(req.tools or ()) if t.function.parameters is not None]
