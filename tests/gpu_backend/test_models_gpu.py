"""LlamaModel on a CUDA GPU: the same paged forward as on the CPU, and a full-size random preset in bf16."""

from __future__ import annotations

import time

import pytest
import torch

from conftest_models import hf_logits, hf_reference, ours_from, tiny_cfg
from gpu_backend.models import BlockPool, SeqState, allocate_kv_cache, greedy_generate, load_model, make_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]


def _chunked_logits(model, tokens, chunks, block_ids, block_size, dtype) -> torch.Tensor:
    kv = allocate_kv_cache(model.cfg, max(block_ids) + 1, block_size, dtype, "cuda")
    pool, seq, out = BlockPool(block_ids), SeqState(list(tokens)), []
    with torch.inference_mode():
        for n in chunks:
            ids, pos, batch = make_step([seq], [n], pool, block_size, "cuda")
            out.append(model.compute_logits(model(ids, pos, batch, kv)))
            seq.num_cached += n
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"])
def test_paged_forward_on_cuda_matches_transformers_on_cpu(kind):
    cfg = tiny_cfg(kind)
    hf = hf_reference(cfg)
    tokens = list(range(3, 22))
    model = ours_from(hf, cfg).to("cuda")
    got = _chunked_logits(model, tokens, (5, 3, 7, 1, 1, 1, 1), [7, 3, 11, 0, 5, 9, 1], 4, torch.float32)
    torch.testing.assert_close(got.cpu(), hf_logits(hf, tokens), atol=2e-4, rtol=0)


def test_random_llama3_8b_bf16_chunked_equals_whole_and_generates():
    t0 = time.perf_counter()
    cfg, model, _ = load_model("random:llama-3-8b", device="cuda")
    torch.cuda.synchronize()
    print(f"\nrandom:llama-3-8b bf16 on cuda in {time.perf_counter() - t0:.1f} s, "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    assert next(model.parameters()).dtype == torch.bfloat16 and model.lm_head.weight.is_contiguous()
    tokens = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(24))[::-1]
    whole = _chunked_logits(model, tokens, (300,), blocks, 16, torch.bfloat16)
    chunked = _chunked_logits(model, tokens, (200, 97, 1, 1, 1), blocks[::2] + blocks[1::2], 16, torch.bfloat16)
    scale = whole.abs().max().item()
    assert (chunked - whole).abs().max().item() < 0.05 * scale
    assert (chunked.argmax(-1) == whole.argmax(-1)).float().mean().item() > 0.9
    greedy_generate(model, [tokens[:50], tokens[:120]], 4)   # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    (out,) = greedy_generate(model, [tokens[:50]], 64)
    torch.cuda.synchronize()
    assert len(out) == 64
    print(f"eager decode, batch 1: {(time.perf_counter() - t0) / 64 * 1e3:.1f} ms/token")
