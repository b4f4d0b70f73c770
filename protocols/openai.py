"""OpenAI-compatible request and response schemas (pydantic v2), shared vocabulary of the public API.

Requests are strict about types (a string where a number belongs is an error, as OpenAI does); unknown
fields pass, ignored, except those that would change the output, which are refused by name
(`REFUSED_FIELDS`; docs/api-fields.md). `parse_request` turns a raw body into a model or an `InvalidRequest` whose
`param` names the offending field (`messages[0].content`, `max_tokens`).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .openai_base import InvalidRequest, StrictRequest as _Request, omit_none as _omit_none
from .openai_fields import (MEDIA_PARTS, REFUSED_CHAT_FIELDS, REFUSED_COMPLETION_FIELDS, REFUSED_FIELDS,
                            refusal_message)
# FunctionCall and FunctionCallDelta are re-exported: the response schemas are all importable from here.
from .openai_structured import (FunctionCall, FunctionCallDelta, MessageToolCall, NamedToolChoice,  # noqa: F401
                                ResponseFormat, StructuredOutputs, Tool, ToolCall, ToolCallDelta, check_message_tools,
                                check_response_format, check_tools, constraint_spec)

MAX_STOP_STRINGS = 4
INT32_MAX = 2**31 - 1  # top_k and token ids travel as int32 in the ring
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # chat (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions (OpenAI's limit)
MAX_PROMPTS = 2048  # prompts in one /v1/completions batch (OpenAI's limit); the ring's slots bound prompts x n
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)
# Sampling parameters the engine applies (the gateway asks whether the backend's engine mode can).
ENGINE_SAMPLING_PARAMS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM's usage in every chunk: refused (SamplingFields.check)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class MediaPart(_Request):
    type: Literal[tuple(MEDIA_PARTS)]  # type: ignore[valid-type]


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    function_call: Any = None  # the legacy form of tool_calls: refused (ChatCompletionRequest.check)

    def check_media(self, index: int) -> None:
        """Refuse a part of another medium than text, naming it: the models served here read text only."""
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if isinstance(part, MediaPart):
                raise InvalidRequest(f"'messages[{index}].content[{j}]' is an {part.type!r} part: "
                                     f"{MEDIA_PARTS[part.type]} not supported, this server takes text only",
                                     f"messages[{index}].content[{j}]")

    def text(self) -> str:
        """Content as one string: text parts joined, as text-only chat templates expect."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


PositiveInt = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)]


class SamplingFields(_Request):
    """Fields common to chat and text completions. `None` means "use the default".

    Unknown fields are kept (`model_extra`) so that `check` can refuse those of `refused_fields` that
    would change the output; the rest pass, ignored, as vLLM lets them."""

    model_config = ConfigDict(strict=True, extra="allow")
    refused_fields: ClassVar[dict[str, tuple]] = REFUSED_FIELDS

    # The output budget of a request that sets none (unless the operator set --default-max-tokens);
    # None: what the context leaves after the prompt. Capped by that room either way.
    default_max_tokens: ClassVar[int | None] = None

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None  # 0 or -1: disabled
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # the ring's 64-bit word
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names): benchmarks need ignore_eos; priority is the ring's priority class.
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    priority: Annotated[int, Field(ge=0, le=255)] = 0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # choices: n ring requests, fanned out by the gateway
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e6)] | None = None  # vLLM's: > 1 discourages repeats
    logit_bias: LogitBias | None = None  # token id (a decimal string) -> bias added to its logit
    response_format: ResponseFormat | None = None
    # Structured outputs, vLLM's names: one object, and the older top-level fields vLLM clients still send.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's: a prefix-cache namespace; requests hit each other's cached blocks only with the same salt
    # (and the same key's salt, gateway/policy/keys.py)
    cache_salt: str | None = None

    def check(self) -> None:
        check_response_format(self)
        constraint_spec(self)
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequest("'cache_salt' must be a non-empty string if provided", "cache_salt")
        if self.stream_options is not None:
            _refuse_unless("stream_options.continuous_usage_stats", self.stream_options.continuous_usage_stats,
                           (None, False))
        for name, value in (self.model_extra or {}).items():
            if name in self.refused_fields:
                _refuse_unless(name, value, self.refused_fields[name])
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise InvalidRequest(f"invalid key {key!r} in 'logit_bias': keys are token ids, "
                                     f"as decimal strings", "logit_bias")

    def constraint_spec(self) -> tuple[str, Any, str] | None:
        """The output's constraint (`openai_structured.constraint_spec`); None when the output is free."""
        return constraint_spec(self)

    @property
    def logit_bias_ids(self) -> list[tuple[int, float]]:
        """(token id, bias); "5" and "05" name the same token: their biases add up, as in the engine."""
        return [(int(k), v) for k, v in (self.logit_bias or {}).items()]

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine must report, or None for no logprobs."""
        return None

    def engine_sampling_params(self) -> list[str]:
        """The engine-side sampling parameters this request sets to something other than their defaults."""
        used = {"presence_penalty": bool(self.presence_penalty), "frequency_penalty": bool(self.frequency_penalty),
                "repetition_penalty": self.repetition_penalty not in (None, 1.0),
                "logit_bias": bool(self.logit_bias), "logprobs": self.num_logprobs is not None}
        return [name for name in ENGINE_SAMPLING_PARAMS if used[name]]

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true: several calls in one turn
    refused_fields: ClassVar[dict[str, tuple]] = REFUSED_CHAT_FIELDS

    def check(self) -> None:
        super().check()
        for i, message in enumerate(self.messages):
            message.check_media(i)
            check_message_tools(i, message)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        check_tools(self)

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (tool_choice as it applies: auto when tools came without one)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_tools(self) -> bool:
        """The output must be tool calls (required, or a named function)."""
        return self.tool_mode in ("required", "named")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    default_max_tokens: ClassVar[int | None] = COMPLETION_DEFAULT_MAX_TOKENS
    refused_fields: ClassVar[dict[str, tuple]] = REFUSED_COMPLETION_FIELDS

    # One prompt (text or token ids), or a batch of them: one choice per prompt and n, index prompt_i * n + j.
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        _refuse_unless_default(self, best_of=1, suffix="")
        for i, prompt in enumerate(self.prompts):
            if prompt == "":
                param = f"prompt[{i}]" if self.is_batch else "prompt"
                raise InvalidRequest(f"'{param}' must not be empty", param)
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("'echo' with 'logprobs' is not supported: the engine does not compute the "
                                 "prompt tokens' logprobs; send one or the other", "echo")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def is_batch(self) -> bool:
        """The prompt is a list of prompts (even of one): errors name each as prompt[i]."""
        return isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)

    @property
    def prompt_text_or_ids(self) -> str | list[int]:
        """The first prompt (the only one unless `is_batch`): a string or a list of token ids."""
        return self.prompts[0]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the model's template."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True

    def check(self) -> None:
        for i, message in enumerate(self.messages or ()):
            message.check_media(i)
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("send exactly one of 'prompt' or 'messages'",
                                 "prompt" if self.prompt is None else "messages")


class DetokenizeRequest(_Request):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


def _refuse_unless_default(req: _Request, **defaults: Any) -> None:
    for name, default in defaults.items():
        _refuse_unless(name, getattr(req, name), (None, default))


def _refuse_unless(name: str, value: Any, honoured: tuple) -> None:
    """A 400 naming `name` unless `value` is one of `honoured` (None: not sent)."""
    if (message := refusal_message(name, value, honoured)) is not None:
        raise InvalidRequest(message, name)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the engine reused from its prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_len: int, completion_len: int, cached_len: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_len, completion_tokens=completion_len,
                   total_tokens=prompt_len + completion_len,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_len))


FinishReasonStr = Literal["stop", "length", "tool_calls"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: not v)


class TopLogprob(BaseModel):
    token: str  # the token's text; a token that is part of a UTF-8 character shows its bytes as \xNN
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the `top_logprobs` most likely tokens at this position


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy shape: parallel lists, one entry per token; `text_offset` indexes the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the `logprobs` most likely tokens, and the chosen one
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonStr


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[ToolCallDelta] | None = _omit_none()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonStr | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_none()


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonStr | None = None


class Completion(BaseModel):
    """A text completion, and also the shape of each streamed text-completion chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "blink"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------- parsing

R = TypeVar("R", bound=_Request)


def parse_request(cls: type[R], body: bytes) -> R:
    """Validate a raw JSON body; raise `InvalidRequest` naming the first bad field."""
    try:
        req = cls.model_validate_json(body)
    except ValidationError as exc:
        raise _to_invalid(exc, body) from None
    req.check()
    return req


def _to_invalid(exc: ValidationError, body: bytes) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidRequest(f"request body is not valid JSON: {err['msg']}")
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return InvalidRequest("request body must be a JSON object")
    errors = [(e, _param_path(e["loc"], data, e["type"] == "missing")) for e in exc.errors(include_url=False)]
    param = errors[0][1]
    # A union field yields one error per alternative: say them all.
    if errors[0][0]["type"] == "missing":
        return InvalidRequest(f"'{param}' is a required field", param)
    if errors[0][0]["type"] == "extra_forbidden":  # an object whose keys are all known (structured_outputs)
        return InvalidRequest(f"unknown field '{param}'", param)
    msgs = dict.fromkeys(e["msg"].removeprefix("Value error, ") for e, p in errors if p == param)
    return InvalidRequest(f"invalid value for '{param}': {' or '.join(msgs)}", param)


def _param_path(loc: tuple, data: Any, missing: bool) -> str:
    """Dotted path of the locations that index the client's JSON (drops pydantic's union tags)."""
    path = ""
    for i, key in enumerate(loc):
        if isinstance(key, int) and isinstance(data, list) and 0 <= key < len(data):
            path, data = f"{path}[{key}]", data[key]
        elif isinstance(key, str) and isinstance(data, dict) and key in data:
            path, data = f"{path}.{key}" if path else key, data[key]
        elif missing and i == len(loc) - 1 and isinstance(key, str):
            path = f"{path}.{key}" if path else key
    return path or "body"
