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
    return live_client.with_options(timeout=600)  # 8 answers of up to 400 tokens at once on a 2-core CPU


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
    # greedy with a repetition penalty, as a client of a 135M model would set it: a grammar keeps every token
    # valid but cannot end a string the model keeps repeating (an unbounded string or `[a-z]+`); only the
    # token budget can, and a truncated answer is no complete JSON
    kw["extra_body"] = {"repetition_penalty": 1.3, **kw.get("extra_body", {})}
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


def _generate(client, m, schema) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    r = chat(client, m, [{"role": "user", "content": "Give an example JSON object."}], response_format=fmt,
             max_tokens=400)
    return r.choices[0].message.content, r.choices[0].finish_reason


def _corpus(client, m, schemas) -> None:
    """Every answer that ends (stop) validates; one cut by max_tokens (the 135M model repeating inside an
    unbounded string: no grammar can end it) is counted, and must stay the exception."""
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda s: constrained(lambda: _generate(client, m, s)), schemas))
    cut = 0
    for schema, (text, finish) in zip(schemas, outs):
        assert finish in ("stop", "length"), finish
        if finish == "length":
            cut += 1
            continue
        jsonschema.validate(json.loads(text), schema)
    print(f"{len(schemas) - cut} of {len(schemas)} answers ended and validated; {cut} cut by max_tokens")
    assert cut <= len(schemas) // 4


def test_demo_model_writes_valid_json_under_a_corpus_subset(client, m):
    _corpus(client, m, json_schemas()[::20])


def test_demo_model_writes_valid_json_under_every_corpus_schema(client, m):
    _corpus(client, m, json_schemas())


def test_demo_model_matches_every_regex_and_choice(client, m):
    prompt = [{"role": "user", "content": "Answer."}]
    cut = 0
    for regex in REGEXES:
        r = constrained(lambda: chat(client, m, prompt, extra_body={"structured_outputs": {"regex": regex}}))
        if r.choices[0].finish_reason == "length":  # an unbounded `[a-z]+` the model keeps extending
            cut += 1
            continue
        assert re.fullmatch(regex, r.choices[0].message.content), (regex, r.choices[0].message.content)
    assert cut <= 3, f"{cut} of {len(REGEXES)} regex answers cut by max_tokens"
    for choice in CHOICES:
        r = constrained(lambda: chat(client, m, prompt, extra_body={"guided_choice": choice}))
        assert r.choices[0].message.content in choice


def _deep(levels: int) -> dict:
    """Issue 24's pathological shape: `levels` nested objects around a string of huge maxLength."""
    schema = {"type": "string", "maxLength": 100000}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def test_pathological_schemas_beside_constrained_streams(client, m):
    """The hidden corner on the real CPU backend: a schema nested too deep gets a 400 (naming the field, or the
    body's where its JSON is already too deep to parse); long bounds (maxLength 100000, 40 levels) compile and
    end within max_tokens (a bounded wait); the constrained streams beside them keep getting tokens and
    validate."""
    import time

    def streamed_weather(seed: int) -> tuple[str, float]:
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        text, last, longest = "", None, 0.0
        for chunk in constrained(lambda: chat(client, m, response_format=fmt, stream=True, seed=seed)):
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.monotonic()
                text, longest, last = text + chunk.choices[0].delta.content, max(longest, now - (last or now)), now
        return text, longest

    def pathological(levels: int):
        fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _deep(levels)}}
        try:
            return constrained(lambda: chat(client, m, response_format=fmt, max_tokens=40)).choices[0].finish_reason
        except openai.BadRequestError as err:
            return err.body

    with ThreadPoolExecutor(4) as pool:
        normals = [pool.submit(streamed_weather, seed) for seed in range(2)]
        bad = [pool.submit(pathological, n) for n in (40, 80, 400)]
        assert bad[0].result(timeout=300) in ("stop", "length")
        too_deep, way_too_deep = bad[1].result(timeout=300), bad[2].result(timeout=300)
        results = [f.result(timeout=300) for f in normals]
    # 80 levels: the schema compiler's limit, naming the field; 400: already the request body's JSON parser's
    assert too_deep["param"] == "response_format.json_schema.schema" and "recursion" in too_deep["message"]
    assert "request body is not valid JSON" in way_too_deep["message"] and "recursion" in way_too_deep["message"]
    for text, longest in results:
        jsonschema.validate(json.loads(text), WEATHER)
        assert longest < 5.0, longest  # tokens kept coming (a 135M model's step on 2 cores is tens of ms)


def test_json_object_on_both_endpoints(client, m):
    """An answer that ends is a JSON object; one cut by max_tokens (the model repeating inside a string) is not
    checked, but at least one endpoint's answer must end."""
    chat_r = constrained(lambda: chat(client, m, response_format={"type": "json_object"}))
    comp_r = constrained(lambda: client.completions.create(
        model=m, prompt="A JSON object:", max_tokens=300,
        extra_body={"response_format": {"type": "json_object"}, "repetition_penalty": 1.3}))
    answers = [(chat_r.choices[0].finish_reason, chat_r.choices[0].message.content),
               (comp_r.choices[0].finish_reason, comp_r.choices[0].text)]
    assert {f for f, _ in answers} <= {"stop", "length"} and "stop" in {f for f, _ in answers}, answers
    for finish, text in answers:
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_validate_and_stream_alike(client, m, choice):
    # one call: with parallel calls allowed, a 135M model forced into the call form repeats calls until the
    # budget ends them (test_parallel... below has several)
    r = constrained(lambda: chat(client, m, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False))
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls
    check_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    content, calls, reason = assembled(constrained(lambda: chat(client, m, tools=TOOLS, tool_choice=choice,
                                                                parallel_tool_calls=False, stream=True)))
    assert reason == "tool_calls" and (content or None) == message.content  # greedy: the same output
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_a_multi_turn_tool_exchange(client, m):
    first = constrained(lambda: chat(client, m, tools=TOOLS, tool_choice="required",
                                     parallel_tool_calls=False)).choices[0].message
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
