"""Tensor parallelism on 2 (and, where the machine has them, 4) GPUs: run on the device machine, skipped
elsewhere (and on one GPU).

- the all-reduce kernel (kernels/tp_comm.cu) sums every rank's tensor, the same bits on every rank;
- the TP runner's teacher-forced logits are as close to the float32 model as one GPU's (only where bf16
  rounds differs), through prefill chunks, a mixed step and decode steps;
- the host engine's TP graphs give its eager steps' tokens, and the GPU-resident loop over TP gives the host
  engine's TP tokens bit for bit (the same graphs, the same decisions);
- a rank that stops answering ends the step with an error after the timeout, and the engine fails what is
  in flight instead of hanging.
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]

from test_gpu_runner import _drive, _peaky_model, _seq, _specs, chunked_logits  # noqa: E402
from test_persistent import CONFIG, Served, served  # noqa: E402,F401
from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig  # noqa: E402
from gpu_backend.engine.loop import EngineConfig, EngineLoop  # noqa: E402
from gpu_backend.parallel.runner import TpRunner  # noqa: E402
from gpu_backend.parallel.shard import local_config, shard_model  # noqa: E402
from protocols.ring import ErrorCode, FinishReason, RingGeometry  # noqa: E402
from protocols.shm import attach_ring, create_ring  # noqa: E402
from protocols.shm_consumer import RingConsumer  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402

WORLDS = [2] + ([4] if torch.cuda.device_count() >= 4 else [])
RUNNER = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=16, context_len=512, num_kv_blocks=96,
              sampling_extensions=False)


def _tp_runner(cfg, model, world, keep_graphs=False, timeout_s=None, **kw):
    bf16 = model.to(dtype=torch.bfloat16)
    devices = [torch.device("cuda", r) for r in range(world)]
    ranks = [shard_model(bf16, cfg, r, world, devices[r]) for r in range(world)]
    return TpRunner(ranks, local_config(cfg, world), GpuRunnerConfig(**{**RUNNER, **kw}), devices,
                    keep_graphs=keep_graphs, progress=False, **({} if timeout_s is None else dict(timeout_s=timeout_s)))


def _one_gpu_runner(cfg, model, keep_graphs=False, **kw):
    return GpuRunner(model.to(device="cuda:0", dtype=torch.bfloat16), cfg, GpuRunnerConfig(**{**RUNNER, **kw}),
                     device="cuda:0", progress=False, keep_graphs=keep_graphs)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_sums_every_ranks_tensor_with_the_same_bits_everywhere(world):
    from kernels.tp_comm import TpComm

    comm = TpComm(list(range(world)), 1 << 20)
    comm.set_live(True)
    try:
        for n in (8, 4096, 8 * 8192 + 8, 64 * 8192):
            xs = [torch.randn(n, device=f"cuda:{r}", generator=torch.Generator(f"cuda:{r}").manual_seed(r)).bfloat16()
                  for r in range(world)]
            want = sum(x.float().cpu() for x in xs).bfloat16()
            for rep in range(3):  # epochs advance: both exchange buffers in turn
                ys = [x.clone() for x in xs]
                for r in range(world):
                    with torch.cuda.device(r):
                        comm.rank(r).all_reduce_(ys[r], torch.cuda.current_stream(r).cuda_stream)
                for r in range(world):
                    torch.cuda.synchronize(r)
                for r in range(world):
                    assert torch.equal(ys[r].cpu(), ys[0].cpu()), (n, r)
                torch.testing.assert_close(ys[0].cpu().float(), want.float(), rtol=1e-2, atol=1e-2)
        assert comm.fault == 0
    finally:
        comm.close()


@pytest.mark.parametrize("world", WORLDS)
def test_tp_logits_are_as_close_to_float32_as_one_gpus(world):
    """TP changes only where bf16 rounds (each rank's partial sums, then their sum): against the float32 model
    it errs as much as one GPU does, through prefill chunks, a mixed step and decode steps."""
    from test_tensor_parallel import _prefill_logits

    cfg, model = _peaky_with_heads(world)
    fp32 = copy.deepcopy(model)
    one = _one_gpu_runner(cfg, model)
    tp = _tp_runner(cfg, model, world)
    plan = [(40, 0), (30, 27), (1, 20), *[(1, 1)] * 8]
    prompts = [list(range(3, 83)), list(range(100, 160))]
    got = []
    for runner in (one, tp):
        a, b = _seq(prompts[0], range(0, 8)), _seq(prompts[1], range(8, 16), slot=1)
        got.append([torch.cat(part).cpu() for part in chunked_logits(runner, a, b, plan).values()])
        computed = [a.num_computed, b.num_computed]
    for i, ids in enumerate(prompts):
        ref = _prefill_logits([fp32], cfg, ids[:computed[i]])[0]
        err = [((g[i] - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item() for g in got]
        agree = [(g[i].argmax(-1) == ref.argmax(-1)).float().mean().item() for g in got]
        print(f"seq {i}: mean rel err vs float32 one GPU {err[0]:.4f}, TP={world} {err[1]:.4f}; argmax agreement "
              f"{agree[0]:.3f} / {agree[1]:.3f}")
        assert err[1] <= 1.5 * err[0] + 2e-3
        assert agree[1] >= agree[0] - 0.04


def _peaky_with_heads(world):
    """`_peaky_model` with as many KV heads as ranks (4 query heads over 4 KV heads at TP=4)."""
    from conftest_models import hf_reference, ours_from, tiny_cfg

    if world <= 2:
        return _peaky_model()
    cfg = tiny_cfg("llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4,
                   head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
    model = ours_from(hf_reference(cfg, seed=0), cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return cfg, model


@pytest.mark.parametrize("world", WORLDS)
def test_host_engine_over_tp_graphs_gives_its_eager_steps_tokens(world):
    cfg, model = _peaky_with_heads(world)
    graphs = _drive(_tp_runner(cfg, model, world), cfg, _specs(), config=CONFIG)
    eager = _drive(_tp_runner(cfg, model, world, use_graphs=False), cfg, _specs(), config=CONFIG)
    assert graphs[1] == eager[1] == [FinishReason.LENGTH] * 4
    assert graphs[0] == eager[0]


@pytest.mark.parametrize("world", WORLDS)
def test_persistent_over_tp_gives_the_host_engines_tp_tokens_bit_for_bit(served, world):
    cfg, model = _peaky_with_heads(world)
    runner = _tp_runner(cfg, model, world, keep_graphs=True)
    host_tokens, host_fin, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    s = served(runner, cfg, tp=runner)
    slots = s.submit(_specs())
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert [s.finishes[x][0] for x in slots] == host_fin == [FinishReason.LENGTH] * 4
    assert [s.tokens[x] for x in slots] == host_tokens
    assert runner.error() is None
    loops = list(runner._loops)
    s.engine.shutdown()
    assert all(loop.poll() == 1 for loop in loops)  # the followers' loops ended with the leader's
    assert s.engine.final_ctl["tokens"] == 4 * 24
    # the runner serves again after its loops stopped: host steps, the same tokens
    assert _drive(runner, cfg, _specs(), config=CONFIG)[0] == host_tokens


def test_a_rank_that_stops_answering_fails_the_requests_in_flight():
    cfg, model = _peaky_model()
    runner = _tp_runner(cfg, model, 2, timeout_s=1.0)
    runner._followers_step = lambda bucket: None  # rank 1 never runs its step: the leader's all-reduce waits
    ring = create_ring(f"blink-tp-test-{time.monotonic_ns()}", RingGeometry(16, 256, 256), "test")
    try:
        prod = ShmProducer(attach_ring(ring.name))
        loop = EngineLoop(runner, cfg, RingConsumer(ring), EngineConfig(block_size=16, max_num_batched_tokens=64,
                                                                        max_num_seqs=8), context_len=512)
        slot = prod.submit(_specs()[0])
        t0 = time.monotonic()
        thread = threading.Thread(target=loop.run)
        thread.start()
        finish = FinishReason.NONE
        while finish is FinishReason.NONE and time.monotonic() - t0 < 60:
            upd = prod.poll(slot)
            finish, code = upd.finish, upd.error_code
            time.sleep(0.01)
        loop.stop_event.set()
        thread.join(timeout=30)
        assert finish is FinishReason.ERROR and code is ErrorCode.ENGINE_STOPPING
        assert loop.failed and "rank 0 waited" in loop.failed
        assert runner.comm.fault == 1
    finally:
        ring.close()


def test_a_follower_loop_that_ends_stops_the_persistent_model_and_fails_what_is_in_flight(served):
    cfg, model = _peaky_model()
    runner = _tp_runner(cfg, model, 2, keep_graphs=True, timeout_s=1.0)
    s = served(runner, cfg, tp=runner, watch_interval_s=0.05)
    long = _specs()[0].__class__(0, [5, 6, 7], 200, temperature=0.0, ignore_eos=True)
    (slot,) = s.submit([long])
    s.engine.start()
    s.wait(lambda: len(s.tokens[slot]) > 0)
    runner.comm.set_stop(True)  # rank 1's loop leaves at its next wait, as if its GPU had gone: the leader's
    #                             next all-reduce waits for it (1 s here) while the watcher sees the loop ended
    watcher = threading.Thread(target=s.engine._watch)
    watcher.start()
    watcher.join(timeout=30)
    assert not watcher.is_alive()
    assert s.engine.failed and "rank 1" in s.engine.failed
    s.engine.shutdown()
    s.wait(lambda: slot in s.finishes)
    assert s.finishes[slot][0] is FinishReason.ERROR
    assert len(s.tokens[slot]) < 200
