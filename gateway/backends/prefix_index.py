"""Routing that knows what each backend's prefix cache holds: the `prefix_cache` policy.

The gateway keeps, per backend, the block hashes it recently sent there (least recently used first, capped at
the backend's KV blocks from its ring header, or `prefix_cache_max_blocks`), and sends a request to the backend
holding the longest run of its leading hashes. A hot prefix must not pile all load onto one GPU: when that
backend's outstanding tokens exceed `balance_ratio` x the least loaded one's and `balance_slack_tokens` more,
the least loaded one takes the request instead (and learns the prefix).

The index is the gateway's guess: engines report no stored/evicted blocks (KV events) yet. It is corrected with
the engine's truth per request: when a request's `cached_tokens` shows fewer blocks than the index predicted,
the hashes from the first missed block on are dropped for that backend (the next request re-learns them). Only
blocks an engine had confirmed (a request there prefilled them) count as such a prediction: a block still being
prefilled by a request sent just before (a burst sharing a prefix, the n choices of one prompt) is no evidence of
an eviction when the engine has not published it yet.
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

    predicted: dict[str, tuple[int, int]]
    prompt_ids: Sequence[int]

    def hashes_for(self, info) -> tuple[int, ...]: ...

    def max_cached_blocks(self, info) -> int: ...


class BlockIndex:
    """The hashes one backend was sent, least recently used first, at most `max_blocks` of them; each marked
    confirmed once a request there has prefilled it."""

    def __init__(self):
        self._lru: collections.OrderedDict[int, bool] = collections.OrderedDict()  # hash -> confirmed

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

    def confirmed_len(self, hashes: Sequence[int]) -> int:
        """Leading hashes held and confirmed by an engine's report."""
        num_confirmed = 0
        for block_hash in hashes:
            if not self._lru.get(block_hash, False):
                break
            num_confirmed += 1
        return num_confirmed

    def add(self, hashes: Iterable[int], max_blocks: int) -> None:
        """Mark `hashes` most recently used (new ones unconfirmed), evicting the least recently used beyond
        `max_blocks`."""
        lru = self._lru
        for block_hash in hashes:
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = False
        while len(lru) > max_blocks:
            lru.popitem(last=False)

    def confirm(self, hashes: Iterable[int]) -> None:
        """An engine has these blocks (a request there prefilled them)."""
        for block_hash in hashes:
            if block_hash in self._lru:
                self._lru[block_hash] = True

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
        index, hashes = self.index_of(chosen), blocks.hashes_for(chosen.info)
        blocks.predicted[chosen.info.addr] = (matches[chosen], index.confirmed_len(hashes))
        index.add(hashes, self._cap(chosen))
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

    def cached(self, backend: Backend, blocks: Blocks, cached_tokens: int) -> None:
        """The engine of `backend` prefilled the request reusing `cached_tokens` of its prompt: drop what the index
        wrongly counted on, confirm the rest (the engine holds those blocks now)."""
        index = self._indexes.get(backend)
        if index is None:
            return
        hashes = blocks.hashes_for(backend.info)
        num_hit = min(cached_tokens // backend.info.geometry.kv_block_size, len(hashes))
        _, num_confirmed = blocks.predicted.get(backend.info.addr, (0, 0))
        if num_hit < min(num_confirmed, blocks.max_cached_blocks(backend.info)):
            index.drop(hashes[num_hit:])
            index.confirm(hashes[:num_hit])
        else:
            index.confirm(hashes)
