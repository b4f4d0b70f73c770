"""OpenAI-compatible HTTP routes: /v1/chat/completions, /v1/completions, /v1/models[/{id}], /v1/tokenize,
/v1/detokenize; /health and /metrics for operators (no API key; /metrics may ask for `metrics_key`, and may
live on the admin listener instead: `gateway/server.py`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from protocols.openai import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                              ModelList, TokenizeRequest)

from ..policy.auth import PRINCIPAL
from ..request.choices import Choices
from ..request.pipeline import detokenize, parse, start_generation, tokenize
from ..state import GatewayState
from ..streaming.poller import poll_checkpoint
from .formats import ChatFormat, CompletionFormat, OutputFormat
from .sse import SSE_HEADERS, SseBody

REQUEST_ID_HEADER = "X-Request-Id"  # the gateway's request number, as in its logs and the ring

STATE = web.AppKey("state", GatewayState)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)  # ids may hold '/' (org/name)
    app.router.add_post("/v1/tokenize", tokenize_route)
    app.router.add_post("/v1/detokenize", detokenize_route)
    app.router.add_get("/health", health)


def add_metrics_route(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics)


# ---------------------------------------------------------------- handlers


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival_s = time.perf_counter()
    req = parse(ChatCompletionRequest, await request.read())

    async def make_format(choices: Choices) -> ChatFormat:
        texts = choices.tokenizer.token_texts if req.num_logprobs is not None else None
        return ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", req.model, texts)
    return await _generate(request, req, make_format, arrival_s)


async def completions(request: web.Request) -> web.StreamResponse:
    arrival_s = time.perf_counter()
    req = parse(CompletionRequest, await request.read())

    async def make_format(choices: Choices) -> CompletionFormat:
        texts = choices.tokenizer.token_texts if req.num_logprobs is not None else None
        echoes = [p if isinstance(p, str) else await choices.tokenizer.decode(p) for p in req.prompts] \
            if req.echo else [""]
        # choice i * n + j is prompt i's
        echo = echoes[0] if len(echoes) == 1 else [e for e in echoes for _ in range(req.n)]
        return CompletionFormat(f"cmpl-{uuid.uuid4().hex}", req.model, texts, echo)
    return await _generate(request, req, make_format, arrival_s)


async def tokenize_route(request: web.Request) -> web.Response:
    req = parse(TokenizeRequest, await request.read())
    return _json((await tokenize(request.app[STATE], req)).model_dump_json())


async def detokenize_route(request: web.Request) -> web.Response:
    req = parse(DetokenizeRequest, await request.read())
    return _json((await detokenize(request.app[STATE], req)).model_dump_json())


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [_model_card(state, name) for name in state.router.model_names]
    return _json(ModelList(data=cards).model_dump_json())


async def model(request: web.Request) -> web.Response:
    """One model's card (`client.models.retrieve`); OpenAI's 404 model_not_found for an id served nowhere."""
    return _json(_model_card(request.app[STATE], request.match_info["model_id"]).model_dump_json())


def _model_card(state: GatewayState, name: str) -> ModelCard:
    return ModelCard(id=name, created=state.started, max_model_len=state.router.backends_for(name)[0].info.context_len)


async def health(request: web.Request) -> web.Response:
    """200 while some backend makes progress; per-backend heartbeat and load for operators."""
    backends = request.app[STATE].router.backends
    report = [{"addr": b.info.addr, "model": b.info.model_name, "heartbeat": b.heartbeat,
               "stalled": b.stalled, "ejected": b.ejected, "draining": b.draining,
               "in_flight": b.num_in_flight, "free_slots": b.free_slots,
               "outstanding_tokens": b.outstanding_tokens, "requests": b.num_requests,
               "link_error": getattr(b, "link_error", None)}  # e.g. its tcp agent refused our certificate
              for b in backends]
    ok = any(b.healthy and not b.draining for b in backends)
    return web.json_response({"status": "ok" if ok else "stalled", "backends": report},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition; scrapers need no API key (only `metrics_key`, when one is set)."""
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


# ---------------------------------------------------------------- shared path


async def _generate(request: web.Request, req, make_format: Callable[[Choices], Awaitable[OutputFormat]],
                    arrival_s: float) -> web.StreamResponse:
    choices = await start_generation(request.app[STATE], req, arrival_s=arrival_s, principal=request.get(PRINCIPAL))
    try:
        fmt = await make_format(choices)
        poll_checkpoint()
        if req.stream:
            return await _stream(request, choices, fmt, req.include_usage)
        outputs = await choices.collect()
        body = fmt.full(outputs, choices.prompt_len, choices.completion_tokens)
        return _json(body.model_dump_json(), headers={REQUEST_ID_HEADER: str(choices.request_id)})
    finally:
        choices.close()


async def _stream(request: web.Request, choices: Choices, fmt: OutputFormat, include_usage: bool):
    first = await choices.next_piece()  # a failure before the first token still gets its status code
    poll_checkpoint()
    resp = web.StreamResponse(headers={**SSE_HEADERS, REQUEST_ID_HEADER: str(choices.request_id)})
    writer = await resp.prepare(request)
    await SseBody(resp, writer, choices, fmt, request.app[STATE].metrics).run(first, include_usage)
    return resp


def _json(text: str, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=text, status=status, content_type="application/json", headers=headers)
