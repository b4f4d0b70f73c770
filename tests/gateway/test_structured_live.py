"""Structured outputs and tools on the real server (`blink serve`, cpu engine, the demo model) with the official
openai client. The constrained cases need a backend whose ring carries token masks: against one without, they
FAIL (never skip) with a message saying so."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.gateway.schemas.corpus import CHOICES, REGEXES, json_schemas

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_slot_leaks")]

NO_MASKS = "does not support structured output"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                                                                 "maxLength": 20}},
                                                          "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Use a tool."}]


@pytest.fixture(scope="module")
def client(live_client):
    return live_client


@pytest.fixture(scope="module")
def m(live_server) -> str:
    return live_server.model


def constrained(call):
    """Run a constrained request; a backend without masks fails the test, saying what is missing."""
    try:
        return call()
    except openai.BadRequestError as err:
        if NO_MASKS in str(err):
            pytest.fail(f"the backend has no token-mask area, so structured outputs cannot run: {err}")
        raise


def chat(client, m, messages=ASK, **kw):
    return client.chat.completions.create(model=m, messages=messages, max_tokens=kw.pop("max_tokens", 300),
                                          temperature=kw.pop("temperature", 0), **kw)


def check_calls(calls) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def assembled(stream) -> tuple[str, list, str | None]:
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, [call.function.name, ""])
            entry[1] += call.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [tuple(v) for _, v in sorted(calls.items())], reason


# ---------------------------------------------------------------- constrained (need the engine's masks)


def _generate(client, m, schema) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    r = chat(client, m, [{"role": "user", "content": "Give an example JSON object."}], response_format=fmt,
             max_tokens=400)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    return r.choices[0].message.content


def _corpus(client, m, schemas) -> None:
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda s: constrained(lambda: _generate(client, m, s)), schemas))
    for schema, text in zip(schemas, texts):
        jsonschema.validate(json.loads(text), schema)


def test_demo_model_writes_valid_json_under_a_corpus_subset(client, m):
    _corpus(client, m, json_schemas()[::20])


def test_demo_model_writes_valid_json_under_every_corpus_schema(client, m):
    _corpus(client, m, json_schemas())


def test_demo_model_matches_every_regex_and_choice(client, m):
    prompt = [{"role": "user", "content": "Answer."}]
    for regex in REGEXES:
        r = constrained(lambda: chat(client, m, prompt, extra_body={"structured_outputs": {"regex": regex}}))
        assert re.fullmatch(regex, r.choices[0].message.content), (regex, r.choices[0].message.content)
    for choice in CHOICES:
        r = constrained(lambda: chat(client, m, prompt, extra_body={"guided_choice": choice}))
        assert r.choices[0].message.content in choice


def test_json_object_on_both_endpoints(client, m):
    r = constrained(lambda: chat(client, m, response_format={"type": "json_object"}))
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = constrained(lambda: client.completions.create(model=m, prompt="A JSON object:", max_tokens=200,
                                                      extra_body={"response_format": {"type": "json_object"}}))
    assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_validate_and_stream_alike(client, m, choice):
    r = constrained(lambda: chat(client, m, tools=TOOLS, tool_choice=choice))
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls
    check_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    content, calls, reason = assembled(constrained(lambda: chat(client, m, tools=TOOLS, tool_choice=choice,
                                                                stream=True)))
    assert reason == "tool_calls" and (content or None) == message.content  # greedy: the same output
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_a_multi_turn_tool_exchange(client, m):
    first = constrained(lambda: chat(client, m, tools=TOOLS, tool_choice="required")).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})}
                for c in first.tool_calls]
    r = chat(client, m, history, tools=TOOLS, max_tokens=60)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


# ---------------------------------------------------------------- no masks needed


def test_auto_answers_text_or_calls_that_validate(client, m):
    r = chat(client, m, tools=TOOLS, max_tokens=80)
    message = r.choices[0].message
    if message.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(message.tool_calls)
    else:
        assert message.content and r.choices[0].finish_reason in ("stop", "length")
    content, calls, reason = assembled(chat(client, m, tools=TOOLS, max_tokens=80, stream=True))
    assert (content or None) == message.content  # greedy: streamed deltas assemble to the message
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def test_tool_results_in_the_history_render_with_the_fallback(client, m):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r = chat(client, m, history, tools=TOOLS, max_tokens=30)
    assert r.usage.prompt_tokens > 60  # the tools' preamble and the exchange are in the prompt


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"extra_body": {"structured_outputs": {"regex": "a((", "choice": ["a"]}}}, "structured_outputs"),
])
def test_bad_requests_are_400s_naming_the_field(client, m, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, m, **kw)
    assert info.value.body["param"] == param
