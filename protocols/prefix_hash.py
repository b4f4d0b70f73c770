"""Block hashes of a prompt, as the gateway computes them for prefix caching (DESIGN.md, "Prefix caching").

A prompt's full KV blocks are named by a chain: block 0's hash covers the model, the tenant's cache salt and
its tokens; block i's covers block i-1's hash and its tokens. Equal hashes mean equal token prefixes of the
same model under the same salt, so the engine may reuse the block; it never sees the salt or hashes anything
itself (the GPU host computes nothing for it). 64-bit BLAKE2b: one call per block, ~1 us, on the gateway.
A trailing partial block gets no hash (only full blocks are shared).
"""
from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

EMPTY_HASH = 0  # never produced: the engine's table uses 0 for "no hash"


def _u64(digest: bytes) -> int:
    value = int.from_bytes(digest, "little")
    return value if value != EMPTY_HASH else 1


def chain_seed(model_fingerprint: str, cache_salt: str = "") -> bytes:
    """The chain's start for one model and one salt (length-prefixed, so ("ab", "c") != ("a", "bc"))."""
    model = model_fingerprint.encode()
    salt = cache_salt.encode()
    return struct.pack("<I", len(model)) + model + struct.pack("<I", len(salt)) + salt


def block_hashes(prompt_ids: Sequence[int], block_size: int, model_fingerprint: str, cache_salt: str = "",
                 limit: int | None = None) -> list[int]:
    """One nonzero 64-bit hash per full block of `prompt_ids` (at most `limit` of them)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(prompt_ids) // block_size
    if limit is not None:
        full = min(full, limit)
    tokens = array("i", prompt_ids[: full * block_size]).tobytes()  # int32 little-endian on every host we run
    step = 4 * block_size
    prev = chain_seed(model_fingerprint, cache_salt)
    out: list[int] = []
    for i in range(full):
        digest = hashlib.blake2b(prev + tokens[i * step:(i + 1) * step], digest_size=8).digest()
        out.append(_u64(digest))
        prev = digest
    return out
