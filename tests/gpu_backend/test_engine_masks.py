"""Token masks in the `cpu` engine (EngineLoop + CpuRunner over a real shm ring, random weights): a
constrained request gets exactly the tokens its masks allow, whatever the model prefers; a row whose mask
has not come waits (samples nothing, publishes nothing) while an unconstrained row beside it goes on; a
mask that allows nothing ends the request with INVALID_PARAMS; the sampler applies masks after the bias."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from conftest_models import tiny_cfg
from gpu_backend.engine.cpu_runner import CpuRunner
from gpu_backend.engine.loop import EngineConfig, EngineLoop
from gpu_backend.engine.sampler import (SamplingRow, apply_masks, mask_allows_some, mask_bits, sample_step,
                                        unpack_mask_words)
from gpu_backend.models import LlamaModel
from kernels import sched_host
from kernels.sched_layout import TOKEN_MASK_EMPTY, TOKEN_WAIT
from protocols.ring import ErrorCode, FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

if sched_host.host_compiler() is None:
    pytest.skip("no C++ compiler on PATH: the native scheduler cannot be built", allow_module_level=True)

CONTEXT_LEN, VOCAB = 64, 97
MASK_WORDS = -(-VOCAB // 32)
_rings = itertools.count()


def mask_of(*allowed: int) -> np.ndarray:
    words = np.zeros(MASK_WORDS, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


@pytest.fixture(scope="module")
def model():
    cfg = tiny_cfg("llama", max_position_embeddings=CONTEXT_LEN, vocab_size=VOCAB)
    torch.manual_seed(0)
    return cfg, LlamaModel(cfg).eval()


class Engine:
    """An EngineLoop stepped by hand, a producer on the gateway's side, and what it read per slot."""

    def __init__(self, model):
        cfg, m = model
        geometry = RingGeometry(4, CONTEXT_LEN, 16, mask_words=MASK_WORDS)
        self.ring = create_ring(f"blink-mask-engine-{os.getpid()}-{next(_rings)}", geometry, "test")
        self.prod = ShmProducer(attach_ring(self.ring.name))
        runner = CpuRunner(m, cfg, 32, 4, context_len=CONTEXT_LEN, max_num_batched_tokens=16, max_num_seqs=4)
        config = EngineConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
        self.loop = EngineLoop(runner, cfg, RingConsumer(self.ring), config, CONTEXT_LEN)
        self.tokens: dict[int, list[int]] = {}
        self.finishes: dict[int, tuple[FinishReason, ErrorCode]] = {}

    def submit(self, spec: RequestSpec) -> int:
        slot = self.prod.submit(spec)
        self.tokens[slot] = []
        return slot

    def step(self) -> None:
        self.loop.step()
        for slot in [s for s in self.tokens if s not in self.finishes]:
            update = self.prod.poll(slot)
            self.tokens[slot] += update.tokens
            if update.finish is not FinishReason.NONE:
                self.finishes[slot] = (update.finish, update.error_code)

    def close(self) -> None:
        self.loop.shutdown()
        self.prod.close()
        self.ring.close()


@pytest.fixture
def engine(model):
    e = Engine(model)
    yield e
    e.close()


def test_masks_force_a_fixed_sequence_sampled_or_greedy(engine):
    wanted = [17, 3, 90, 64, 31, 32]
    slots = [engine.submit(RequestSpec(request_id=i, prompt_ids=[5, 6, 7], max_tokens=len(wanted), temperature=t,
                                       seed=i, ignore_eos=True, token_mask=mask_of(wanted[0])))
             for i, t in enumerate((0.0, 1.0, 1.5))]
    for _ in range(40):
        for slot in slots:  # the gateway's part: mask i + 1 once token i was read
            n = len(engine.tokens[slot])
            if 0 < n < len(wanted) and slot not in engine.finishes:
                engine.prod.put_mask(slot, n, mask_of(wanted[n]))
        engine.step()
        if len(engine.finishes) == len(slots):
            break
    for slot in slots:
        assert engine.tokens[slot] == wanted
        assert engine.finishes[slot] == (FinishReason.LENGTH, ErrorCode.NONE)
    assert engine.loop.scheduler.num_free == engine.loop.scheduler.num_blocks


def test_a_late_mask_makes_its_row_wait_while_the_other_row_goes_on(engine):
    free = engine.submit(RequestSpec(request_id=1, prompt_ids=[4, 5], max_tokens=8, temperature=0.0, ignore_eos=True))
    held = engine.submit(RequestSpec(request_id=2, prompt_ids=[4, 5], max_tokens=3, temperature=0.0, ignore_eos=True,
                                     token_mask=mask_of(11, 12)))
    engine.step()
    assert len(engine.tokens[free]) == 1 and engine.tokens[held][0] in (11, 12)
    for _ in range(4):  # mask 1 is late: the held row samples nothing, the free row goes on
        engine.step()
        assert len(engine.tokens[held]) == 1
    assert len(engine.tokens[free]) == 5
    engine.prod.put_mask(held, 1, mask_of(40))
    engine.step()
    assert engine.tokens[held][1:] == [40]
    engine.prod.put_mask(held, 2, mask_of(41))
    engine.step()
    assert engine.tokens[held][1:] == [40, 41] and engine.finishes[held] == (FinishReason.LENGTH, ErrorCode.NONE)


def test_a_waiting_row_can_be_cancelled(engine):
    held = engine.submit(RequestSpec(request_id=3, prompt_ids=[8], max_tokens=5, token_mask=mask_of(9)))
    engine.step()
    engine.step()
    engine.prod.cancel(held)
    engine.step()
    assert engine.tokens[held] == [9] and engine.finishes[held] == (FinishReason.CANCELLED, ErrorCode.NONE)
    assert engine.loop.scheduler.num_free == engine.loop.scheduler.num_blocks


def test_an_empty_mask_ends_the_request_with_invalid_params(engine):
    empty = engine.submit(RequestSpec(request_id=4, prompt_ids=[8, 9], max_tokens=5, token_mask=mask_of()))
    later = engine.submit(RequestSpec(request_id=5, prompt_ids=[8, 9], max_tokens=5, token_mask=mask_of(3)))
    engine.step()
    engine.prod.put_mask(later, 1, mask_of())
    engine.step()
    assert engine.finishes[empty] == (FinishReason.ERROR, ErrorCode.INVALID_PARAMS) and engine.tokens[empty] == []
    assert engine.finishes[later] == (FinishReason.ERROR, ErrorCode.INVALID_PARAMS) and engine.tokens[later] == [3]
    assert engine.loop.scheduler.num_free == engine.loop.scheduler.num_blocks


def test_the_mask_applies_after_the_bias_and_before_the_draw():
    logits = torch.zeros(4, VOCAB)
    logits[:, 50] = 10.0  # the model's favourite, allowed by no mask
    biased = SamplingRow(0.0, 1.0, 0, 0.0, seed=1, position=3, logit_bias=((7, -5.0),),
                         constrained=True, token_mask=mask_of(7, 8))
    sampled = SamplingRow(1.0, 1.0, 0, 0.0, seed=2, position=3, constrained=True, token_mask=mask_of(96))
    free = SamplingRow(0.0, 1.0, 0, 0.0, seed=3, position=3)
    tokens, _ = sample_step(logits[:3], [biased, sampled, free])
    assert tokens == [8, 96, 50]  # 7 allowed, but the bias put it below 8
    waiting = SamplingRow(0.0, 1.0, 0, 0.0, seed=1, position=3, constrained=True)
    empty = SamplingRow(0.0, 1.0, 0, 0.0, seed=1, position=3, constrained=True, token_mask=mask_of())
    past_vocab = SamplingRow(0.0, 1.0, 0, 0.0, seed=1, position=3, constrained=True,
                             token_mask=mask_of(127))  # past a 97-token vocabulary
    assert sample_step(logits, [waiting, empty, free, past_vocab])[0] == [TOKEN_WAIT, TOKEN_MASK_EMPTY, 50,
                                                                            TOKEN_MASK_EMPTY]
    view = logits[:1]
    same, none = apply_masks(view, [free])
    assert same is view and none == {}  # no constrained row: no copy


def test_mask_bits_read_bit_t_mod_32_of_word_t_div_32_and_nothing_past_the_words():
    bits = mask_bits(np.stack([mask_of(0, 31, 32, 96), mask_of()]), 100)
    assert bits.shape == (2, 100) and np.flatnonzero(bits[0].numpy()).tolist() == [0, 31, 32, 96] and not bits[1].any()
    assert mask_allows_some(np.stack([mask_of(0, 31, 32, 96), mask_of(), mask_of(127)]), 100).tolist() == \
        [True, False, False]  # 127 is past a 100-token vocabulary
    assert not mask_bits(np.stack([mask_of(127)]), 100).any()
    # against numpy's own unpacking, every bit of random words (bit 31 of a word is an int32's sign)
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, size=(5, 8), dtype=np.uint64).astype(np.uint32)
    want = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :250].astype(bool)
    assert np.array_equal(mask_bits(words, 250).numpy(), want)
    # the unpacking a GPU runs (shifts of int32 words), here on the CPU; past the words: nothing allowed
    assert np.array_equal(unpack_mask_words(torch.from_numpy(words.view(np.int32)), 250).numpy(), want)
    assert not unpack_mask_words(torch.from_numpy(words.view(np.int32)), 300)[:, 256:].any()
    assert np.array_equal(mask_allows_some(words, 250), want.any(axis=1))
