"""The `cpu` engine in process: EngineLoop + CpuRunner over a real shm ring, scheduled by the native scheduler
(the C++ step the GPU loop runs) with the step buffer filled by its C fill.

- greedy tokens equal an independent eager generator's (models/generate.py) on the same weights;
- a KV pool small enough to force preemption (recompute) gives the same tokens as a large one;
- stop ids, EOS, max_tokens, cancels, priorities, logprobs, admission errors and shutdown keep their
  meaning; every KV block is back in the pool at the end;
- nothing under gpu_backend/ imports the reference scheduler (it lives in the tests as an oracle).
"""
from __future__ import annotations

import ast
import dataclasses
import itertools
import os
from pathlib import Path

import pytest
import torch

from conftest_models import tiny_cfg
from gpu_backend.engine.cpu_runner import CpuRunner
from gpu_backend.engine.loop import EngineConfig, EngineLoop
from gpu_backend.engine.sched_native import NativeScheduler
from gpu_backend.models import LlamaModel, greedy_generate
from kernels import sched_host
from protocols.ring import ErrorCode, FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

if sched_host.host_compiler() is None:
    pytest.skip("no C++ compiler on PATH: the native scheduler cannot be built", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CONTEXT_LEN = 128
_rings = itertools.count()


@pytest.fixture(scope="module")
def model():
    cfg = tiny_cfg("llama", max_position_embeddings=CONTEXT_LEN)
    torch.manual_seed(0)
    m = LlamaModel(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # peaky logits: greedy choices far from ties
    return cfg, m


class Engine:
    """An EngineLoop on a fresh ring, stepped by hand, with a producer on the gateway's side."""

    def __init__(self, model, num_blocks: int = 64, budget: int = 16, max_seqs: int = 4, block_size: int = 4,
                 eos: tuple[int, ...] | None = None, runner_cls=CpuRunner, caching: bool = True):
        self.cfg, m = model
        if eos is not None:
            self.cfg = dataclasses.replace(self.cfg, eos_token_ids=eos)
        self.ring = create_ring(f"blink-engine-test-{os.getpid()}-{next(_rings)}",
                                RingGeometry(8, CONTEXT_LEN, 64, kv_block_size=block_size), "test")
        self.prod = ShmProducer(attach_ring(self.ring.name))
        self.runner = runner_cls(m, self.cfg, num_blocks, block_size, context_len=CONTEXT_LEN,
                                max_num_batched_tokens=budget, max_num_seqs=max_seqs)
        self.loop = EngineLoop(self.runner, self.cfg, RingConsumer(self.ring),
                               EngineConfig(block_size=block_size, max_num_batched_tokens=budget,
                                            max_num_seqs=max_seqs, enable_prefix_caching=caching), CONTEXT_LEN)
        self.tokens, self.logprobs, self.finishes, self.errors, self.cached = {}, {}, {}, {}, {}

    def submit(self, spec: RequestSpec) -> int:
        slot = self.prod.submit(spec)
        self.tokens[slot], self.logprobs[slot] = [], []
        return slot

    def poll(self) -> None:
        for slot in [s for s in self.tokens if s not in self.finishes]:
            upd = self.prod.poll(slot)
            self.tokens[slot] += upd.tokens
            self.logprobs[slot] += upd.logprobs
            if upd.tokens:
                self.cached[slot] = upd.cached_tokens
            if upd.finish is not FinishReason.NONE:
                self.finishes[slot], self.errors[slot] = upd.finish, upd.error_code

    def run_until_done(self, max_steps: int = 2000, on_step=None) -> int:
        for steps in range(max_steps):
            self.loop.step()
            if on_step:
                on_step(steps)
            self.poll()
            if len(self.finishes) == len(self.tokens):
                return steps
        raise AssertionError("the engine made no progress")

    def close(self) -> None:
        self.ring.close()


@pytest.fixture
def engine(model):
    made = []

    def make(**kw) -> Engine:
        made.append(Engine(model, **kw))
        return made[-1]
    yield make
    for e in made:
        e.close()


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(length),), generator=gen).tolist()
            for length in torch.randint(3, 40, (n,), generator=gen)]


def test_greedy_tokens_equal_an_independent_generator(model, engine):
    cfg, m = model
    prompts = _prompts(5, cfg.vocab_size)
    want = greedy_generate(m, prompts, 12, block_size=4)
    e = engine()
    slots = [e.submit(RequestSpec(i, p, 12, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    e.run_until_done()
    assert [e.tokens[s] for s in slots] == want
    assert all(e.finishes[s] is FinishReason.LENGTH for s in slots)
    assert e.loop.scheduler.num_free == e.runner.num_blocks and not e.loop.live


def test_preemption_by_recompute_keeps_the_tokens(model, engine):
    cfg, _ = model
    specs = [RequestSpec(i, p, 20, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
             for i, p in enumerate(_prompts(6, cfg.vocab_size, seed=1))]
    roomy, tight = engine(num_blocks=128), engine(num_blocks=16)
    got = []
    for e in (roomy, tight):
        slots = [e.submit(s) for s in specs]
        e.run_until_done()
        got.append([e.tokens[s] for s in slots])
    assert got[0] == got[1] and all(len(t) == 20 for t in got[0])
    preempted = tight.loop.scheduler.a["num_preemptions"]
    assert preempted.sum() > 0, "the small pool was meant to force preemption"
    assert tight.loop.scheduler.num_free == 16


def test_stop_ids_eos_cancel_and_logprobs(model, engine):
    cfg, m = model
    prompt = _prompts(1, cfg.vocab_size, seed=2)[0]
    free = greedy_generate(m, [prompt], 8, block_size=4)[0]
    e = engine()
    stop = e.submit(RequestSpec(0, prompt, 8, temperature=0.0, stop_ids=(free[3],), ignore_eos=True))
    lp = e.submit(RequestSpec(2, prompt, 8, temperature=0.0, ignore_eos=True, num_logprobs=3))
    cancelled = e.submit(RequestSpec(3, prompt, 1000, temperature=0.0, ignore_eos=True))
    plain = e.submit(RequestSpec(1, prompt, 8, temperature=0.0, ignore_eos=True))
    e.run_until_done(on_step=lambda i: i == 15 and e.prod.cancel(cancelled))
    first_stop = free.index(free[3])
    assert e.tokens[stop] == free[:first_stop] and e.finishes[stop] is FinishReason.STOP
    assert e.tokens[plain] == free and e.finishes[plain] is FinishReason.LENGTH
    assert e.finishes[cancelled] is FinishReason.CANCELLED and 0 < len(e.tokens[cancelled]) < 100
    assert e.tokens[lp] == free and len(e.logprobs[lp]) == 8
    assert all(len(x.top) == 3 and x.top[0][0] == t for x, t in zip(e.logprobs[lp], free))
    assert e.loop.scheduler.num_free == e.runner.num_blocks


def test_eos_finishes_with_stop_unless_ignored(model, engine):
    cfg, m = model
    prompt = _prompts(1, cfg.vocab_size, seed=3)[0]
    free = greedy_generate(m, [prompt], 6, block_size=4)[0]
    e = engine(eos=(free[2],))  # the third greedy token is the model's EOS
    stopped = e.submit(RequestSpec(0, prompt, 6, temperature=0.0))
    ignored = e.submit(RequestSpec(1, prompt, 6, temperature=0.0, ignore_eos=True))
    e.run_until_done()
    assert e.tokens[stopped] == free[: free.index(free[2])] and e.finishes[stopped] is FinishReason.STOP
    assert e.tokens[ignored] == free


def test_priority_class_runs_first(model, engine):
    cfg, _ = model
    e = engine(max_seqs=1)  # one running sequence at a time
    prompts = _prompts(3, cfg.vocab_size, seed=4)
    low = e.submit(RequestSpec(0, prompts[0], 4, temperature=0.0, ignore_eos=True, priority=2))
    mid = e.submit(RequestSpec(1, prompts[1], 4, temperature=0.0, ignore_eos=True, priority=1))
    high = e.submit(RequestSpec(2, prompts[2], 4, temperature=0.0, ignore_eos=True, priority=0))
    done_at = {}
    e.run_until_done(on_step=lambda i: done_at.update({s: i for s in (low, mid, high)
                                                       if e.loop.live.get(s) is None and s not in done_at}))
    assert done_at[high] < done_at[mid] < done_at[low]
    assert all(len(e.tokens[s]) == 4 and e.finishes[s] is FinishReason.LENGTH for s in (low, mid, high))


def test_admission_errors_and_shutdown(model, engine):
    cfg, _ = model
    e = engine(num_blocks=8)  # 8 blocks of 4: 32 tokens of KV at most
    too_long = e.submit(RequestSpec(0, [5] * CONTEXT_LEN, 1))
    no_kv = e.submit(RequestSpec(1, [5] * 20, 30))
    pending = e.submit(RequestSpec(2, [5] * 4, 20, temperature=0.0, ignore_eos=True))
    e.loop.step()
    e.poll()
    assert e.errors[too_long] is ErrorCode.PROMPT_TOO_LONG and e.errors[no_kv] is ErrorCode.NO_KV_CAPACITY
    assert pending not in e.finishes
    e.loop.shutdown()
    e.poll()
    assert e.finishes[pending] is FinishReason.ERROR and e.errors[pending] is ErrorCode.ENGINE_STOPPING
    assert e.loop.scheduler.num_free == 8 and not e.loop.live


def test_every_step_goes_through_the_native_fill(model, engine, monkeypatch):
    cfg, _ = model
    calls = []
    real = NativeScheduler.fill
    monkeypatch.setattr(NativeScheduler, "fill", lambda self, buf, nthreads=1: calls.append(1) or real(self, buf))
    e = engine()
    e.submit(RequestSpec(0, _prompts(1, cfg.vocab_size)[0], 5, temperature=0.0, ignore_eos=True))
    e.run_until_done()
    assert len(calls) == e.loop.steps > 0


def test_no_product_module_imports_the_reference_scheduler():
    assert not (ROOT / "gpu_backend" / "engine" / "scheduler.py").exists()
    for path in (ROOT / "gpu_backend").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if "reference_scheduler" in n or n == "gpu_backend.engine.scheduler"
                   or n.startswith("tests")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_both_runners_call_the_one_forward(model, engine, monkeypatch):
    """The CPU runner goes through llama_forward.decoder_layers (spied); the GPU runner's module calls the
    same function and defines no layer loop of its own (read from its source: no GPU here)."""
    from gpu_backend.engine import cpu_runner, gpu_runner
    from gpu_backend.models import llama_forward

    calls = []
    real = llama_forward.decoder_layers
    monkeypatch.setattr(cpu_runner, "decoder_layers", lambda *a: calls.append(a[1]) or real(*a))
    e = engine()
    e.submit(RequestSpec(0, _prompts(1, model[0].vocab_size)[0], 3, temperature=0.0, ignore_eos=True))
    e.run_until_done()
    assert len(calls) == e.loop.steps and all(w is calls[0] for w in calls)
    tree = ast.parse(Path(gpu_runner.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and n.module == "gpu_backend.models.llama_forward" for a in n.names}
    assert {"decoder_layers", "lm_head_logits", "fuse_weights"} <= imported
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"decoder_layers", "lm_head_logits"} <= called
    # the layer sequence is not written a second time: no loop over the layers in the GPU runner
    loops = [ast.unparse(n.iter) for n in ast.walk(tree) if isinstance(n, ast.For)]
    assert not [it for it in loops if "layers" in it], loops


def test_a_live_slot_submitted_again_replaces_its_request(model, engine):
    """The ring is a trust boundary: a producer that reuses a running slot must not crash the engine."""
    from protocols import ring as R
    from protocols.shm_consumer import TakenRequest

    e = engine()
    prompt = _prompts(1, model[0].vocab_size)[0]
    slot = e.submit(RequestSpec(0, prompt, 50, temperature=0.0, ignore_eos=True))
    e.loop.step()
    seq, spec = e.loop.live[slot].seq + 1, RequestSpec(1, prompt[:5], 3, temperature=0.0)
    words = bytearray(R.REQ_STOP_IDS)  # the slot's fixed part as a producer writes it
    words[:8] = seq.to_bytes(8, "little")
    R.REQUEST_HEAD.pack_into(words, R.REQ_REQUEST_ID, *R.request_head(spec))
    again = TakenRequest(slot, seq, spec, bytes(words))
    e.loop._admit([again])
    assert e.loop.live[slot].seq == again.seq and e.loop.scheduler.num_running + e.loop.scheduler.num_waiting == 1
    for _ in range(20):
        e.loop.step()
    assert not e.loop.live and e.loop.scheduler.num_free == e.runner.num_blocks


def test_penalties_and_logit_bias_read_the_native_token_history(model, engine):
    """The sampler's extensions get each row's prompt and output from the native state (LiveSeq.token_ids)."""
    cfg, m = model
    prompt = _prompts(1, cfg.vocab_size, seed=5)[0]
    free = greedy_generate(m, [prompt], 6, block_size=4)[0]
    e = engine()
    forced = e.submit(RequestSpec(0, prompt, 6, temperature=0.0, ignore_eos=True, logit_bias=((11, 1000.0),),
                                  repetition_penalty=1.5, frequency_penalty=0.5))
    banned = e.submit(RequestSpec(1, prompt, 6, temperature=0.0, ignore_eos=True, logit_bias=((free[0], -1000.0),)))
    # a huge repetition penalty sends every seen token's logit to about 0: greedy then never repeats the
    # prompt or its own output (the tied, scaled head gives plenty of unseen tokens logits of hundreds)
    fresh = e.submit(RequestSpec(2, prompt, 6, temperature=0.0, ignore_eos=True, repetition_penalty=1e6))
    e.run_until_done()
    assert e.tokens[forced] == [11] * 6
    assert e.tokens[banned][0] != free[0] and free[0] not in e.tokens[banned]
    out = e.tokens[fresh]
    assert len(out) == 6 and all(t not in prompt and t not in out[:i] for i, t in enumerate(out)), (prompt, out)
