"""Structured outputs and tools through the whole gateway (HTTP, the official openai client, compile, the first
mask, the poller's mask loop, put_mask, tool formats), against `MaskEngine`: a random model that samples only
what the gateway's masks allow and waits for each. Every constrained output must validate."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import jsonschema
import openai
import pytest

from gateway.backends.backend import Backend
from gateway.config import GatewayConfig
from gateway.server import start_gateway
from gateway.structured.grammar import mask_words
from protocols.messages import BackendInfo
from protocols.shm import attach_ring, create_ring
from protocols.ring import RingGeometry
from tests.gateway.conftest import MODEL
from tests.gateway.mask_engine import BREAK_SEED, MaskEngine, MaskGeometry, MaskProducer
from tests.gateway.schemas.corpus import json_schemas

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
GEOMETRY = RingGeometry(num_slots=4, max_prompt_len=2048, max_output_len=16, max_stop_ids=4)
CONTEXT_LEN = 4096  # the tools' preamble is long in the test tokenizer's tokens
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"]}}}]


@pytest.fixture(scope="module")
def live(model_dir, byte_tokenizer, pick_free_port):
    """(openai client, engine): a gateway whose backend's ring has a mask area, and a MaskEngine behind it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ring_name = f"blink-so-test-{os.getpid()}"
    eos_id = byte_tokenizer.token_to_id("<|im_end|>")

    async def start():
        ring = create_ring(ring_name, GEOMETRY, "fp-so")
        producer = MaskProducer(attach_ring(ring_name))
        engine = MaskEngine(ring, producer, byte_tokenizer, eos_id)
        geometry = MaskGeometry(GEOMETRY, mask_words(byte_tokenizer.get_vocab_size()))
        info = BackendInfo(addr="in-process", model_name=MODEL, model_dir=str(model_dir), model_fingerprint="fp-so",
                           context_len=CONTEXT_LEN, vocab_size=byte_tokenizer.get_vocab_size(),
                           eos_token_ids=(eos_id,), engine_mode="echo", ring_name=ring_name, geometry=geometry)
        config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({"k"}),
                               slot_wait_s=5.0)
        backend = Backend(info, producer, config)
        backend.start()
        server = await start_gateway(config, backends=[backend])
        return ring, engine, asyncio.create_task(engine.run()), server

    ring, engine, task, server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    patch = pytest.MonkeyPatch()

    def first_mask(spec, compiled):  # RequestSpec.token_mask, until the engine's branch adds the field
        engine.first_masks[spec.request_id] = compiled.first_mask
        return spec
    patch.setattr("gateway.request.pipeline.with_first_mask", first_mask)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=30)
    yield client, engine, f"127.0.0.1:{server.grpc_port}"
    patch.undo()

    async def stop():
        await server.close()
        task.cancel()
        ring.close()
    asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    assert engine.failure is None, repr(engine.failure)


def chat(client, stream=False, **kw):
    messages = kw.pop("messages", [{"role": "user", "content": "hi"}])
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 230),
                                          stream=stream, **kw)


def streamed(client, **kw) -> tuple[str, dict, str]:
    """A streamed chat assembled: (content, tool calls by index, finish reason)."""
    content, calls, reason = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_outputs_validate(live, seed):
    client, engine, _ = live
    schema = json_schemas()[seed * 37]
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    r = chat(client, response_format=fmt, seed=seed)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    content, _, reason = streamed(client, response_format=fmt, seed=seed)
    assert reason == "stop" and content == r.choices[0].message.content  # same seed, same masks, same output


def test_every_kind_of_constraint_and_field(live):
    client, engine, _ = live
    before = MaskProducer.num_masks
    r = chat(client, response_format={"type": "json_object"}, seed=1)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = chat(client, extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", r.choices[0].message.content)
    r = chat(client, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=100,
                                  extra_body={"guided_json": WEATHER, "seed": 3})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50,
                                  extra_body={"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+ "d"'}})
    assert re.fullmatch("a[bc]+d", r.choices[0].text)
    # every token after the first of each request was sampled under a mask the gateway sent (the engine waits)
    assert MaskProducer.num_masks - before >= len(r.choices[0].text) // 4


def test_tool_choice_required_always_calls_and_validates(live):
    client, _, _ = live
    for seed in range(3):
        r = chat(client, tools=TOOLS, tool_choice="required", seed=seed)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls and not message.content
        for call in message.tool_calls:
            schema = TOOLS[0]["function"]["parameters"] if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            assert call.id.startswith("call_") and call.type == "function"
        content, calls, reason = streamed(client, tools=TOOLS, tool_choice="required", seed=seed)
        assert reason == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_a_named_tool_choice_calls_that_tool_once(live):
    client, _, _ = live
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, seed=4)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["tz"] in ("CET", "UTC")


def test_auto_parses_a_call_and_leaves_text_as_text(live):
    client, _, _ = live
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
    r = chat(client, tools=TOOLS, messages=[{"role": "user", "content": "SAY:" + call}])
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls, reason = streamed(client, tools=TOOLS, messages=[{"role": "user", "content": "SAY:" + call}])
    assert reason == "tool_calls" and calls[0]["name"] == "get_weather" and not content
    r = chat(client, tools=TOOLS, messages=[{"role": "user", "content": "SAY:It is sunny"}])
    assert r.choices[0].message.content == "It is sunny" and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_multi_turn_exchange_with_tool_results(live):
    client, _, _ = live
    first = chat(client, tools=TOOLS, tool_choice="required", seed=7).choices[0].message
    history = [{"role": "user", "content": "weather?"}, first.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in first.tool_calls]
    history.append({"role": "user", "content": "SAY:It is sunny in Paris."})
    r = chat(client, tools=TOOLS, messages=history)
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"


def test_a_token_outside_the_grammar_ends_the_request_clearly(live):
    client, _, _ = live
    with pytest.raises(openai.InternalServerError) as info:
        chat(client, response_format={"type": "json_object"}, seed=BREAK_SEED)
    assert "outside the requested grammar" in info.value.body["message"]
    r = chat(client, response_format={"type": "json_object"}, seed=1)  # the next one is served
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "a(("}}}, "structured_outputs.regex"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "bogus"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(live, kw, param):
    client, _, _ = live
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kw)
    assert info.value.body["param"] == param


def test_grpc_generate_takes_the_same_constraints(live):
    import grpc

    from protocols import inference_pb2 as pb, inference_pb2_grpc

    _, _, addr = live
    auth = [("authorization", "Bearer k")]
    with grpc.insecure_channel(addr) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        def text(**so) -> str:
            request = pb.GenerateRequest(model=MODEL, prompt="x", max_tokens=200,
                                         structured_outputs=pb.StructuredOutputs(**so))
            return "".join(m.text for m in stub.Generate(request, metadata=auth))
        assert re.fullmatch("[0-9]{4}", text(regex="[0-9]{4}"))
        assert text(choice=pb.ChoiceList(choices=["left", "right"])) in ("left", "right")
        jsonschema.validate(json.loads(text(json=json.dumps(WEATHER))), WEATHER)
        with pytest.raises(grpc.RpcError) as info:
            text(regex="a((")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("error-param", "structured_outputs.regex") in info.value.trailing_metadata()


def _deep(levels: int) -> dict:
    """A pathological schema: `levels` nested objects around an unbounded-looking string."""
    schema = {"type": "string", "maxLength": 100000}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"k{i}": schema, "n": {"type": "string",
                                                                            "pattern": "^(a|b|c){1,5000}$"}},
                  "required": [f"k{i}"]}
    return schema


def test_pathological_schemas_beside_plain_streams(live):
    """Deep nesting and long bounds get a clear 400 (or compile within bounds) while plain streams go on."""
    client, _, _ = live
    from concurrent.futures import ThreadPoolExecutor

    def plain() -> str:
        r = chat(client, messages=[{"role": "user", "content": "SAY:" + "the quick brown fox " * 4}])
        return r.choices[0].message.content

    def pathological(levels: int):
        fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _deep(levels)}}
        try:
            return chat(client, response_format=fmt, max_tokens=60).choices[0].finish_reason
        except openai.BadRequestError as err:
            return err.body
    with ThreadPoolExecutor(6) as pool:
        plains = [pool.submit(plain) for _ in range(4)]
        deep = [pool.submit(pathological, n) for n in (40, 400)]
        assert all(p.result(timeout=30) == "the quick brown fox " * 4 for p in plains)
        assert deep[0].result(timeout=30) in ("stop", "length")
        error = deep[1].result(timeout=30)
        # too deep for the JSON parser of the body or for the schema compiler: a 400 that says so, either way
        assert error["param"] in (None, "response_format.json_schema.schema") and "recursion" in error["message"]


def test_fields_that_cannot_go_with_a_constraint(live):
    client, _, _ = live
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    assert info.value.body["param"] == "ignore_eos"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, extra_body={"structured_outputs": {"regexp": "a+"}})
    assert info.value.body["param"] == "structured_outputs.regexp" and "unknown field" in info.value.body["message"]


def test_pathological_grammars_beside_constrained_streams(live, monkeypatch):
    """Issue 24's hidden corner, beside streams that are constrained themselves (their masks share the pools):
    a schema too deep gets a 400; one whose compilation takes over the limit a 400 saying so; one whose masks
    are slow goes on at its own pace within max_tokens; one whose mask step stalls ends with a clear error after
    MASK_STEP_LIMIT_S. Meanwhile the other streams' tokens keep arriving (no gap near the slow one's per-token
    delay) and their output validates."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from gateway.structured import grammar as G, mask_loop as ML, setup as S
    from tests.gateway.test_structured_mask_watch import SlowLoop

    client, _, _ = live
    monkeypatch.setattr(G, "COMPILE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(ML, "MASK_STEP_LIMIT_S", 1.0)
    delays, compile_sync = {}, G.Grammars.compile_sync  # id(compiled) -> its masks' delay (s)

    def marked_compile(self, constraint):
        if '"slow_compile"' in constraint.text:
            time.sleep(2.0)
        compiled = compile_sync(self, constraint)
        delays[id(compiled)] = 0.5 if '"slow_masks"' in constraint.text else 3.0 if '"stall"' in constraint.text else 0
        return compiled

    def mask_loop(grammars, compiled, *args, **kw):
        loop = SlowLoop(grammars, compiled, *args, **kw)
        loop.delay_s = delays.get(id(compiled), 0)
        return loop
    monkeypatch.setattr(G.Grammars, "compile_sync", marked_compile)
    monkeypatch.setattr(S, "MaskLoop", mask_loop)

    def fmt(schema: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}

    def bad(name: str, schema: dict, max_tokens: int = 8):
        try:
            content, _, reason = streamed(client, response_format=fmt(schema), max_tokens=max_tokens, seed=1)
            return reason, content
        except (openai.BadRequestError, openai.APIError) as err:
            return type(err).__name__, err.body if isinstance(err.body, dict) else str(err)

    def normal(stop: threading.Event) -> tuple[int, float]:
        """Constrained streams one after another until `stop`: (how many completed, the longest gap between two
        of a stream's tokens, s)."""
        done, longest = 0, 0.0
        while not stop.is_set():
            last, content = None, ""
            for chunk in chat(client, stream=True, response_format=fmt(WEATHER), seed=done, max_tokens=100):
                now = time.monotonic()
                if chunk.choices and chunk.choices[0].delta.content:
                    content += chunk.choices[0].delta.content
                    longest, last = max(longest, now - (last or now)), now
            jsonschema.validate(json.loads(content), WEATHER)
            done += 1
        return done, longest

    slow_masks = {"type": "object", "properties": {"slow_masks": {"type": "string", "maxLength": 100000}}}
    stop = threading.Event()
    with ThreadPoolExecutor(8) as pool:
        normals = [pool.submit(normal, stop) for _ in range(3)]
        time.sleep(0.3)
        outcomes = {name: pool.submit(bad, name, schema) for name, schema in (
            ("deep", _deep(400)), ("slow_compile", {"type": "object", "properties": {"slow_compile": {}}}),
            ("slow_masks", slow_masks), ("stall", {"type": "object", "properties": {"stall": {"type": "string"}}}))}
        results = {name: f.result(timeout=60) for name, f in outcomes.items()}
        stop.set()
        streams = [f.result(timeout=60) for f in normals]
    assert results["deep"][0] == "BadRequestError" and "recursion" in results["deep"][1]["message"]
    assert results["slow_compile"][0] == "BadRequestError" and "took over 1 s" in results["slow_compile"][1]["message"]
    assert results["slow_masks"][0] == "length"  # about 0.5 s a token, bounded by max_tokens
    assert "took over 1 s" in str(results["stall"][1])
    assert all(done >= 3 for done, _ in streams), streams
    # under half one of the slow grammar's tokens: their masks never waited for it (about 25 ms here)
    assert max(gap for _, gap in streams) < 0.25, streams
