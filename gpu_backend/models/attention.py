"""Paged attention in plain torch (the CPU engine and the reference for GPU kernels).

The KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`: K and V for every
slot; slot = block_id * block_size + offset. A forward step writes the new tokens' K/V into their slots,
then every sequence attends over its whole context gathered through its block table. Decode sequences
(one new token each) share one padded, masked SDPA call; each prefill chunk gets its own call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttnBatch:
    """What attention needs to know about the sequences of one forward step.

    q_lens: new tokens per sequence; sequence i owns input rows [sum(q_lens[:i]), +q_lens[i]).
    ctx_lens: tokens in the cache after this step, new ones included; the new tokens' positions
        are ctx_len - q_len .. ctx_len - 1.
    block_tables: KV block ids per sequence, in order (at least ceil(ctx_len / block_size) of them).
    slot_mapping: [T] int64, block_id * block_size + offset where each new token's K/V is written.
    """

    q_lens: list[int]
    ctx_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor


@dataclass
class _Decode:
    rows: torch.Tensor | None     # [B] int64 input rows; None when they are rows 0..B-1
    num_rows: int
    blocks: torch.Tensor          # [B, max_blocks] int64 block ids, padded with block 0
    mask: torch.Tensor            # [B, 1, 1, max_blocks * block_size] additive: 0 attend, -inf not


@dataclass
class _Prefill:
    start: int                    # first input row
    q_len: int
    ctx_len: int
    blocks: torch.Tensor | None   # [num_blocks] int64; None when the chunk is the whole context
    mask: torch.Tensor | None     # [q_len, num_blocks * block_size] additive; None: plain causal


@dataclass
class AttnPlan:
    """Index tensors derived once per forward from an AttnBatch and reused by every layer."""

    slot_mapping: torch.Tensor    # [T] int64
    decode: _Decode | None
    prefills: list[_Prefill] = field(default_factory=list)

    @classmethod
    def build(cls, batch: AttnBatch, block_size: int, num_tokens: int, device: torch.device,
              dtype: torch.dtype = torch.float32) -> "AttnPlan":
        _validate(batch, block_size, num_tokens)
        starts = _row_starts(batch.q_lens)
        decode_ids = [i for i, n in enumerate(batch.q_lens) if n == 1]
        prefills = [_plan_prefill(batch, i, starts[i], block_size, device, dtype)
                    for i, n in enumerate(batch.q_lens) if n > 1]
        decode = _plan_decode(batch, decode_ids, starts, block_size, device, dtype) if decode_ids else None
        return cls(batch.slot_mapping.to(device=device, dtype=torch.long), decode, prefills)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttnPlan,
                    layer_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Write k/v into the cache and attend.

    q: [T, num_heads, D]; k, v: [T, num_kv_heads, D]; layer_cache: [2, NB, BS, num_kv_heads, D].
    Returns [T, num_heads, D].
    """
    write_kv(layer_cache, k, v, plan.slot_mapping)
    return attend(q, k, v, plan, layer_cache, scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttnPlan, layer_cache: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Attention over a cache that already holds this step's K/V (`write_kv`); k, v are those new rows
    (a whole-context prefill chunk reads them instead of the cache). Returns [T, num_heads, D]."""
    out = torch.empty_like(q)
    if plan.decode is not None:
        _decode_attention(q, out, plan.decode, layer_cache, scale)
    for p in plan.prefills:
        _prefill_attention(q, k, v, out, p, layer_cache, scale)
    return out


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows ([T, KVH, D]) into their slots."""
    num_kv_heads, head_dim = layer_cache.shape[-2:]
    layer_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(layer_cache.dtype))
    layer_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(layer_cache.dtype))


def gather_kv(layer_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks ([...] block ids) as [..., KVH, L, D] with L = num_blocks * block_size."""
    block_shape = layer_cache.shape[2:]                                        # BS, KVH, D
    kv = layer_cache.flatten(2).index_select(1, blocks.flatten())             # [2, n, BS*KVH*D]
    kv = kv.view(2, *blocks.shape, *block_shape).flatten(-4, -3)              # [2, ..., L, KVH, D]
    kv = kv.transpose(-3, -2)                                                  # [2, ..., KVH, L, D]
    return kv[0].to(dtype), kv[1].to(dtype)


def _decode_attention(q, out, d: _Decode, layer_cache, scale) -> None:
    qd = q[: d.num_rows] if d.rows is None else q.index_select(0, d.rows)   # [B, H, D]
    kd, vd = gather_kv(layer_cache, d.blocks, q.dtype)                       # [B, KVH, L, D]
    od = F.scaled_dot_product_attention(qd.unsqueeze(2), kd, vd, attn_mask=d.mask,
                                        scale=scale, enable_gqa=True).squeeze(2)
    if d.rows is None:
        out[: d.num_rows] = od
    else:
        out.index_copy_(0, d.rows, od)


def _prefill_attention(q, k, v, out, p: _Prefill, layer_cache, scale) -> None:
    rows = slice(p.start, p.start + p.q_len)
    qp = q[rows].transpose(0, 1).unsqueeze(0)                                # [1, H, n, D]
    if p.blocks is None:   # the chunk is the whole context: use the fresh K/V directly
        kp, vp = (x[rows].transpose(0, 1).unsqueeze(0) for x in (k, v))     # [1, KVH, n, D]
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kp, vp = gather_kv(layer_cache, p.blocks, q.dtype)                   # [KVH, L, D]
        op = F.scaled_dot_product_attention(qp, kp.unsqueeze(0), vp.unsqueeze(0), attn_mask=p.mask,
                                            scale=scale, enable_gqa=True)
    out[rows] = op.squeeze(0).transpose(0, 1)


def _row_starts(q_lens: list[int]) -> list[int]:
    starts, total = [], 0
    for n in q_lens:
        starts.append(total)
        total += n
    return starts


def _num_blocks(ctx_len: int, block_size: int) -> int:
    return -(-ctx_len // block_size)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # converted once per step instead of once per layer inside SDPA
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _plan_decode(batch: AttnBatch, ids: list[int], starts: list[int], block_size: int, device, dtype) -> _Decode:
    max_blocks = max(_num_blocks(batch.ctx_lens[i], block_size) for i in ids)
    table = [batch.block_tables[i][:max_blocks] + [0] * (max_blocks - len(batch.block_tables[i][:max_blocks]))
             for i in ids]
    ctx = torch.tensor([batch.ctx_lens[i] for i in ids], device=device)
    mask = _additive(torch.arange(max_blocks * block_size, device=device)[None, :] < ctx[:, None], dtype)
    rows = [starts[i] for i in ids]
    in_order = rows == list(range(len(rows)))
    return _Decode(rows=None if in_order else torch.tensor(rows, device=device), num_rows=len(rows),
                   blocks=torch.tensor(table, device=device), mask=mask[:, None, None, :])


def _plan_prefill(batch: AttnBatch, i: int, start: int, block_size: int, device, dtype) -> _Prefill:
    q_len, ctx_len = batch.q_lens[i], batch.ctx_lens[i]
    if q_len == ctx_len:
        return _Prefill(start, q_len, ctx_len, None, None)
    num_blocks = _num_blocks(ctx_len, block_size)
    blocks = torch.tensor(batch.block_tables[i][:num_blocks], device=device)
    key_pos = torch.arange(num_blocks * block_size, device=device)
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    return _Prefill(start, q_len, ctx_len, blocks, _additive(key_pos[None, :] <= query_pos[:, None], dtype))


def _validate(batch: AttnBatch, block_size: int, num_tokens: int) -> None:
    num_seqs = len(batch.q_lens)
    if not (len(batch.ctx_lens) == len(batch.block_tables) == num_seqs):
        raise ValueError(f"AttnBatch: q_lens, ctx_lens and block_tables need one entry per sequence, got "
                         f"{num_seqs}, {len(batch.ctx_lens)}, {len(batch.block_tables)}")
    if sum(batch.q_lens) != num_tokens or batch.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"AttnBatch: sum(q_lens)={sum(batch.q_lens)} and slot_mapping "
                         f"{tuple(batch.slot_mapping.shape)} must match the {num_tokens} input tokens")
    for i, (q_len, ctx_len) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        if not 0 < q_len <= ctx_len:
            raise ValueError(f"AttnBatch: sequence {i} has q_len={q_len}, ctx_len={ctx_len}; "
                             f"need 0 < q_len <= ctx_len")
        if len(batch.block_tables[i]) * block_size < ctx_len:
            raise ValueError(f"AttnBatch: sequence {i} has {len(batch.block_tables[i])} blocks of "
                             f"{block_size} for ctx_len={ctx_len}")
