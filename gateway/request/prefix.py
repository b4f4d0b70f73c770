"""A prompt's prefix-cache block hashes, as each backend needs them (DESIGN.md, "Prefix caching").

The hashes depend on the backend's model fingerprint and its ring's KV block size (`protocols/prefix_hash.py`),
so one request computes them at most once per such pair (backends of one model share it: once in all). A
prompt longer than a backend's slot is refused there whatever its hashes (`RequestSpec.validate`).
Hashing runs inline: ~1 us per block (a 8k-token prompt of 16-token blocks, ~0.5 ms), less than a thread hop.

The salt that namespaces the cache is the key's (`Principal.cache_salt`) with the request's `cache_salt`
after it; the key's part is length-prefixed, so no request salt can make one key's chain another key's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from protocols.messages import BackendInfo
from protocols.prefix_hash import block_hashes
from protocols.ring import RequestSpec


def effective_salt(key_salt: str, request_salt: str | None) -> str:
    """The chain's salt: "" for an anonymous request without `cache_salt`, else `<len>:<key salt><request salt>`."""
    request_salt = request_salt or ""
    if not key_salt and not request_salt:
        return ""
    return f"{len(key_salt)}:{key_salt}{request_salt}"


class PromptBlocks:
    """One prompt's block hashes under one salt, per backend, computed on first use; and what routing
    predicted each backend holds of them (`predicted`: leading blocks held, and of those confirmed by an engine),
    for the correction when the engine answers."""

    __slots__ = ("prompt_ids", "salt", "predicted", "_memo")

    def __init__(self, prompt_ids: Sequence[int], salt: str = ""):
        self.prompt_ids = prompt_ids
        self.salt = salt
        self.predicted: dict[str, tuple[int, int]] = {}  # backend address -> (blocks held, confirmed), see above
        self._memo: dict[tuple[str, int], tuple[int, ...]] = {}

    def hashes_for(self, info: BackendInfo) -> tuple[int, ...]:
        """The hashes `info`'s backend takes: one per full prompt block of its ring's kv_block_size; none for a
        backend without a prefix cache."""
        if not info.prefix_caching:
            return ()
        fingerprint, block_size = key = (info.model_fingerprint, info.geometry.kv_block_size)
        hashes = self._memo.get(key)
        if hashes is None:
            hashes = self._memo[key] = tuple(block_hashes(self.prompt_ids, block_size, fingerprint, self.salt))
        return hashes

    def spec_for(self, spec: RequestSpec, info: BackendInfo) -> RequestSpec:
        """`spec` carrying the hashes for `info`'s backend."""
        hashes = self.hashes_for(info)
        if tuple(spec.block_hashes) == hashes:
            return spec
        return dataclasses.replace(spec, block_hashes=hashes)

    def max_cached_blocks(self, info: BackendInfo) -> int:
        """Blocks an engine can report as cached: full ones, less the last token (always computed)."""
        return min(len(self.hashes_for(info)), (len(self.prompt_ids) - 1) // info.geometry.kv_block_size)
