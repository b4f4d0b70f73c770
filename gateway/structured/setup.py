"""A constrained request's set-up on the request path: its constraint from the API fields, a check that every
backend of the model takes masks, the grammar compiled (or found in the cache), the first mask into the
RequestSpec, and a mask loop attached to each submitted handle (watched from the ring where the transport allows:
shm)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from protocols.messages import BackendInfo
from protocols.ring import RequestSpec

from ..errors import bad_request
from ..streaming.request_handle import RequestHandle
from .constraint import Constraint
from .grammar import Compiled, Grammars
from .mask_loop import MaskLoop
from .mask_watch import TokenSource, mask_watch

NO_MASKS = ("this backend does not support structured output (no token-mask area in its ring, or its transport "
            "does not carry masks)")


def constraint_of(kind: str, value: Any, param: str) -> Constraint:
    """An API constraint (`SamplingFields.constraint_spec`) as a Constraint; a 400 for a schema string that
    is not JSON."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"'{param}' is not valid JSON: {exc}", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"'{param}' must be a JSON schema (an object)", param)
        return Constraint.json_schema(value, param)
    if kind == "choice":
        return Constraint("choice", json.dumps(value), param)
    return Constraint(kind, value, param)


def mask_words_of(backends: Sequence, param: str) -> int:
    """The ring's mask words, the same on every backend of the model; a 400 naming `param` when one cannot take
    masks (no mask area in its ring, or a transport that does not carry them)."""
    words = {b.info.geometry.mask_words for b in backends}
    if not all(b.takes_masks for b in backends) or len(words) != 1:
        raise bad_request(f"'{param}': {NO_MASKS}", param)
    return words.pop()


def grammars_for(tokenizer, info: BackendInfo, num_words: int) -> Grammars:
    """The model's `Grammars`, kept on its TokenizerService (one per model)."""
    grammars = getattr(tokenizer, "grammars", None)
    if grammars is None:
        grammars = tokenizer.grammars = Grammars(tokenizer.tokenizer, info.vocab_size, info.eos_token_ids, num_words)
    return grammars


async def compile_for(tokenizer, backends: Sequence, constraint: Constraint) -> tuple[Grammars, Compiled]:
    """The constraint compiled for this model, whose `backends` must all take masks (400s name its field)."""
    num_words = mask_words_of(backends, constraint.param)
    grammars = grammars_for(tokenizer, backends[0].info, num_words)
    return grammars, await grammars.compile(constraint)


def with_first_mask(spec: RequestSpec, compiled: Compiled) -> RequestSpec:
    """The spec with the mask of generated token 0 (RequestSpec.token_mask, the engine's side)."""
    if "token_mask" not in {f.name for f in dataclasses.fields(RequestSpec)}:
        raise bad_request(NO_MASKS)
    return dataclasses.replace(spec, token_mask=compiled.first_mask)


def mask_attacher(grammars: Grammars, compiled: Compiled) -> Callable[[RequestHandle], None]:
    """What gives each submitted handle (a failover's too) its own mask loop."""
    def attach(handle: RequestHandle) -> None:
        backend = handle.backend
        loop = handle.mask_loop = MaskLoop(grammars, compiled,
                                           lambda index, words: backend.put_mask(handle, index, words),
                                           lambda message: backend.fail_request(handle, message),
                                           put_from_pool=backend.masks_from_any_thread)
        reads = backend.token_reads(handle) if backend.masks_from_any_thread else None
        if reads is not None:  # its tokens reach the grammar without waiting for the event loop (mask_watch.py)
            mask_watch().watch(loop, TokenSource(*reads))
    return attach
