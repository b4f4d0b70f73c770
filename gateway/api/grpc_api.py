"""The public gRPC API (`protocols/inference.proto`) on the gateway's event loop, with the standard
`grpc.health.v1` service and server reflection.

Only the wire format is gRPC: requests become the OpenAI schemas of `protocols.openai` and take the
HTTP path (`gateway/request/pipeline.py`): the same keys, validation, limits, engine-mode refusals, tokenizers
and generations (n choices fanned out there; each message names its choice).
Errors are the same `ApiError`s, sent as a gRPC status (the OpenAI `param` and `code` go in trailing
metadata). A client that cancels its call cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, ClassVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from pydantic import Field

from protocols import inference_pb2, inference_pb2_grpc
from protocols.openai import (COMPLETION_DEFAULT_MAX_TOKENS, MAX_TOP_LOGPROBS, ChatCompletionRequest,
                              CompletionRequest, TokenizeRequest)
from protocols.ring import TokenLogprob

from ..errors import ApiError, bad_request, server_error
from ..policy.auth import client_principal
from ..policy.keys import Principal
from ..request.choices import Choices
from ..request.pipeline import parse, start_generation, tokenize
from ..request.token_text import TokenTexts
from ..state import GatewayState
from .formats import clamp_logprob

log = logging.getLogger("blink.gateway.grpc")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
REQUEST_ID_KEY = "x-request-id"  # initial metadata of Generate
_STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                 413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 503: grpc.StatusCode.UNAVAILABLE}
_CODE_STATUSES = {"no_kv_capacity": grpc.StatusCode.RESOURCE_EXHAUSTED}
# Generate without max_tokens, whatever its input: /v1/completions' default (a call nobody bounds must not
# run to the end of the context). protocols/inference.proto documents it.
GRPC_DEFAULT_MAX_TOKENS = COMPLETION_DEFAULT_MAX_TOKENS
_SAMPLING_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "cache_salt")
# Chat carries gRPC's `logprobs` count as top_logprobs: errors name the field as sent here.
_CHAT_RENAMES = {"top_logprobs": "logprobs"}


def status_code(err: ApiError) -> grpc.StatusCode:
    return _CODE_STATUSES.get(err.detail.code or "", _STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL))


def error_metadata(err: ApiError) -> tuple[tuple[str, str], ...]:
    pairs = (("error-type", err.detail.type), ("error-param", err.detail.param), ("error-code", err.detail.code),
             *((k.lower(), v) for k, v in err.headers.items()))  # retry-after on a 429
    return tuple((k, v) for k, v in pairs if v)


# ---------------------------------------------------------------- messages -> OpenAI schemas


class _CompletionRequest(CompletionRequest):
    """/v1/completions takes 0..5 alternatives (OpenAI's limit); gRPC takes chat's 0..20 for every input."""

    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class _ChatRequest(ChatCompletionRequest):
    """Chat messages over gRPC: a bounded default output as for every gRPC input (HTTP chat's is the context)."""

    default_max_tokens: ClassVar[int | None] = GRPC_DEFAULT_MAX_TOKENS


def _messages(chat: inference_pb2.ChatMessages) -> list[dict]:
    return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})} for m in chat.messages]


def generate_request(request: inference_pb2.GenerateRequest) -> tuple[ChatCompletionRequest | CompletionRequest, str]:
    """The validated OpenAI request and the name of its prompt field. Raises a 400 ApiError."""
    body: dict = {"model": request.model, "ignore_eos": request.ignore_eos, "priority": request.priority}
    body.update({name: getattr(request, name) for name in _SAMPLING_OPTIONAL if request.HasField(name)})
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in request.logit_bias.items()}
    if request.HasField("structured_outputs"):
        body["structured_outputs"] = _structured_outputs(request.structured_outputs)
    which = request.WhichOneof("input")
    if which == "messages":
        if request.HasField("logprobs"):
            body.update(logprobs=True, top_logprobs=request.logprobs)
        body["messages"] = _messages(request.messages)
        return parse(_ChatRequest, _json(body), _CHAT_RENAMES), "messages"
    if request.HasField("logprobs"):
        body["logprobs"] = request.logprobs
    if which == "prompt":
        return parse(_CompletionRequest, _json({**body, "prompt": request.prompt})), "prompt"
    if which == "prompt_token_ids":
        body["prompt"] = ids = list(request.prompt_token_ids.ids)
        if any(t < 0 for t in ids):  # the JSON schema's message would list every shape `prompt` may take
            raise bad_request(f"'{which}' holds a negative token id ({min(ids)})", which)
        return parse(_CompletionRequest, _json(body), {"prompt": which}), which
    raise bad_request("set one of 'prompt', 'messages' or 'prompt_token_ids'", "prompt")


def _structured_outputs(message: inference_pb2.StructuredOutputs) -> dict:
    """The message as HTTP's `structured_outputs` object (a 400 names a field of it, as sent here)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise bad_request("'structured_outputs' sets no constraint: set one of json, regex, choice, grammar or "
                          "json_object", "structured_outputs")
    if kind == "choice":
        return {"choice": list(message.choice.choices)}
    return {kind: getattr(message, kind)}


def tokenize_request(request: inference_pb2.TokenizeRequest) -> TokenizeRequest:
    body: dict = {"model": request.model}
    which = request.WhichOneof("input")
    if which == "messages":
        body["messages"] = _messages(request.messages)
    elif which == "prompt":
        body["prompt"] = request.prompt
    for name in ("add_special_tokens", "add_generation_prompt"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    return parse(TokenizeRequest, _json(body))


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


# ---------------------------------------------------------------- the service


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, state: GatewayState):
        self.state = state

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        await self._guard(context, lambda principal: self._generate(request, context, principal))

    async def Tokenize(self, request, context: grpc.aio.ServicerContext) -> inference_pb2.TokenizeResponse:
        return await self._guard(context, lambda principal: self._tokenize(request))

    async def _guard(self, context: grpc.aio.ServicerContext, work: Callable[[Principal | None], Awaitable]):
        """Check the key, run `work`, and turn an ApiError (or a bug) into a gRPC status."""
        try:
            header = dict(context.invocation_metadata() or ()).get("authorization")
            return await work(client_principal(header, self.state.keys))
        except ApiError as err:
            self.state.metrics.rejected(err)
            await context.abort(status_code(err), err.detail.message, error_metadata(err))
        except Exception:
            log.exception("unhandled error in a gRPC call")
            err = server_error("the gateway failed to handle this request; see its log")
            self.state.metrics.rejected(err)
            await context.abort(grpc.StatusCode.INTERNAL, err.detail.message, error_metadata(err))

    async def _generate(self, request, context: grpc.aio.ServicerContext, principal: Principal | None) -> None:
        arrival_s = time.perf_counter()
        req, prompt_param = generate_request(request)
        try:
            gen = await start_generation(self.state, req, prompt_param, arrival_s, principal)
        except ApiError as err:
            raise _renamed(err, _CHAT_RENAMES) from None
        texts = gen.tokenizer.token_texts if req.num_logprobs is not None else None
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, str(gen.request_id)),))
            await _stream(gen, context, texts)
        except asyncio.CancelledError:
            log.info("client cancelled request %d", gen.request_id, extra={"request_id": gen.request_id})
            raise
        finally:
            gen.close()

    async def _tokenize(self, request) -> inference_pb2.TokenizeResponse:
        resp = await tokenize(self.state, tokenize_request(request))
        return inference_pb2.TokenizeResponse(tokens=resp.tokens, count=resp.count, max_model_len=resp.max_model_len)


def _renamed(err: ApiError, renames: dict[str, str]) -> ApiError:
    """The error naming the gRPC field its OpenAI field came from."""
    param = err.detail.param
    if param in renames:
        err.detail.message = err.detail.message.replace(param, renames[param])
        err.detail.param = renames[param]
    return err


async def _stream(gen: Choices, context: grpc.aio.ServicerContext, texts: TokenTexts | None) -> None:
    """Every choice's pieces as they come; usage on the last message (the last choice's finish)."""
    while (item := await gen.next_piece()) is not None:
        index, piece = item
        reply = inference_pb2.GenerateResponse(text=piece.text, token_ids=piece.token_ids, request_id=gen.request_id,
                                               choice_index=index, finish_reason=piece.finish_reason or "")
        if texts is not None:
            reply.logprobs.extend(_logprobs(texts, token_id, entry)
                                  for token_id, entry in zip(piece.token_ids, piece.logprobs))
        if gen.finished:
            reply.usage.prompt_tokens, reply.usage.completion_tokens = gen.prompt_len, gen.completion_tokens
            reply.usage.total_tokens = gen.prompt_len + gen.completion_tokens
        await context.write(reply)


def _logprobs(texts: TokenTexts, token_id: int, entry: TokenLogprob) -> inference_pb2.TokenLogprobs:
    return inference_pb2.TokenLogprobs(chosen=_logprob(texts, token_id, entry.logprob),
                                       top=[_logprob(texts, t, lp) for t, lp in entry.top])


def _logprob(texts: TokenTexts, token_id: int, logprob: float) -> inference_pb2.Logprob:
    return inference_pb2.Logprob(token_id=token_id, logprob=clamp_logprob(logprob),
                                 token_bytes=texts.bytes(token_id), token=texts.text(token_id))


# ---------------------------------------------------------------- the server

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _reflection_v1_handler(names: tuple[str, ...]) -> grpc.GenericRpcHandler:
    """Server reflection v1 (what grpcurl and current clients ask first) beside v1alpha.

    grpcio-reflection ships v1alpha only. v1 is the same protocol under another package (every message and
    field number alike), so v1alpha's servicer answers it; its descriptor, the v1alpha file renamed, goes
    into the default pool so that reflection can describe the v1 service too."""
    _add_reflection_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer(names)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": info})


def _add_reflection_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    old, new = reflection_pb2.DESCRIPTOR.package, REFLECTION_V1.rsplit(".", 1)[0]
    name = reflection_pb2.DESCRIPTOR.name.replace("v1alpha", "v1")
    try:
        pool.FindFileByName(name)
        return  # another gateway in this process added it
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    proto.name, proto.package = name, new
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:  # set only where it is: setting "" marks it present
                f.type_name = f.type_name.replace(f".{old}.", f".{new}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
        method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    pool.AddSerializedFile(proto.SerializeToString())


class GrpcServer:
    """The inference service, grpc.health.v1 (SERVING while some backend makes progress) and reflection."""

    def __init__(self, state: GatewayState):
        self.state = state
        # so_reuseport only for `--workers N`: otherwise a second gateway on the port must fail, not share it.
        options = [("grpc.so_reuseport", int(state.config.workers > 1)),
                   ("grpc.max_receive_message_length", state.config.max_body_bytes)]
        self.server = grpc.aio.server(options=options)
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(state), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        names = (SERVICE_NAME, health_name, reflection.SERVICE_NAME, REFLECTION_V1)
        reflection.enable_server_reflection(names, self.server)
        self.server.add_generic_rpc_handlers((_reflection_v1_handler(names),))
        self.port = 0
        self._watcher: asyncio.Task | None = None

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> None:
        """Listen on host:port, over TLS with `credentials` (`gateway/tls.py`), else in plaintext."""
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(addr)
            else:
                self.port = self.server.add_secure_port(addr, credentials)
        except RuntimeError:  # grpc's "Failed to bind"
            raise OSError(f"cannot listen for gRPC on {addr}: the port is taken or the address is not this "
                          f"host's; choose another with --grpc-port or BLINK_GRPC_PORT (0 turns the gRPC API "
                          f"off)") from None
        await self.server.start()
        await self._update_health()
        self._watcher = asyncio.create_task(self._watch_backends(), name="grpc health")
        log.info("gRPC inference API listening on %s:%d%s", host, self.port, " (TLS)" if credentials else "")

    async def close(self, grace_s: float) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def _update_health(self) -> None:
        ok = any(not b.stalled for b in self.state.router.backends)
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch_backends(self) -> None:
        while True:
            await asyncio.sleep(self.state.config.heartbeat_check_s)
            await self._update_health()
