"""Tool calling (gateway/structured/tools.py, tool_parsers.py, gateway/api/tool_format.py): parsers per format,
streamed pieces that assemble to the whole, the forced-call grammars (a random model under them always writes
calls that parse and validate), prompt rendering with a tool-aware template and with the fallback."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.api.tool_format import ToolChatFormat, assemble
from gateway.api.formats import ChoiceOutput
from gateway.request.generate import Piece
from gateway.request.tokenize import ChatTemplate
from gateway.structured.constraint import Constraint
from gateway.structured.grammar import Grammars
from gateway.structured.tool_parsers import ToolCallStream
from gateway.structured.tools import (FALLBACK_AUTO, template_inputs, tool_call_grammar, tool_format_of,
                                      template_takes_tools)
from protocols.openai import ChatCompletionRequest, parse_request
from tests.gateway.structured_helpers import RandomSampler, generate

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
NAMES = ("get_weather", "get_time")


def chat_request(**kw) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS, **kw}
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def run_stream(fmt: str, text: str, cut: int) -> tuple[str, list]:
    """The text fed in pieces of `cut` characters: all content, all calls (name, arguments)."""
    stream, content, deltas = ToolCallStream(fmt, NAMES), "", []
    for i in range(0, len(text), cut):
        c, k = stream.feed(text[i:i + cut])
        content, deltas = content + c, deltas + k
    c, k = stream.finish()
    return content + c, [(call.name, json.loads(call.arguments)) for call in assemble(deltas + k)]


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "get_time", "parameters": {"tz": "CET"}}'
MISTRAL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]'
BOTH = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("fmt, text, content", [("hermes", HERMES, "Let me check.\n"), ("llama3_json", LLAMA, ""),
                                                ("llama3_json", "<|python_tag|>" + LLAMA, ""),
                                                ("mistral", MISTRAL, ""), ("mistral", MISTRAL[12:], "")])
def test_parsers_find_the_calls_whatever_the_pieces(fmt, text, content):
    for cut in (1, 2, 3, 7, len(text)):
        assert run_stream(fmt, text, cut) == (content, BOTH), cut


def run_raw(text: str, cut: int) -> list:
    stream, deltas = ToolCallStream("hermes", NAMES), []
    for i in range(0, len(text), cut):
        deltas += stream.feed(text[i:i + cut])[1]
    return deltas + stream.finish()[1]


def test_hermes_arguments_stream_as_they_are_written():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    deltas = run_raw(text, 4)
    assert deltas[0].id and deltas[0].name == "get_weather" and deltas[0].arguments == ""
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) > 3 and all(d.id is None for d in deltas[1:])  # pieces, as they came
    assert "".join(fragments) == '{"city": "Paris", "unit": "c"}'
    for cut in (1, 2, 5, len(text)):
        assert [(c.name, c.arguments) for c in assemble(run_raw(text, cut))] == [("get_weather", "".join(fragments))]


def test_a_call_cut_short_keeps_its_arguments_so_far():
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "C'
    for cut in (1, 3, len(text)):
        assert [(c.name, c.arguments) for c in assemble(run_raw(text, cut))] == [("get_time", '{"tz": "C')]


def test_a_call_cut_just_before_its_closing_tag_keeps_only_its_arguments():
    """max_tokens reached after the call object's `}`: the arguments are the object, not `{...}}`."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    for cut in (1, 3, len(text)):
        assert [(c.name, c.arguments) for c in assemble(run_raw(text, cut))] == [("get_weather", '{"city": "Paris"}')]
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "tags": {"a": {}}}'  # still open
    assert [c.arguments for c in assemble(run_raw(text, 4))] == ['{"city": "Paris", "tags": {"a": {}}}']


def test_text_after_a_call_streams_as_it_completes():
    text = HERMES + "\n\n  Done."
    assert run_stream("hermes", text, 1) == run_stream("hermes", text, len(text)) == ("Let me check.\n\n\n  Done.", BOTH)


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "The weather is fine <tool_call is a tag"),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not an offered tool
    ("hermes", '<tool_call>{"name": "get_time"'),  # cut short before its arguments
    ("llama3_json", "It is sunny in Paris."),
    ("llama3_json", '{"answer": 42}'),
    ("mistral", "[1, 2, 3]"),
])
def test_text_that_is_not_a_call_stays_text(fmt, text):
    for cut in (1, 5, len(text)):
        assert run_stream(fmt, text, cut) == (text, [])


@pytest.mark.parametrize("template, fmt", [(None, "hermes"), ("{{ messages }}", "hermes"),
                                           ("{% if tools %}<tool_call>{% endif %}", "hermes"),
                                           ("{% if tools %}<|python_tag|>{% endif %}", "llama3_json"),
                                           ("{% if tools %}[TOOL_CALLS]{% endif %}", "mistral")])
def test_the_call_format_comes_from_the_template(template, fmt):
    assert tool_format_of(template) == fmt


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_a_random_model_under_the_forced_call_grammar_always_calls(byte_tokenizer, fmt, parallel):
    eos = byte_tokenizer.token_to_id("<|im_end|>")
    grammars = Grammars(byte_tokenizer, byte_tokenizer.get_vocab_size(), [eos])
    tools = chat_request().tools
    compiled = grammars.compile_sync(Constraint("grammar", tool_call_grammar(tools, fmt, parallel), "tools"))
    sampler = RandomSampler(byte_tokenizer, eos, seed=3, soft_budget=30)
    for _ in range(8):
        text = byte_tokenizer.decode(generate(grammars, compiled, sampler))
        content, calls = run_stream(fmt, text, 4)
        assert content == "" and calls and (parallel or len(calls) == 1), text
        for name, args in calls:
            jsonschema.validate(args, WEATHER if name == "get_weather" else TIME)


def test_a_named_choice_offers_and_forces_that_tool_only(byte_tokenizer):
    req = chat_request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert req.tool_mode == "named" and req.forced_tools
    from gateway.structured.tools import tool_call_constraint
    grammar = tool_call_constraint(req, "hermes").text
    assert "get_time" in grammar and "get_weather" not in grammar
    rendered, tools = template_inputs(req.messages, req, None)
    assert "get_time" in rendered[0]["content"] and "get_weather" not in rendered[0]["content"] and tools is None


def test_the_fallback_lists_the_tools_in_a_system_preamble():
    req = chat_request(messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "weather?"},
                                 {"role": "assistant", "content": None, "tool_calls": [
                                     {"id": "c1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "-3"}])
    rendered, tools = template_inputs(req.messages, req, "{{ messages }}")
    assert tools is None and rendered[0]["content"].startswith("Be brief.\n\n") and FALLBACK_AUTO in rendered[0]["content"]
    assert json.dumps(TOOLS[0]) in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n-3\n</tool_response>"}


def test_a_tool_aware_template_gets_tools_and_calls_as_transformers_passes_them():
    source = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}:"
              "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments.city }}"
              "{% endfor %}{% elif m.role == 'tool' %}{{ m.tool_call_id }}={{ m.content }}{% else %}{{ m.content }}"
              "{% endif %}|{% endfor %}")
    assert template_takes_tools(source)
    req = chat_request(messages=[{"role": "user", "content": "w?"},
                                 {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                                     "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "-3"}])
    rendered, tools = template_inputs(req.messages, req, source)
    text = ChatTemplate(source, {}).render(rendered, tools=tools)
    assert text == "T:get_weather;T:get_time;user:w?|assistant:get_weatherOslo|tool:c1=-3|"


def test_tool_choice_none_renders_no_tools():
    req = chat_request(tool_choice="none")
    rendered, tools = template_inputs(req.messages, req, None)
    assert tools is None and rendered == [{"role": "user", "content": "weather in Paris?"}]


def test_streamed_tool_deltas_assemble_to_the_full_message():
    pieces = [HERMES[i:i + 5] for i in range(0, len(HERMES), 5)]
    stream_fmt = ToolChatFormat("id", "m", None, "hermes", NAMES)
    events = b"".join(stream_fmt.piece_events(0, Piece(p, "stop" if i == len(pieces) - 1 else None))
                      for i, p in enumerate(pieces))
    chunks = [json.loads(line[6:]) for line in events.decode().split("\n\n") if line]
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in call:
                assert entry["id"] is None and call["function"]["name"]  # id and name come first, once
                entry["id"], entry["name"] = call["id"], call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments", "")
        reasons.append(choice["finish_reason"])
    full = ToolChatFormat("id", "m", None, "hermes", NAMES).full([ChoiceOutput(HERMES, "stop")], 1, 1)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and reasons[-1] == "tool_calls"
    assert content == message.content == "Let me check.\n"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_text_answer_with_tools_on_is_text():
    full = ToolChatFormat("id", "m", None, "hermes", NAMES).full([ChoiceOutput("It is sunny.", "stop")], 1, 1)
    assert full.choices[0].message.content == "It is sunny." and full.choices[0].message.tool_calls is None
    assert full.choices[0].finish_reason == "stop"
    assert "tool_calls" not in full.model_dump_json()


def test_forced_calls_and_schemas_keep_the_key_order(byte_tokenizer):
    """Properties come out in the schema's order (a call's name before its arguments, as models are trained)."""
    eos = byte_tokenizer.token_to_id("<|im_end|>")
    grammars = Grammars(byte_tokenizer, byte_tokenizer.get_vocab_size(), [eos])
    sampler = RandomSampler(byte_tokenizer, eos, seed=5, soft_budget=20)
    grammar = tool_call_grammar(chat_request().tools, "hermes", False)
    text = byte_tokenizer.decode(generate(grammars, grammars.compile_sync(Constraint("grammar", grammar, "t")), sampler))
    assert text.startswith('<tool_call>\n{"name": '), text
    schema = {"type": "object", "properties": {"zeta": {"const": 1}, "alpha": {"const": 2}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    compiled = grammars.compile_sync(Constraint.json_schema(schema, "s"))
    assert byte_tokenizer.decode(generate(grammars, compiled, sampler)) == '{"zeta": 1, "alpha": 2}'
