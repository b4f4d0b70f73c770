"""OpenAI-compatible HTTP routes: /v1/chat/completions, /v1/completions, /v1/models, /health."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from protocols.openai import (ChatCompletionRequest, CompletionRequest, InvalidRequest, ModelCard,
                              ModelList, parse_request)

from .config import GatewayConfig
from .errors import ApiError, bad_request
from .formats import ChatFormat, CompletionFormat, OutputFormat
from .generate import Generation, Piece
from .limits import build_spec, check_prompt_ids
from .route import Router
from .tokenize import TemplateError, TokenizerService
from .detokenize import TextStream

log = logging.getLogger("blink.gateway.http")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class GatewayState:
    config: GatewayConfig
    router: Router
    tokenizers: dict[str, TokenizerService]  # by model name
    request_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    started: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("state", GatewayState)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)


# ---------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = _parse(ChatCompletionRequest, await request.read())
    backend = state.router.pick(req.model)
    tokenizer = state.tokenizers[req.model]
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]
    try:
        prompt_ids = await tokenizer.encode_chat(messages)
    except TemplateError as exc:
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", req.model)
    return await _generate(request, state, backend, req, prompt_ids, "messages", fmt)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = _parse(CompletionRequest, await request.read())
    backend = state.router.pick(req.model)
    prompt = req.prompt_text_or_ids
    if isinstance(prompt, str):
        prompt_ids = await state.tokenizers[req.model].encode_prompt(prompt)
    else:
        prompt_ids = check_prompt_ids(prompt, backend.info.vocab_size)
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", req.model)
    return await _generate(request, state, backend, req, prompt_ids, "prompt", fmt)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [ModelCard(id=name, created=state.started,
                       max_model_len=state.router.backends_for(name)[0].info.context_len)
             for name in state.router.model_names]
    return _json(ModelList(data=cards).model_dump_json())


async def health(request: web.Request) -> web.Response:
    """200 while some backend makes progress; per-backend heartbeat and load for operators."""
    backends = request.app[STATE].router.backends
    report = [{"addr": b.info.addr, "model": b.info.model_name, "heartbeat": b.heartbeat,
               "stalled": b.stalled, "in_flight": b.num_in_flight, "free_slots": b.free_slots}
              for b in backends]
    ok = any(not b.stalled for b in backends)
    return web.json_response({"status": "ok" if ok else "stalled", "backends": report},
                             status=200 if ok else 503)


# ---------------------------------------------------------------- shared path


def _parse(cls, body: bytes):
    try:
        return parse_request(cls, body)
    except InvalidRequest as exc:
        raise bad_request(exc.message, exc.param) from None


async def _generate(request, state: GatewayState, backend, req, prompt_ids: list[int], prompt_param: str,
                    fmt: OutputFormat) -> web.StreamResponse:
    spec = build_spec(next(state.request_ids), req, prompt_ids, backend.info, prompt_param,
                      state.config.default_max_tokens)
    tokenizer = state.tokenizers[req.model]
    handle = await backend.submit(spec)
    gen = Generation(handle, TextStream(tokenizer.tokenizer, req.stop_strings, prompt_ids), len(prompt_ids))
    try:
        if req.stream:
            return await _stream(request, gen, fmt, req.include_usage)
        return await _collect(gen, fmt)
    finally:
        gen.close()


async def _collect(gen: Generation, fmt: OutputFormat) -> web.Response:
    parts = []
    while True:
        piece = await gen.next_piece()
        parts.append(piece.text)
        if piece.finish_reason:
            break
    body = fmt.full("".join(parts), piece.finish_reason, gen.prompt_len, gen.completion_tokens)
    return _json(body.model_dump_json())


async def _stream(request: web.Request, gen: Generation, fmt: OutputFormat, include_usage: bool):
    first = await gen.next_piece()  # a failure before the first token still gets its status code
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        await _stream_pieces(resp, gen, first, fmt, include_usage)
    except ConnectionResetError:
        log.info("client went away during request %d: cancelling it", gen.handle.spec.request_id)
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _stream_pieces(resp: web.StreamResponse, gen: Generation, piece: Piece, fmt: OutputFormat,
                         include_usage: bool) -> None:
    try:
        while True:
            if piece.text:
                await _send(resp, fmt.chunk(text=piece.text))
            if piece.finish_reason:
                await _send(resp, fmt.chunk(finish_reason=piece.finish_reason))
                break
            piece = await gen.next_piece()
    except ApiError as err:  # headers are gone: the error travels as an event
        log.warning("request %d failed mid-stream: %s", gen.handle.spec.request_id, err)
        await _send(resp, err.body())
        return
    if include_usage:
        await _send(resp, fmt.usage_chunk(gen.prompt_len, gen.completion_tokens))


async def _send(resp: web.StreamResponse, chunk) -> None:
    await resp.write(b"data: " + chunk.model_dump_json().encode() + b"\n\n")


def _json(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="application/json")
