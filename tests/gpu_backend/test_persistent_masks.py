"""Token masks in the `host` and `persistent` engines (run on the device machine, skipped elsewhere): the
gateway's part is played here (mask i + 1 written after token i was read).

- both engines keep every token inside its mask, and greedy rows get the same tokens in both;
- the persistent loop applies the masks on the device: the host's mask path (sampler.apply_masks) and the
  runner's host step never run while it serves;
- a late mask makes its row wait in the loop (nothing published past it) while a plain row goes on;
- an empty mask ends the request with INVALID_PARAMS.
Each persistent test runs with masked steps speculated past (LoopOptions.spec_masked) and without.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

from test_persistent import CONFIG, Served  # noqa: E402
from test_persistent_extensions import _runner  # noqa: E402
from test_gpu_runner import _peaky_model  # noqa: E402
from protocols.ring import ErrorCode, FinishReason, RequestSpec, RingGeometry  # noqa: E402
from protocols.shm import attach_ring, create_ring  # noqa: E402
from protocols.shm_consumer import RingConsumer  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402

VOCAB = 512
GEOMETRY = RingGeometry(16, 256, 256, mask_words=VOCAB // 32)


@pytest.fixture(params=[False, True], ids=["no-spec-masked", "spec-masked"])
def loop_kw(request) -> dict:
    """The persistent engine's loop options: masked steps speculated past (spec_masked) or not."""
    from kernels.persistent_loop import LoopOptions

    return {"loop_options": LoopOptions(spec_masked=request.param)}


@pytest.fixture(scope="module")
def runner_cfg():
    cfg, model = _peaky_model()
    return _runner(model.to(device="cuda", dtype=torch.bfloat16), cfg), cfg


def mask_for(request: int, index: int) -> np.ndarray:
    """Request `request`'s mask for token `index`: a pseudo-random half of the vocabulary (a single token
    every fifth index), the same in every run."""
    rng = np.random.default_rng(1000 * request + index)
    allowed = rng.random(VOCAB) < 0.5 if index % 5 else np.arange(VOCAB) == rng.integers(VOCAB)
    return np.packbits(allowed, bitorder="little").view("<u4").copy()


def allowed(words: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist())


def specs() -> list[RequestSpec]:
    return [RequestSpec(r, [5 + r, 9, 7, 3 * r + 1], 20, temperature=0.0 if r % 2 == 0 else 0.9, seed=r,
                        ignore_eos=True, token_mask=mask_for(r, 0)) for r in range(4)] + \
           [RequestSpec(9, [4, 5, 6], 20, temperature=0.0, ignore_eos=True)]


def feed_masks(prod: ShmProducer, slots: list[int], tokens: dict[int, list[int]], sent: dict[int, int],
               finished) -> None:
    """The gateway's part: mask i + 1 once token i was read (constrained requests are the first four)."""
    for r, slot in enumerate(slots[:4]):
        n = len(tokens[slot])
        if sent.get(slot, 0) < n < 20 and slot not in finished:
            prod.put_mask(slot, n, mask_for(r, n))
            sent[slot] = n


def run_host(runner, cfg) -> list[list[int]]:
    from gpu_backend.engine.loop import EngineLoop
    from gpu_backend.engine.sampler import PromptCache

    runner._prompts = PromptCache()
    ring = create_ring(f"blink-gpu-mask-{os.getpid()}", GEOMETRY, "test")
    try:
        prod = ShmProducer(attach_ring(ring.name))
        loop = EngineLoop(runner, cfg, RingConsumer(ring), CONFIG, context_len=512)
        slots = [prod.submit(s) for s in specs()]
        tokens, finishes, sent = {s: [] for s in slots}, {}, {}
        for _ in range(2000):
            loop.step()
            for s in slots:
                if s not in finishes:
                    upd = prod.poll(s)
                    tokens[s] += upd.tokens
                    if upd.finish is not FinishReason.NONE:
                        finishes[s] = upd.finish
            feed_masks(prod, slots, tokens, sent, finishes)
            if len(finishes) == len(slots):
                break
        assert all(f is FinishReason.LENGTH for f in finishes.values()) and len(finishes) == len(slots)
        return [tokens[s] for s in slots]
    finally:
        ring.close()


def run_persistent(runner, cfg, monkeypatch, **loop_kw) -> tuple[list[list[int]], dict]:
    import gpu_backend.engine.gpu_runner as gpu_runner

    def no_host(*args, **kw):
        raise AssertionError("the persistent loop's masks must not go through the host")
    s = Served(runner, cfg, GEOMETRY, **loop_kw)
    try:
        monkeypatch.setattr(gpu_runner, "apply_masks", no_host)  # the host engine's mask path
        monkeypatch.setattr(type(runner), "run", no_host)  # and its step
        slots = s.submit(specs())
        s.engine.start()
        sent: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while len(s.finishes) < len(slots):
            s.poll()
            feed_masks(s.prod, slots, s.tokens, sent, s.finishes)
            assert time.monotonic() < deadline, f"no progress: {s.finishes}, ctl {s.engine.ctl}"
        assert all(f == (FinishReason.LENGTH, ErrorCode.NONE) for f in s.finishes.values())
        s.engine.shutdown()
        return [s.tokens[x] for x in slots], s.engine.final_ctl
    finally:
        s.close()


def test_host_and_persistent_keep_every_token_in_its_mask_and_agree_on_greedy_rows(runner_cfg, monkeypatch, loop_kw):
    runner, cfg = runner_cfg
    host = run_host(runner, cfg)
    loop, ctl = run_persistent(runner, cfg, monkeypatch, **loop_kw)
    for r in range(4):
        for got in (host[r], loop[r]):
            assert len(got) == 20 and all(t in allowed(mask_for(r, i)) for i, t in enumerate(got)), (r, got)
    assert loop[0] == host[0] and loop[2] == host[2]  # greedy rows
    assert loop[4] == host[4]  # the plain row beside them
    assert ctl["steps"] >= 20


def test_a_late_mask_makes_the_loop_row_wait_while_a_plain_row_goes_on(runner_cfg, loop_kw):
    runner, cfg = runner_cfg
    s = Served(runner, cfg, GEOMETRY, **loop_kw)
    try:
        held, free = s.submit([RequestSpec(0, [5, 6, 7], 4, temperature=0.0, ignore_eos=True,
                                           token_mask=mask_for(0, 0)),
                               RequestSpec(1, [5, 6, 7], 200, temperature=0.0, ignore_eos=True)])
        s.engine.start()
        s.wait(lambda: len(s.tokens[held]) == 1 and len(s.tokens[free]) >= 1)
        before = len(s.tokens[free])
        time.sleep(0.2)  # mask 1 is late: the held row samples nothing, the plain row goes on
        s.poll()
        assert len(s.tokens[held]) == 1 and held not in s.finishes
        assert len(s.tokens[free]) > before + 5
        from kernels.persistent_loop import ctl_values
        assert ctl_values(s.engine.ctl)["mask_waits"] >= 5  # the held row, counted each step it sampled nothing
        for i in range(1, 4):
            s.prod.put_mask(held, i, mask_for(0, i))
            s.wait(lambda: len(s.tokens[held]) == i + 1 or held in s.finishes)
        assert s.finishes[held] == (FinishReason.LENGTH, ErrorCode.NONE)
        assert all(t in allowed(mask_for(0, i)) for i, t in enumerate(s.tokens[held]))
        s.prod.cancel(free)
        s.wait(lambda: free in s.finishes)
    finally:
        s.close()


def test_an_empty_mask_ends_the_loop_request_with_invalid_params(runner_cfg, loop_kw):
    runner, cfg = runner_cfg
    s = Served(runner, cfg, GEOMETRY, **loop_kw)
    try:
        slot, = s.submit([RequestSpec(0, [5, 6, 7], 4, temperature=0.0, ignore_eos=True,
                                      token_mask=np.zeros(VOCAB // 32, dtype=np.uint32))])
        s.engine.start()
        s.wait(lambda: slot in s.finishes)
        assert s.finishes[slot] == (FinishReason.ERROR, ErrorCode.INVALID_PARAMS) and s.tokens[slot] == []
    finally:
        s.close()
