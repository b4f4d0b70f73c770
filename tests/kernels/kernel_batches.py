"""Random paged batches for the kernel tests: the static device tensors of one step of a bucket
(T tokens, S sequence rows), built the way the engine fills them, plus float32 references."""

from __future__ import annotations

from dataclasses import dataclass

import torch

POISON_BLOCK = 1 << 28   # block-table entries past a sequence's context: reading one would fault


@dataclass
class PagedBatch:
    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]          # block ids in use per live sequence
    block_size: int
    positions: torch.Tensor          # [T] int32 (padding rows: garbage)
    slot_mapping: torch.Tensor       # [T] int64 (padding rows: -1)
    seq_ids_of_token: torch.Tensor   # [T] int32 (padding rows: -1)
    q_start: torch.Tensor            # [S+1] int32
    ctx_lens_t: torch.Tensor         # [S] int32
    block_tables: torch.Tensor       # [S, max_blocks] int32
    num_seqs: torch.Tensor           # [1] int32

    @property
    def num_real_tokens(self) -> int:
        return sum(self.q_lens)


def make_batch(q_lens: list[int], ctx_lens: list[int], num_tokens: int, max_seqs: int, max_blocks: int,
               num_blocks: int, device, gen: torch.Generator, block_size: int = 16) -> PagedBatch:
    """Sequences get blocks from a random permutation of the cache (shuffled, non-contiguous ids)."""
    assert sum(q_lens) <= num_tokens and len(q_lens) <= max_seqs
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, table_rows = [], torch.full((max_seqs, max_blocks), POISON_BLOCK, dtype=torch.int32)
    for s, ctx in enumerate(ctx_lens):
        n = -(-ctx // block_size)
        tables.append([perm.pop() for _ in range(n)])
        table_rows[s, :n] = torch.tensor(tables[-1], dtype=torch.int32)
    positions = torch.full((num_tokens,), 10**7, dtype=torch.int32)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    seq_ids = torch.full((num_tokens,), -1, dtype=torch.int32)
    q_start = torch.zeros(max_seqs + 1, dtype=torch.int32)
    row = 0
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(ctx - q_len, ctx):
            positions[row], seq_ids[row] = pos, s
            slots[row] = tables[s][pos // block_size] * block_size + pos % block_size
            row += 1
        q_start[s + 1:] = row
    ctx_t = torch.zeros(max_seqs, dtype=torch.int32)
    ctx_t[: len(ctx_lens)] = torch.tensor(ctx_lens, dtype=torch.int32)
    to = lambda t: t.to(device)
    return PagedBatch(list(q_lens), list(ctx_lens), tables, block_size, to(positions), to(slots), to(seq_ids),
                      to(q_start), to(ctx_t), to(table_rows), to(torch.tensor([len(q_lens)], dtype=torch.int32)))


def gather_context(layer_cache: torch.Tensor, table: list[int], ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence as float32 [ctx_len, KVH, D]."""
    blocks = torch.tensor(table, device=layer_cache.device)
    kv = layer_cache[:, blocks].flatten(1, 2)[:, :ctx_len].float()
    return kv[0], kv[1]


def reference_attention(q: torch.Tensor, layer_cache: torch.Tensor, batch: PagedBatch, scale: float) -> torch.Tensor:
    """float32 [num_real_tokens, H, D]: causal attention of each token over its sequence's context."""
    num_heads, group = q.shape[1], q.shape[1] // layer_cache.shape[3]
    outs, row = [], 0
    for q_len, ctx, table in zip(batch.q_lens, batch.ctx_lens, batch.tables):
        k, v = (x.repeat_interleave(group, dim=1) for x in gather_context(layer_cache, table, ctx))  # [ctx, H, D]
        qs = q[row: row + q_len].float()                                    # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        row += q_len
    return torch.cat(outs) if outs else q.new_zeros((0, num_heads, q.shape[2]), dtype=torch.float32)
