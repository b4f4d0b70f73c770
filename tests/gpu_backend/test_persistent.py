"""The `persistent` engine (the GPU-resident loop) on a CUDA GPU: run on the device machine, skipped elsewhere.

- for the same seeded requests it gives the host engine's tokens, bit for bit (same scheduler decisions,
  same bucket graphs), with the scheduler's state in shared memory and, for a ring too big for it, in
  global memory; steady decoding takes the speculation (step n+1 scheduled while step n runs), and steps
  that must preempt drop it for the full step, with the same tokens; a stop token costs its sequence one
  dropped row of the next step (the asynchronous take), or with BLINK_LOOP_ASYNC=0 drops the speculation;
- cancelling mid-generation returns every KV block (device scheduler state and the ring's stats);
- a prompt the context cannot hold is refused with PROMPT_TOO_LONG while other requests run;
- built without the sampling extensions (--no-sampling-extensions), the loop refuses penalties, logit bias and
  logprobs with INVALID_PARAMS (test_persistent_extensions.py has them served);
- shutdown with requests in flight reports each of them failed (ENGINE_STOPPING), none is left open;
- idle, the loop keeps its heartbeat fresh;
- live: `blink serve --mode persistent` with a ring of 4 slots answers a burst of 12 concurrent requests, then
  the same 12 streamed (the same texts).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

from test_gpu_runner import _drive, _peaky_model, _specs  # noqa: E402
from gpu_backend.engine.loop import EngineConfig  # noqa: E402
from gpu_backend.engine.graph_variant import GraphVariant  # noqa: E402
from protocols.ring import EngineState, ErrorCode, FinishReason, RequestSpec, RingGeometry  # noqa: E402
from protocols.shm import attach_ring, create_ring  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = EngineConfig(block_size=16, max_num_batched_tokens=64, max_num_seqs=8)


def _runner(model, cfg):
    from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig

    return GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                                 context_len=512, num_kv_blocks=96, sampling_extensions=False),
                     progress=False, keep_graphs=True)


class Served:
    """A persistent engine over a fresh ring, with a producer; always shut down before the ring closes."""

    def __init__(self, runner, cfg, geometry=RingGeometry(16, 256, 256), **engine_kw):
        from gpu_backend.engine.persistent import PersistentEngine

        self.ring = create_ring(f"blink-persistent-test-{os.getpid()}", geometry, "test")
        self.prod = ShmProducer(attach_ring(self.ring.name))
        self.engine = PersistentEngine(runner, cfg, self.ring, CONFIG, context_len=512, **engine_kw)
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}  # per token, when a request asked (test_persistent_extensions.py)
        self.finishes: dict[int, tuple[FinishReason, ErrorCode]] = {}

    def submit(self, specs) -> list[int]:
        slots = [self.prod.submit(s) for s in specs]
        for s in slots:
            self.tokens[s] = []
            self.logprobs[s] = []
        return slots

    def poll(self) -> None:
        for s in self.tokens:
            if s not in self.finishes:
                upd = self.prod.poll(s)
                self.tokens[s] += upd.tokens
                self.logprobs[s] += upd.logprobs
                if upd.finish is not FinishReason.NONE:
                    self.finishes[s] = (upd.finish, upd.error_code)

    def wait(self, until, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            self.poll()
            assert time.monotonic() < deadline, f"no progress: {self.finishes}, ctl {self.engine.ctl}"
            time.sleep(0.0005)

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self.ring.close()


def serve_to_end(runner, cfg, specs) -> tuple[list[list[int]], list[FinishReason]]:
    """`specs` through a fresh persistent engine until every one ends: (tokens, finish reasons), in order."""
    s = Served(runner, cfg)
    try:
        slots = s.submit(specs)
        s.engine.start()
        s.wait(lambda: len(s.finishes) == len(slots))
        return [s.tokens[x] for x in slots], [s.finishes[x][0] for x in slots]
    finally:
        s.close()


@pytest.fixture
def served():
    opened = []

    def make(*args, **kw) -> Served:
        opened.append(Served(*args, **kw))
        return opened[-1]
    yield make
    for s in opened:
        s.close()


def test_persistent_gives_the_host_engines_tokens_bit_for_bit(served):
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    host_tokens, host_fin, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    s = served(runner, cfg)
    slots = s.submit(_specs())  # queued before the launch: the loop admits them together, as the host engine
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert [s.finishes[x][0] for x in slots] == host_fin == [FinishReason.LENGTH] * 4
    assert [s.tokens[x] for x in slots] == host_tokens
    assert s.engine.smem_bytes > 0  # the step kernel keeps the scheduler's hot state in shared memory
    assert s.engine.take_linked == 4 * len(runner.buckets)  # every branch's take kernel starts after the logits
    s.engine.shutdown()  # the loop's counters are mirrored to the host as it leaves
    ctl = s.engine.final_ctl
    assert ctl["steps"] > 0 and ctl["tokens"] == 4 * 24
    assert ctl["spec_hits"] >= ctl["steps"] // 2  # the decode steps: scheduled while the step before ran


def _same_as_host(served, specs, runner_kw=None):
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    host_tokens, host_fin, _ = _drive(runner, cfg, specs, config=CONFIG)
    s = served(runner, cfg)
    slots = s.submit(specs)
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert [s.finishes[x][0] for x in slots] == host_fin
    assert [s.tokens[x] for x in slots] == host_tokens
    s.engine.shutdown()
    return host_tokens, host_fin, s.engine.final_ctl


def test_a_sampled_stop_token_drops_the_speculation_and_stops_where_the_host_does(served, monkeypatch):
    monkeypatch.setenv("BLINK_LOOP_ASYNC", "0")  # the synchronous take: it sees the tokens before it launches
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    plain, _, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    # each request stops on a token it makes mid-way (at its first occurrence, in both engines)
    specs = [dataclasses.replace(spec, stop_ids=(tokens[6 + 4 * i],)) for i, (spec, tokens) in enumerate(zip(_specs(), plain))]
    tokens, finishes, ctl = _same_as_host(served, specs)
    assert finishes == [FinishReason.STOP] * 4 and all(len(t) < 24 for t in tokens)
    assert ctl["spec_misses"] >= 1 and ctl["spec_hits"] >= 1


def test_the_asynchronous_take_stops_where_the_host_does_and_frees_every_block(served, monkeypatch):
    """The asynchronous take (the default): each step is launched before the step before it has its tokens, so
    a stop token does not drop the speculation; the stopped sequence's row of the next step is computed and
    dropped."""
    monkeypatch.delenv("BLINK_LOOP_ASYNC", raising=False)
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    plain, _, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    specs = [dataclasses.replace(spec, stop_ids=(tokens[6 + 4 * i],)) for i, (spec, tokens) in enumerate(zip(_specs(), plain))]
    host_tokens, host_fin, _ = _drive(runner, cfg, specs, config=CONFIG)
    s = served(runner, cfg)
    slots = s.submit(specs)
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert [s.finishes[x][0] for x in slots] == host_fin == [FinishReason.STOP] * 4
    assert [s.tokens[x] for x in slots] == host_tokens
    s.engine.shutdown()
    ctl = s.engine.final_ctl
    assert ctl["tokens"] == sum(map(len, host_tokens))  # the dropped rows are not counted as tokens
    # four stops on four different steps: the synchronous take drops four speculations; this one only the
    # last, when nothing is left to run
    assert ctl["spec_misses"] <= 1 and ctl["spec_hits"] >= 10
    header = s.engine.scheduler_header()
    assert header.num_free == runner.num_blocks and header.num_running == header.num_waiting == 0
    assert s.ring.stats()["free_kv_blocks"] == runner.num_blocks


def test_steps_that_preempt_are_the_full_steps_with_the_hosts_tokens(served):
    """Six 300-token sequences need 114 of the 96 KV blocks: the scheduler preempts (recompute)."""
    gen = __import__("random").Random(5)
    specs = [RequestSpec(i, [gen.randrange(3, 512) for _ in range(200)], 100, temperature=0.0, ignore_eos=True)
             for i in range(6)]
    tokens, finishes, ctl = _same_as_host(served, specs)
    assert finishes == [FinishReason.LENGTH] * 6 and all(len(t) == 100 for t in tokens)
    assert ctl["spec_misses"] >= 1 and ctl["spec_hits"] >= 1


def test_a_ring_too_big_for_shared_memory_runs_from_global_memory(served):
    """2,048 slots of scheduler state do not fit in one block's shared memory: same tokens regardless."""
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    host_tokens, _, _ = _drive(runner, cfg, _specs(), config=CONFIG)
    s = served(runner, cfg, RingGeometry(2048, 256, 256))
    slots = s.submit(_specs())
    s.engine.start()
    s.wait(lambda: len(s.finishes) == len(slots))
    assert s.engine.smem_bytes == 0
    assert [s.tokens[x] for x in slots] == host_tokens


def test_cancel_mid_generation_returns_every_block(served):
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    s = served(runner, cfg)
    specs = [RequestSpec(i, list(range(3, 3 + 30 * (i + 1))), 200, temperature=0.0, ignore_eos=True) for i in range(4)]
    slots = s.submit(specs)
    s.engine.start()
    s.wait(lambda: all(len(s.tokens[slots[i]]) >= 10 for i in (0, 2)))
    for i in (0, 2):
        s.prod.cancel(slots[i])
    s.wait(lambda: len(s.finishes) == 4)
    assert [s.finishes[x][0] for x in slots] == [FinishReason.CANCELLED, FinishReason.LENGTH] * 2
    assert len(s.tokens[slots[0]]) < 200 and len(s.tokens[slots[1]]) == 200
    s.engine.shutdown()
    assert s.ring.stats()["free_kv_blocks"] == runner.num_blocks
    header = s.engine.scheduler_header()
    assert header.num_free == runner.num_blocks and header.num_running == header.num_waiting == 0


def test_prompt_longer_than_the_context_is_refused_and_others_run(served):
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    s = served(runner, cfg, RingGeometry(8, 600, 64))
    s.engine.start()
    too_long, ok = s.submit([RequestSpec(0, [5] * 520, 4, temperature=0.0),
                             RequestSpec(1, [5, 6, 7], 8, temperature=0.0, ignore_eos=True)])
    s.wait(lambda: len(s.finishes) == 2)
    assert s.finishes[too_long] == (FinishReason.ERROR, ErrorCode.PROMPT_TOO_LONG) and s.tokens[too_long] == []
    assert s.finishes[ok][0] is FinishReason.LENGTH and len(s.tokens[ok]) == 8


def test_sampling_extensions_are_refused_and_others_run(served):
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    assert {v for _, v in runner.graphs} == {GraphVariant.SAMPLE, GraphVariant.GREEDY}  # no LOGITS graphs: never used here
    assert runner.logits_dev is None and not runner.sampling_extensions
    s = served(runner, cfg)
    s.engine.start()
    asks = [dict(num_logprobs=0), dict(presence_penalty=0.5), dict(frequency_penalty=-1.0),
            dict(repetition_penalty=1.2), dict(logit_bias=((5, 1.0),))]
    refused = s.submit([RequestSpec(i, [5, 6, 7], 4, temperature=0.0, **kw) for i, kw in enumerate(asks)])
    ok, = s.submit([RequestSpec(9, [5, 6, 7], 8, temperature=0.0, ignore_eos=True, repetition_penalty=1.0)])
    s.wait(lambda: len(s.finishes) == len(asks) + 1)
    assert all(s.finishes[x] == (FinishReason.ERROR, ErrorCode.INVALID_PARAMS) and s.tokens[x] == [] for x in refused)
    assert s.finishes[ok][0] is FinishReason.LENGTH and len(s.tokens[ok]) == 8


def test_shutdown_with_requests_in_flight_reports_each_failed(served):
    cfg, model = _peaky_model()
    runner = _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg)
    s = served(runner, cfg)
    slots = s.submit([RequestSpec(i, [3 + i] * 20, 250, temperature=0.0, ignore_eos=True) for i in range(3)])
    s.engine.start()
    s.wait(lambda: all(len(s.tokens[x]) >= 5 for x in slots))
    s.engine.shutdown()
    s.poll()
    assert {s.finishes[x] for x in slots} == {(FinishReason.ERROR, ErrorCode.ENGINE_STOPPING)}
    assert s.ring.engine_state is EngineState.STOPPED and s.engine.ctl.exited == 1
    assert s.ring.stats()["free_kv_blocks"] == runner.num_blocks


def test_idle_loop_keeps_its_heartbeat_fresh(served):
    cfg, model = _peaky_model()
    s = served(_runner(model.to(device="cuda", dtype=torch.bfloat16), cfg), cfg)
    s.engine.start()
    time.sleep(0.05)
    beat = s.ring.heartbeat
    time.sleep(0.3)
    assert s.ring.heartbeat - beat >= 50  # a beat per millisecond while idle
    assert s.ring.engine_state is EngineState.SERVING and s.engine.ctl.idle_polls > 0


def test_live_serve_answers_a_burst_larger_than_the_ring():
    from openai import OpenAI

    from tests.conftest import _wait_health, free_port

    port, control = free_port(), f"127.0.0.1:{free_port()}"
    env = {**os.environ, "BLINK_API_KEY": "k", "BLINK_GRPC_PORT": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--mode", "persistent", "--model", "random:smollm2-135m",
           "--port", str(port), "--control", control, "--ring", f"blink-persistent-live-{os.getpid()}",
           "--context-len", "512", "--num-slots", "4", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
           "--num-kv-blocks", "256"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout_s=600)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def one(i: int):
            return client.completions.create(model=model, prompt=f"request {i}", max_tokens=16, temperature=0.0,
                                             extra_body={"ignore_eos": True})

        def streamed(i: int):  # the gateway's native round delivers these (the GPU writes the ring)
            chunks = list(client.completions.create(
                model=model, prompt=f"request {i}", max_tokens=16, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
            streams = list(pool.map(streamed, range(12)))
        assert [r.usage.completion_tokens for r in results] == [16] * 12
        assert all(r.choices[0].finish_reason == "length" for r in results)
        # Each streamed token arrived once, in order: one `wN` word per token (random weights give near-ties, so
        # the burst's batches, which differ run to run, may pick other words than the first burst's).
        assert all(re.fullmatch(r"( w\d+){16}", text) and n == 16 for text, n in streams), streams
        # One at a time (batches of one, the same kernels), streamed and not give the same text.
        assert [streamed(i) for i in range(3)] == [(one(i).choices[0].text, 16) for i in range(3)]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
