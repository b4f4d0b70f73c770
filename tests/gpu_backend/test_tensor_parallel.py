"""Tensor parallelism's split of the model, on the CPU: each rank's share (gpu_backend/parallel/shard.py) run
through the one forward (`decoder_layers`) in its own thread, with an all-reduce that sums the ranks' partial
outputs in rank order (what kernels/tp_comm.cu does on GPUs), gives the whole model's logits, for every family
the engine serves (Llama with tied embeddings, Qwen2 with q/k/v biases, Qwen3 with q/k norms, Phi-3's fused
projections, Qwen3-MoE and Mixtral experts). The GPU side (the kernels, the runner, persistent = host) is in
test_tensor_parallel_gpu.py. Also: the splits that cannot work are refused, naming the field.
"""
from __future__ import annotations

import threading

import pytest
import torch

from conftest_models import BLOCK_SIZE, hf_reference, ours_from, tiny_cfg
from gpu_backend.config import BackendConfig, ConfigError
from gpu_backend.models import AttnBatch, allocate_kv_cache
from gpu_backend.models.llama_forward import decoder_layers, lm_head_logits
from gpu_backend.models.torch_ops import TorchOps
from gpu_backend.parallel.shard import check_shardable, local_config, shard_model


class _SumGroup:
    """An all-reduce across threads: every rank's tensor, summed in rank order in float32."""

    def __init__(self, world: int):
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.calls = 0

    def reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        total = sum(p.float() for p in self.parts)
        self.barrier.wait()
        if rank == 0:
            self.calls += 1
        return total.to(x.dtype)


def _prefill_logits(models, cfg, ids: list[int]) -> tuple[torch.Tensor, int]:
    """The leader's logits [T, V] of one sequence's prefill over the ranks' `models`; all-reduces per rank."""
    world, n = len(models), len(ids)
    group, out, errors = _SumGroup(world), {}, []
    blocks = -(-n // BLOCK_SIZE)

    def run(rank: int) -> None:
        try:
            m = models[rank]
            w = m.decoder_weights()
            kv = allocate_kv_cache(cfg, blocks, BLOCK_SIZE, torch.float32, "cpu")
            batch = AttnBatch(q_lens=[n], ctx_lens=[n], block_tables=[list(range(blocks))], slot_mapping=torch.arange(n))
            ops = TorchOps(batch, torch.arange(n), m.rotary, kv, cfg.head_dim ** -0.5, w.embed.dtype)
            ops.all_reduce = lambda x: x if world == 1 else group.reduce(rank, x)
            with torch.inference_mode():
                x, residual = decoder_layers(ops, w, cfg, torch.tensor(ids))
                if rank == 0:
                    out["logits"] = lm_head_logits(ops, w, cfg, x, residual)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out["logits"], group.calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_shares_give_the_whole_models_logits(kind, world):
    cfg = tiny_cfg(kind, num_kv_heads=4)
    whole = ours_from(hf_reference(cfg, seed=3), cfg)
    ids = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12]
    ref, calls_one = _prefill_logits([whole], cfg, ids)
    local = local_config(cfg, world)
    ranks = [shard_model(whole, cfg, r, world, torch.device("cpu")) for r in range(world)]
    got, calls = _prefill_logits(ranks, local, ids)
    assert calls == 2 * cfg.num_layers and calls_one == 0
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert ranks[1].lm_head.weight.numel() == 0  # the followers hold no head
    assert local.num_heads * world == cfg.num_heads and local.num_kv_heads * world == cfg.num_kv_heads


def test_a_rank_holds_its_share_of_every_projection():
    cfg = tiny_cfg("qwen3_moe", num_kv_heads=4)
    whole = ours_from(hf_reference(cfg), cfg)
    world = 4
    ranks = [shard_model(whole, cfg, r, world, torch.device("cpu")) for r in range(world)]
    full = dict(whole.named_parameters())
    for name, p in ranks[0].named_parameters():
        if name == "lm_head.weight":
            continue
        sharded = any(key in name for key in ("q_proj", "k_proj", "v_proj", "o_proj", "experts"))
        assert p.numel() * (world if sharded else 1) == full[name].numel(), name
    # the experts' gate rows then up rows, each quartered: rank 1's gate rows are the whole's rows 8..15
    gate_up = ranks[1].model.layers[0].mlp.experts.gate_up_proj
    torch.testing.assert_close(gate_up[:, :8], full["model.layers.0.mlp.experts.gate_up_proj"][:, 8:16])
    torch.testing.assert_close(gate_up[:, 8:], full["model.layers.0.mlp.experts.gate_up_proj"][:, 40:48])


@pytest.mark.parametrize("changes, field", [
    (dict(num_heads=6, num_kv_heads=2), "num_attention_heads"),
    (dict(num_kv_heads=2), "num_key_value_heads"),
    (dict(intermediate_size=90, num_kv_heads=4), "intermediate_size"),
])
def test_a_split_that_does_not_divide_the_model_is_refused(changes, field):
    with pytest.raises(ValueError, match=field):
        check_shardable(tiny_cfg("llama", **changes), 4)
    with pytest.raises(ValueError, match="supported sizes"):
        check_shardable(tiny_cfg("llama"), 3)


def test_the_backend_config_takes_tensor_parallel_size_for_the_gpu_modes_only():
    assert BackendConfig(mode="host", tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size.*GPU modes"):
        BackendConfig(mode="cpu", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 3"):
        BackendConfig(mode="host", tensor_parallel_size=3)


@pytest.mark.parametrize("kind", ["llama", "phi3", "qwen3_moe", "mixtral"])
def test_a_checkpoint_folder_loads_each_ranks_share_tensor_by_tensor(tmp_path, kind):
    """Per-expert tensors, fused qkv/gate_up, shards and index: each rank's model equals the whole one split."""
    from gpu_backend.parallel.shard import load_rank_models

    cfg = tiny_cfg(kind, num_kv_heads=4)
    hf = hf_reference(cfg, seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    whole = ours_from(hf, cfg)
    loaded_cfg, ranks, folder = load_rank_models(str(tmp_path), [torch.device("cpu")] * 2, progress=False,
                                                 dtype=torch.float32)
    assert loaded_cfg.replace(name=cfg.name) == cfg and folder == tmp_path
    for rank, model in enumerate(ranks):
        want = dict(shard_model(whole, cfg, rank, 2, torch.device("cpu")).named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, want[name], rtol=0, atol=0, msg=f"rank {rank}: {name}")
