"""Request limits against what the backend can hold, and the RequestSpec that goes into the ring."""

from __future__ import annotations

from collections.abc import Sequence

from protocols.messages import BackendInfo
from protocols.openai import SamplingFields
from protocols.ring import RequestSpec

from ..errors import bad_request

CONTEXT_CODE = "context_length_exceeded"


def check_engine_modes(req: SamplingFields, infos: Sequence[BackendInfo]) -> None:
    """A 400 naming the first engine-side parameter (penalties, logit_bias, logprobs) when some backend of the
    model runs without the sampling extensions (a persistent backend started with --no-sampling-extensions;
    its loop would refuse the request with INVALID_PARAMS)."""
    params = req.engine_sampling_params()
    modes = sorted({info.engine_mode for info in infos if not info.sampling_extensions})
    if params and modes:
        raise bad_request(f"'{params[0]}' is not available: this model's '{modes[0]}' backends run without the "
                          f"sampling extensions (penalties, logit_bias, logprobs; they were started with "
                          f"--no-sampling-extensions)", params[0])


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> list[int]:
    """Token ids from a client must name tokens the model has."""
    if vocab_size and (bad := [t for t in token_ids if t >= vocab_size]):
        raise bad_request(f"{param} token id {bad[0]} is outside the vocabulary (size {vocab_size})", param)
    return list(token_ids)


def max_tokens_for(prompt_len: int, requested: int | None, info: BackendInfo, prompt_param: str,
                   max_param: str, default: int | None = None) -> int:
    """The output budget: as requested if prompt + output fits the context, else a 400 naming the limit."""
    context_len = info.context_len
    prompt_limit = min(context_len - 1, info.geometry.max_prompt_len)
    if prompt_len > prompt_limit:
        which = f"{prompt_param}: " if "[" in prompt_param else ""  # one prompt of a batch: which one
        raise bad_request(f"{which}the prompt is {prompt_len} tokens, over this model's limit of {prompt_limit} "
                          f"(context length {context_len}, at least one token is generated)",
                          prompt_param, CONTEXT_CODE)
    room = context_len - prompt_len
    if requested is None:
        return min(room, default) if default else room
    if requested > room:
        raise bad_request(f"{max_param}={requested} plus the prompt's {prompt_len} tokens exceeds this "
                          f"model's context length of {context_len}; at most {room} fit", max_param,
                          CONTEXT_CODE)
    return requested


def build_spec(request_id: int, req: SamplingFields, prompt_ids: list[int], info: BackendInfo,
               prompt_param: str, default_max_tokens: int | None = None) -> RequestSpec:
    if not prompt_ids:
        raise bad_request("the prompt is empty after tokenization", prompt_param)
    max_param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    # the operator's --default-max-tokens first, then the API's own (16 for completions and gRPC)
    max_tokens = max_tokens_for(len(prompt_ids), req.requested_max_tokens, info, prompt_param, max_param,
                                default_max_tokens or req.default_max_tokens)
    stop_ids = tuple(check_token_ids(req.stop_token_ids or (), info.vocab_size, "stop_token_ids"))
    if len(stop_ids) > info.geometry.max_stop_ids:
        raise bad_request(f"stop_token_ids holds {len(stop_ids)} ids, at most {info.geometry.max_stop_ids}",
                          "stop_token_ids")
    if req.n > info.geometry.num_slots:  # its choices, unread until all are submitted, would wait on each other
        raise bad_request(f"n={req.n} is over this backend's {info.geometry.num_slots} request slots", "n")
    logit_bias = req.logit_bias_ids
    check_token_ids([t for t, _ in logit_bias], info.vocab_size, "logit_bias")
    if len(logit_bias) > info.geometry.max_logit_bias:
        raise bad_request(f"logit_bias holds {len(logit_bias)} entries, this backend takes at most "
                          f"{info.geometry.max_logit_bias}", "logit_bias")
    num_logprobs = req.num_logprobs
    if num_logprobs is not None and num_logprobs > info.geometry.max_logprobs:
        param = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
        raise bad_request(f"{param}={num_logprobs} is over this backend's limit of {info.geometry.max_logprobs} "
                          f"(its ring's max_logprobs)", param)
    return RequestSpec(
        request_id=request_id, prompt_ids=prompt_ids, max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),  # -1 (vLLM) and 0 both mean off
        min_p=req.min_p or 0.0, seed=req.seed, stop_ids=stop_ids, ignore_eos=req.ignore_eos,
        priority=req.priority, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple(logit_bias), num_logprobs=num_logprobs)
