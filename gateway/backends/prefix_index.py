"""Routing that knows what each backend's prefix cache holds: the `prefix_cache` policy.

The gateway keeps, per backend, the block hashes it recently sent there (least recently used first, capped at
the backend's KV blocks from its ring header, or `prefix_cache_max_blocks`), and sends a request to the backend
holding the longest run of its leading hashes. A hot prefix must not pile all load onto one GPU: when that
backend's outstanding tokens exceed `balance_ratio` x the least loaded one's and `balance_slack_tokens` more,
the least loaded one takes the request instead (and learns the prefix).

The index is the gateway's guess: engines report no stored/evicted blocks (KV events) yet. It is corrected with
the engine's truth per request: when a request's `cached_tokens` shows fewer blocks than the index predicted,
the hashes from the first missed block on are dropped for that backend (the next request re-learns them).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable, Sequence
from typing import Protocol

from .backend import Backend

DEFAULT_MAX_BLOCKS = 1 << 16  # a backend whose header reports no KV blocks yet


class Blocks(Protocol):
    """A request's block hashes per backend (`gateway/request/prefix.py`'s `PromptBlocks`)."""

    predicted: dict[str, int]
    prompt_ids: Sequence[int]

    def hashes_for(self, info) -> tuple[int, ...]: ...

    def max_cached_blocks(self, info) -> int: ...


class BlockIndex:
    """The hashes one backend was sent, least recently used first, at most `max_blocks` of them."""

    def __init__(self):
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match_len(self, hashes: Sequence[int]) -> int:
        """Leading hashes held (the chain: a block past a missing one is of no use)."""
        num_held = 0
        for block_hash in hashes:
            if block_hash not in self._lru:
                break
            num_held += 1
        return num_held

    def add(self, hashes: Iterable[int], max_blocks: int) -> None:
        """Mark `hashes` most recently used, evicting the least recently used beyond `max_blocks`."""
        lru = self._lru
        for block_hash in hashes:
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        while len(lru) > max_blocks:
            lru.popitem(last=False)

    def drop(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            self._lru.pop(block_hash, None)


class PrefixCache:
    """Longest cached prefix first, least outstanding tokens when that backend is much busier (module doc)."""

    def __init__(self, balance_ratio: float = 1.5, balance_slack_tokens: int = 4096, max_blocks: int | None = None):
        self.balance_ratio = balance_ratio
        self.balance_slack_tokens = balance_slack_tokens
        self.max_blocks = max_blocks  # None: each backend's total KV blocks (ring header)
        self._indexes: weakref.WeakKeyDictionary[Backend, BlockIndex] = weakref.WeakKeyDictionary()

    def index_of(self, backend: Backend) -> BlockIndex:
        index = self._indexes.get(backend)
        if index is None:
            index = self._indexes[backend] = BlockIndex()
        return index

    def choose(self, candidates: Sequence[Backend], prompt_ids: Sequence[int], blocks: Blocks | None = None) -> Backend:
        least = min(candidates, key=lambda b: b.outstanding_tokens)
        if blocks is None:
            return least
        matches = {b: self.index_of(b).match_len(blocks.hashes_for(b.info)) for b in candidates}
        best = max(candidates, key=lambda b: (matches[b], -b.outstanding_tokens))
        chosen = best if matches[best] and not self._too_busy(best, least) else least
        blocks.predicted[chosen.info.addr] = matches[chosen]
        self.index_of(chosen).add(blocks.hashes_for(chosen.info), self._cap(chosen))
        return chosen

    def _too_busy(self, backend: Backend, least: Backend) -> bool:
        load, least_load = backend.outstanding_tokens, least.outstanding_tokens
        return load > self.balance_ratio * least_load and load - least_load > self.balance_slack_tokens

    def _cap(self, backend: Backend) -> int:
        if self.max_blocks is not None:
            return self.max_blocks
        try:
            total = backend.engine_stats().get("total_kv_blocks", 0)
        except (TypeError, ValueError):  # the ring is gone (shutting down)
            total = 0
        return total or DEFAULT_MAX_BLOCKS

    def cached(self, backend: Backend, blocks: Blocks, cached_tokens: int, block_size: int) -> None:
        """The engine reused `cached_tokens` of the request's prompt: drop what the index wrongly predicted."""
        if block_size <= 0 or backend not in self._indexes:
            return
        hashes = blocks.hashes_for(backend.info)
        num_hit = min(cached_tokens // block_size, len(hashes))
        predicted = min(blocks.predicted.get(backend.info.addr, 0), blocks.max_cached_blocks(backend.info))
        if num_hit < predicted:
            self._indexes[backend].drop(hashes[num_hit:])
