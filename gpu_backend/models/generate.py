"""A small reference generator over the paged cache: chunked prefill + batched greedy decode.

The engine has its own scheduler; this is for tests, benchmarks and debugging, and shows how to
drive `LlamaModel.forward` (one mixed batch per step: decode sequences first, then prefill chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import AttnBatch
from .llama import LlamaModel, allocate_kv_cache


@dataclass
class SeqState:
    token_ids: list[int]                       # prompt + generated
    num_cached: int = 0                        # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_generated: int = 0
    finished: bool = False


class BlockPool:
    """Free list of KV block ids."""

    def __init__(self, block_ids: list[int]):
        self.free_ids = list(block_ids)

    def ensure(self, seq: SeqState, num_tokens: int, block_size: int) -> None:
        needed = -(-num_tokens // block_size) - len(seq.block_table)
        if needed > len(self.free_ids):
            raise RuntimeError(f"BlockPool: need {needed} more KV blocks, {len(self.free_ids)} free")
        for _ in range(max(needed, 0)):
            seq.block_table.append(self.free_ids.pop(0))

    def release(self, seq: SeqState) -> None:
        self.free_ids.extend(seq.block_table)
        seq.block_table = []


def make_step(seqs: list[SeqState], q_lens: list[int], pool: BlockPool, block_size: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, AttnBatch]:
    """Inputs of one forward: the next q_lens[i] uncached tokens of every sequence."""
    ids, positions, slots, ctx_lens = [], [], [], []
    for seq, q_len in zip(seqs, q_lens):
        start, end = seq.num_cached, seq.num_cached + q_len
        if not 0 < q_len <= len(seq.token_ids) - start:
            raise ValueError(f"make_step: q_len={q_len} but {len(seq.token_ids) - start} uncached tokens")
        pool.ensure(seq, end, block_size)
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        ctx_lens.append(end)
    batch = AttnBatch(q_lens=list(q_lens), ctx_lens=ctx_lens, block_tables=[s.block_table for s in seqs],
                      slot_mapping=torch.tensor(slots, dtype=torch.long, device=device))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return as_tensor(ids), as_tensor(positions), batch


@torch.inference_mode()
def greedy_generate(model: LlamaModel, prompts: list[list[int]], max_new_tokens: int, *,
                    block_size: int = 16, num_blocks: int | None = None, prefill_chunk: int = 512,
                    stop_token_ids: tuple[int, ...] = (), kv_cache: torch.Tensor | None = None) -> list[list[int]]:
    """Greedy continuations (stop token included when hit) of every prompt, all run as one batch."""
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    device = model.lm_head.weight.device
    seqs = [SeqState(list(p)) for p in prompts]
    if kv_cache is None:
        need = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
        kv_cache = allocate_kv_cache(model.cfg, num_blocks or need, block_size, model.lm_head.weight.dtype, device)
    pool = BlockPool(list(range(kv_cache.shape[2])))
    while active := [s for s in seqs if not s.finished]:
        active.sort(key=lambda s: len(s.token_ids) - s.num_cached > 1)   # decode first, then prefill
        q_lens = [min(len(s.token_ids) - s.num_cached, prefill_chunk) for s in active]
        input_ids, positions, batch = make_step(active, q_lens, pool, block_size, device)
        hidden = model(input_ids, positions, batch, kv_cache)
        _commit(model, hidden, active, q_lens, max_new_tokens, set(stop_token_ids), pool)
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


def _commit(model, hidden, seqs, q_lens, max_new_tokens, stop_ids, pool) -> None:
    last_rows, ready = [], []
    row = 0
    for seq, q_len in zip(seqs, q_lens):
        row += q_len
        seq.num_cached += q_len
        if seq.num_cached == len(seq.token_ids):    # prompt fully in the cache: sample
            last_rows.append(row - 1)
            ready.append(seq)
    if not ready:
        return
    next_ids = model.compute_logits(hidden[last_rows]).argmax(-1).tolist()
    for seq, token_id in zip(ready, next_ids):
        seq.token_ids.append(token_id)
        seq.num_generated += 1
        if seq.num_generated >= max_new_tokens or token_id in stop_ids:
            seq.finished = True
            pool.release(seq)
