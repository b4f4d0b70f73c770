"""`blink bench --response-format`: every request carries the constraint (never with ignore_eos), the run's
document records it, and `--gateway-pid` charges the gateway's CPU per token."""
from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
from aiohttp import web

from blink.bench.cli import load_response_format, main
from blink.bench.loadgen import ClientConfig, build_payload
from blink.bench.workloads import BenchRequest

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
REQ = BenchRequest((1, 2, 3), 8)


def test_chat_requests_carry_response_format_and_no_ignore_eos():
    body = build_payload(ClientConfig("http://x/v1", "m", endpoint="chat", response_format=FORMAT), REQ, 0.0)
    assert body["response_format"] == FORMAT and "ignore_eos" not in body and body["max_tokens"] == 8
    plain = build_payload(ClientConfig("http://x/v1", "m", endpoint="chat"), REQ, 0.0)
    assert plain["ignore_eos"] is True and "response_format" not in plain


def test_completions_requests_carry_the_structured_outputs_twin():
    body = build_payload(ClientConfig("http://x/v1", "m", response_format=FORMAT), REQ, 0.0)
    assert body["structured_outputs"] == {"json": SCHEMA} and "ignore_eos" not in body
    mode = build_payload(ClientConfig("http://x/v1", "m", response_format={"type": "json_object"}), REQ, 0.0)
    assert mode["structured_outputs"] == {"json_object": True}
    text = build_payload(ClientConfig("http://x/v1", "m", endpoint="chat", response_format={"type": "text"}), REQ, 0.0)
    assert "response_format" not in text and "structured_outputs" not in text and text["ignore_eos"] is True


def test_bad_response_formats_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="expected one of text, json_object, json_schema"):
        ClientConfig("http://x/v1", "m", response_format={"type": "object"})
    with pytest.raises(ValueError, match="needs json_schema.schema"):
        ClientConfig("http://x/v1", "m", response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_the_file_holds_a_response_format_or_a_bare_schema(tmp_path):
    path = tmp_path / "f.json"
    path.write_text(json.dumps(SCHEMA))  # "type": "object" is a schema's type, not a response_format's
    wrapped = {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}
    assert load_response_format(str(path)) == wrapped
    path.write_text(json.dumps(FORMAT))
    assert load_response_format(str(path)) == FORMAT
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read a JSON document"):
        load_response_format(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="expected a response_format object or a JSON schema"):
        load_response_format(str(path))


class _FakeServer:
    """/v1/models and a streamed /v1/chat/completions on a thread of its own (run_bench runs its own loops)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _models(self, _request: web.Request):
        return web.json_response({"data": [{"id": "m"}]})

    async def _chat(self, request: web.Request):
        body = await request.json()
        self.bodies.append(body)
        resp = web.StreamResponse()
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            piece = {"choices": [{"index": 0, "delta": {"content": "{" if i == 0 else "a"},
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(piece).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_constrained_run_records_its_format_and_the_gateway_cpu(tmp_path):
    fmt = tmp_path / "schema.json"
    fmt.write_text(json.dumps(SCHEMA))
    server = _FakeServer()
    try:
        code = main(["--url", f"http://127.0.0.1:{server.port}/v1", "--endpoint", "chat", "--workload", "batch1",
                     "--num-requests", "2", "--prompt-len", "4", "--output-len", "5", "--response-format", str(fmt),
                     "--gateway-pid", str(os.getpid()), "--out", str(tmp_path / "out"), "--no-progress",
                     "--warmup-requests", "1"])
    finally:
        server.close()
    assert code == 0
    assert len(server.bodies) == 3  # the warm-up is constrained too: the grammar is compiled before measuring
    assert all(b["response_format"]["json_schema"]["schema"] == SCHEMA and "ignore_eos" not in b for b in server.bodies)
    [summary] = [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".json")]
    doc = json.loads(summary.read_text())
    assert doc["response_format"]["json_schema"]["schema"] == SCHEMA
    gateway = doc["server"]["gateway_cpu"]
    assert gateway["available"] and gateway["pid"] == os.getpid() and gateway["generated_tokens"] == 10
    assert gateway["cpu_s"] >= 0 and gateway["cpu_s_per_token"] == gateway["cpu_s"] / 10


def test_a_format_file_of_the_wrong_shape_stops_the_run_with_the_reason(tmp_path):
    server = _FakeServer()
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"type": "json_schema", "json_schema": {"name": "x"}}))
    try:
        with pytest.raises(SystemExit, match="blink bench: response_format json_schema: needs json_schema.schema"):
            main(["--url", f"http://127.0.0.1:{server.port}/v1", "--response-format", str(path),
                  "--out", str(tmp_path / "out"), "--no-progress"])
    finally:
        server.close()
    assert server.bodies == []
