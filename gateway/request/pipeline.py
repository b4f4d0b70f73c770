"""The one request path behind every front end (HTTP, gRPC): parse, tokenize, check limits, submit.

Front ends turn their wire format into the OpenAI request schemas of `protocols.openai`, so both
validate alike and name the same fields in their errors.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from protocols.openai import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                              DetokenizeResponse, InvalidRequest, TokenizeRequest, TokenizeResponse,
                              parse_request)
from protocols.ring import RequestSpec

from ..backends.route import Router
from ..errors import ApiError, bad_request
from ..metrics import Metrics
from ..policy.keys import Principal
from ..policy.quotas import Admission
from ..state import GatewayState
from ..streaming.poller import poll_checkpoint
from ..streaming.request_handle import RequestHandle
from ..structured.grammar import check as check_grammars
from ..structured.setup import compile_for, mask_attacher, with_first_mask
from ..structured.tools import output_constraint, template_inputs, tools_param_constraints
from .choices import Choices
from .detokenize import TextStream
from .generate import Generation
from .limits import build_spec, check_engine_modes, check_token_ids
from .prefix import PromptBlocks, effective_salt
from .tokenize import TemplateError, TokenizerService

log = logging.getLogger("blink.gateway.requests")

GenerateRequest = ChatCompletionRequest | CompletionRequest
Attach = Callable[[RequestHandle], None]


def parse(cls, body: bytes, rename: dict[str, str] | None = None):
    """A request schema from a JSON body; a 400 naming the field (after `rename` of its first part)."""
    try:
        return parse_request(cls, body)
    except InvalidRequest as exc:
        param, message = exc.param, exc.message
        if param and rename:
            head = param.split("[", 1)[0].split(".", 1)[0]
            param = rename.get(head, head) + param[len(head):]
            message = message.replace(f"'{head}", f"'{rename.get(head, head)}", 1)
        raise bad_request(message, param) from None


async def encode_messages(tokenizer: TokenizerService, messages: Sequence[ChatMessage],
                          add_generation_prompt: bool = True, add_special_tokens: bool = False,
                          req: ChatCompletionRequest | None = None) -> list[int]:
    """The prompt's tokens; `req`: the request whose tools the prompt lists (gateway/structured/tools.py)."""
    rendered, tools = template_inputs(messages, req, tokenizer.template_source)
    try:
        return await tokenizer.encode_chat(rendered, add_generation_prompt, add_special_tokens, tools)
    except TemplateError as exc:
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None


async def start_generation(state: GatewayState, req: GenerateRequest, prompt_param: str | None = None,
                           arrival_s: float | None = None, principal: Principal | None = None) -> Choices:
    """Check the key's limits, tokenize, check the context, submit the request's choices (n per prompt:
    a /v1/completions batch has several) to the backends routing picks (each to another if it fails before
    the first token). The caller must `close()` the result. Raises ApiError (429 over a key's limits)."""
    arrival_s = time.perf_counter() if arrival_s is None else arrival_s
    await state.pacer.turn()
    poll_checkpoint()  # the set-up's turn came in a new pass, after the poller's round, or not
    admission = state.quotas.admit(principal)
    try:
        gens, prompt_len = await _start(state, req, prompt_param, arrival_s, admission, principal)
    except BaseException:
        admission.close()
        raise
    for gen in gens:
        gen.budget_tokens = principal.limits.max_tokens_per_request if principal else None
    return Choices(gens, state.tokenizers[req.model], on_close=admission.close, prompt_len=prompt_len, n=req.n)


async def _prompts_ids(tokenizer: TokenizerService, req: GenerateRequest, vocab_size: int,
                       prompt_param: str) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and the parameter its errors name (prompt[i] in a batch)."""
    if isinstance(req, ChatCompletionRequest):
        return [(await encode_messages(tokenizer, req.messages, req=req), prompt_param)]
    out = []
    for i, prompt in enumerate(req.prompts):
        param = f"{prompt_param}[{i}]" if req.is_batch else prompt_param
        if isinstance(prompt, str):
            out.append((await tokenizer.encode_prompt(prompt), param))
        else:
            out.append((check_token_ids(prompt, vocab_size, param), param))
    return out


async def _start(state: GatewayState, req: GenerateRequest, prompt_param: str | None, arrival_s: float,
                 admission: Admission, principal: Principal | None = None) -> tuple[list[Generation], int]:
    """The generations in choice-index order (prompt_i * n + j) and the prompts' tokens, each counted once."""
    backends = state.router.backends_for(req.model)
    info = backends[0].info  # backends of one model share its limits
    tokenizer = state.tokenizers[req.model]
    prompt_param = prompt_param or ("messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if isinstance(req, ChatCompletionRequest) and req.tool_mode != "none":
        await check_grammars(tools_param_constraints(req))  # a bad parameters schema is a 400 in auto mode too
    prompts = await _prompts_ids(tokenizer, req, info.vocab_size, prompt_param)
    poll_checkpoint()
    specs = [build_spec(next(state.request_ids), req, ids, info, param, state.config.default_max_tokens)
             for ids, param in prompts]
    if len(specs) > 1 and len(specs) * req.n > info.geometry.num_slots:  # unread choices would wait on each other
        raise bad_request(f"{len(specs)} prompts x n={req.n} are {len(specs) * req.n} choices, over this "
                          f"backend's {info.geometry.num_slots} request slots", prompt_param)
    check_engine_modes(req, [b.info for b in backends])
    attach = None
    constraint = output_constraint(req, tokenizer)
    if constraint is not None:
        grammars, compiled = await compile_for(tokenizer, backends, constraint)
        specs = [with_first_mask(spec, compiled) for spec in specs]
        attach = mask_attacher(grammars, compiled)
    prompt_len = sum(len(spec.prompt_ids) for spec in specs)
    admission.charge(prompt_len)
    salt = effective_salt(principal.cache_salt if principal else "", req.cache_salt)
    return await _submit_choices(state, req, specs, arrival_s, salt, attach), prompt_len


async def _submit_choices(state: GatewayState, req: GenerateRequest, specs: list[RequestSpec],
                          arrival_s: float, salt: str = "", attach: Attach | None = None) -> list[Generation]:
    """n generations per spec (seeds seed, seed+1, ... when it has one), in that order; none left if one fails.
    `salt`: the prefix cache's namespace for these prompts (`prefix.effective_salt`)."""
    tokenizer = state.tokenizers[req.model]
    gens: list[Generation] = []
    try:
        for spec in specs:
            blocks = PromptBlocks(spec.prompt_ids, salt)  # hashed once per backend model, for all n choices
            for i in range(req.n):
                choice = spec if spec.seed is None or i == 0 else dataclasses.replace(spec, seed=spec.seed + i)
                failover = Failover(state.router, req.model, choice, state.metrics, blocks, attach)
                handle = await failover.submit()
                stream = TextStream(tokenizer.tokenizer, req.stop_strings, spec.prompt_ids, tokenizer.single_texts,
                                    tokenizer.token_pieces)
                gens.append(Generation(handle, stream, len(spec.prompt_ids), req.model, state.metrics, arrival_s,
                                       failover=failover))
                poll_checkpoint()
    except BaseException:
        for gen in gens:  # nothing leaks: the choices already submitted are cancelled
            gen.close()
        raise
    return gens


class Failover:
    """Submits one request where routing says; again elsewhere (each backend once) if it fails there
    before its first token."""

    def __init__(self, router: Router, model: str, spec: RequestSpec, metrics: Metrics | None = None,
                 blocks: PromptBlocks | None = None, attach: Attach | None = None):
        self.router = router
        self.attach = attach  # what each handle gets before the poller sees it (a constrained request's mask loop)
        self.model = model
        self.spec = spec
        self.metrics = metrics  # counts each resubmission (blink:request_retries_total)
        self.blocks = blocks  # the prompt's prefix-cache hashes, per backend
        self.tried: list[str] = []  # backend addresses

    async def submit(self, retry_reason: str | None = None) -> RequestHandle:
        """A handle on a backend not tried yet; the last refusal (or routing's 503) when none takes it.
        `retry_reason`: why an earlier backend failed this request (None for its first submission)."""
        refused: ApiError | None = None
        while True:
            try:
                backend = self.router.pick(self.model, self.spec.prompt_ids, exclude=self.tried, blocks=self.blocks)
            except ApiError:
                if refused is not None:
                    raise refused from None
                raise
            self.tried.append(backend.info.addr)
            if retry_reason is not None and self.metrics is not None:
                self.metrics.retried(self.model, retry_reason)
            try:
                spec = self.spec if self.blocks is None else self.blocks.spec_for(self.spec, backend.info)
                handle = await backend.submit(spec)
            except ApiError as err:
                if err.status != 503:
                    raise
                refused, retry_reason = err, "submit_refused"
                continue
            if self.attach is not None:  # no await since the submission: the poller has not polled it yet
                self.attach(handle)
            return handle

    def cached(self, handle: RequestHandle, cached_tokens: int) -> None:
        """The engine reused `cached_tokens` of the prompt where `handle` ran: routing checks its guess."""
        if self.blocks is not None:
            self.router.cached(handle.backend, self.blocks, cached_tokens)

    async def __call__(self, failed: RequestHandle, reason: str) -> RequestHandle | None:
        try:
            handle = await self.submit("failed_before_first_token")
        except ApiError:
            return None
        log.warning("request %d: backend %s failed before the first token (%s); retrying on %s",
                    self.spec.request_id, failed.backend.info.addr, reason, handle.backend.info.addr,
                    extra={"request_id": self.spec.request_id})
        return handle


async def tokenize(state: GatewayState, req: TokenizeRequest) -> TokenizeResponse:
    info = state.router.backends_for(req.model)[0].info
    tokenizer = state.tokenizers[req.model]
    if req.messages is not None:
        ids = await encode_messages(tokenizer, req.messages, req.add_generation_prompt,
                                    bool(req.add_special_tokens))
    else:
        ids = await tokenizer.encode_prompt(req.prompt, req.add_special_tokens is not False)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=info.context_len)


async def detokenize(state: GatewayState, req: DetokenizeRequest) -> DetokenizeResponse:
    info = state.router.backends_for(req.model)[0].info
    ids = check_token_ids(req.tokens, info.vocab_size, "tokens")
    return DetokenizeResponse(prompt=await state.tokenizers[req.model].decode(ids))
