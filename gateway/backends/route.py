"""Which backend serves a request: a routing policy over the backends that serve its model, are
healthy and are not draining. Each policy is a small class with one method, `choose(candidates, prompt_ids,
blocks)` (`blocks`: the request's prefix-cache hashes per backend, or None); `prefix_cache`
(gateway/backends/prefix_index.py) also hears, through `cached`, what the engine reused."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from ..config import GatewayConfig
from ..errors import ApiError, unavailable
from .backend import Backend
from .prefix_index import Blocks, PrefixCache

AFFINITY_BLOCK_LEN = 16  # tokens per hashed block of the prompt prefix (a KV block's worth)


class LeastOutstandingTokens:
    """The backend with the fewest prompt + output tokens still to produce (the gateway's own count)."""

    def choose(self, candidates: Sequence[Backend], prompt_ids: Sequence[int], blocks: Blocks | None = None) -> Backend:
        return min(candidates, key=lambda b: b.outstanding_tokens)


class MostFreeKv:
    """The backend whose engine last reported the most free KV blocks (ring header); ties by load."""

    def choose(self, candidates: Sequence[Backend], prompt_ids: Sequence[int], blocks: Blocks | None = None) -> Backend:
        return max(candidates, key=lambda b: (b.engine_stats()["free_kv_blocks"], -b.outstanding_tokens))


class PrefixAffinity:
    """Rendezvous hashing of the prompt's leading blocks, so requests sharing a prefix meet its KV;
    the least loaded backend instead when the chosen one is `max_extra_tokens` busier than it."""

    def __init__(self, prefix_len: int = 64, max_extra_tokens: int = 2048):
        self.prefix_len = prefix_len
        self.max_extra_tokens = max_extra_tokens

    def choose(self, candidates: Sequence[Backend], prompt_ids: Sequence[int], blocks: Blocks | None = None) -> Backend:
        key = prefix_key(prompt_ids, self.prefix_len)
        chosen = max(candidates, key=lambda b: hashlib.blake2b(key + b.info.addr.encode(), digest_size=8).digest())
        least = min(candidates, key=lambda b: b.outstanding_tokens)
        if chosen.outstanding_tokens > least.outstanding_tokens + self.max_extra_tokens:
            return least
        return chosen


def prefix_key(prompt_ids: Sequence[int], prefix_len: int) -> bytes:
    """The whole 16-token blocks among the first `prefix_len` tokens (all of a shorter prompt)."""
    num_tokens = min(prefix_len, len(prompt_ids)) // AFFINITY_BLOCK_LEN * AFFINITY_BLOCK_LEN
    head = prompt_ids[:num_tokens or prefix_len]
    return b"".join(int(t).to_bytes(4, "little") for t in head)


def make_policy(config: GatewayConfig):
    if config.routing == "most_free_kv":
        return MostFreeKv()
    if config.routing == "prefix_affinity":
        return PrefixAffinity(config.affinity_prefix_len, config.affinity_max_extra_tokens)
    if config.routing == "prefix_cache":
        return PrefixCache(config.prefix_cache_balance_ratio, config.prefix_cache_balance_slack_tokens,
                           config.prefix_cache_max_blocks)
    return LeastOutstandingTokens()


class Router:
    """The current backends by model (the pool adds and removes them) and the policy that picks one."""

    def __init__(self, backends: Iterable[Backend], policy=None):
        self.backends: list[Backend] = []
        self._models_seen: set[str] = set()  # a model whose backends all went away is a 503, not a 404
        self.policy = policy or LeastOutstandingTokens()
        for backend in backends:
            self.add(backend)

    def add(self, backend: Backend) -> None:
        self.backends.append(backend)
        self._models_seen.add(backend.info.model_name)

    def remove(self, backend: Backend) -> None:
        if backend in self.backends:
            self.backends.remove(backend)

    def find(self, addr: str) -> Backend | None:
        return next((b for b in self.backends if b.info.addr == addr), None)

    @property
    def model_names(self) -> list[str]:
        return list(dict.fromkeys(b.info.model_name for b in self.backends))

    def backends_for(self, model: str) -> list[Backend]:
        """Backends serving `model`; a 404 `model_not_found` error when none does."""
        candidates = [b for b in self.backends if b.info.model_name == model]
        if not candidates and model in self._models_seen:
            raise unavailable(f"no backend serving '{model}' is connected now; retry later")
        if not candidates:
            raise ApiError(404, f"the model '{model}' does not exist; this server has: "
                           f"{', '.join(self.model_names) or 'no models'}", param="model",
                           code="model_not_found")
        return candidates

    def pick(self, model: str, prompt_ids: Sequence[int] = (), exclude: Iterable[str] = (),
             blocks: Blocks | None = None) -> Backend:
        """A backend for a request, never one whose address is in `exclude` (tried already), nor a draining,
        dead or stalled one; an ejected one only when no other is left. `blocks`: the prompt's block hashes."""
        exclude = set(exclude)
        open_ = [b for b in self.backends_for(model) if not b.draining and b.info.addr not in exclude]
        candidates = [b for b in open_ if b.healthy]
        if not candidates:  # every one ejected (a slow step?): queue there rather than refuse
            candidates = [b for b in open_ if not (b.stalled or b.dead)]
        if not candidates:
            tried = f" (tried: {', '.join(sorted(exclude))})" if exclude else ""
            draining = [b.info.addr for b in self.backends_for(model) if b.draining]
            why = f"; draining: {', '.join(draining)}" if draining else ""
            raise unavailable(f"no healthy backend serving '{model}' is available{tried}{why}; retry later")
        return self.policy.choose(candidates, prompt_ids, blocks)

    def cached(self, backend: Backend, blocks: Blocks, cached_tokens: int) -> None:
        """The engine of `backend` reused `cached_tokens` of a request's prompt (a policy may learn from it)."""
        learn = getattr(self.policy, "cached", None)
        if learn is not None:
            learn(backend, blocks, cached_tokens)
