"""One admission check for every mode (kernels/csrc/include/blink_admit.h): the GPU loop's walk over a raw ring
slot, built for the host (ring_admit_host.cpp), diffed against the cpu engine's admission (EngineLoop: the same
header through the host library, on the words and arrays RingConsumer copied) on the same ring words: every
request the fuzzer writes gets the same error code from both (host = persistent, bit for bit), and the
submission-queue and output-room rules agree with RingConsumer's. Runs in CI (no GPU); the loop's own run
under compute-sanitizer is tests/gpu_backend/test_ring_fuzz_gpu.py.

BLINK_FUZZ_ADMIT_REQUESTS sets how many requests each engine shape gets (default 4,000); BLINK_FUZZ_SEED the
seed (default 27).
"""
from __future__ import annotations

import ctypes
import os
import random

import pytest
import torch

from conftest_models import tiny_cfg
from gpu_backend.engine.cpu_runner import CpuRunner
from gpu_backend.engine.loop import EngineConfig, EngineLoop
from gpu_backend.engine.sched_native import admit_limits
from gpu_backend.models import LlamaModel
from kernels import sched_host
from protocols import ring as R
from protocols.ring import ErrorCode, RequestSpec
from protocols.shm_consumer import RingConsumer
from test_ring_fuzz import GEOMETRY, RANDOM_WORDS, SEED, FuzzEngine, _base_spec, _corruptions

if sched_host.host_compiler() is None:
    pytest.skip("no C++ compiler on PATH: the admission checks cannot be built", allow_module_level=True)

NUM_REQUESTS = int(os.environ.get("BLINK_FUZZ_ADMIT_REQUESTS", "4000"))
MODEL_CONTEXT = 64
SOURCE = os.path.join(os.path.dirname(__file__), "ring_admit_host.cpp")
U32, U64 = (1 << 32) - 1, (1 << 64) - 1


@pytest.fixture(scope="module")
def lib():
    include = sched_host.CSRC / "include"
    sources = (sched_host.Path(SOURCE), *(include / n for n in (
        "blink_admit.h", "blink_sched.h", "blink_sched_layout.h", "blink_step_layout.h", "blink_ring.h",
        "blink_ring_layout.h")))
    path = sched_host.cached_build("ring_admit_host", sources,
                                   [sched_host.host_compiler(), *sched_host.FLAGS, "-I", str(include), SOURCE])
    lib = ctypes.CDLL(str(path))
    p, u32, u64, i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32
    for name, restype, argtypes in (("blink_admit_ring_error", i32, [p, p, p, u64, p, u64, i32]),
                                    ("blink_admit_host_first", u64, [u64, u64, u32]),
                                    ("blink_admit_host_end", u64, [u64, u64]),
                                    ("blink_admit_host_room", i32, [i32, u32, u32])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@pytest.fixture(scope="module")
def model():
    cfg = tiny_cfg("llama", max_position_embeddings=MODEL_CONTEXT)
    torch.manual_seed(0)
    return cfg, LlamaModel(cfg).eval()


def _engine(model, context_len: int, num_blocks: int, extensions: bool) -> FuzzEngine:
    """The fuzzer's ring and raw writer, with an EngineLoop of the given context, KV blocks and extensions
    (a short context and few blocks make PROMPT_TOO_LONG and NO_KV_CAPACITY reachable)."""
    e = FuzzEngine(model)
    cfg, m = model
    runner = CpuRunner(m, cfg, num_blocks, 4, context_len=context_len, max_num_batched_tokens=16, max_num_seqs=4)
    runner.sampling_extensions = extensions
    e.loop = EngineLoop(runner, cfg, RingConsumer(e.ring), EngineConfig(block_size=4, max_num_batched_tokens=16,
                                                                        max_num_seqs=4), context_len)
    return e


def _device_error(lib, e: FuzzEngine, slot: int) -> ErrorCode:
    """What the loop's admission decides for the words now in `slot`."""
    ring, g = e.ring, GEOMETRY
    limits = admit_limits(g, e.cfg.vocab_size)
    base = ring.buf.ctypes.data
    code = lib.blink_admit_ring_error(e.loop.scheduler.state.ctypes.data, ctypes.byref(limits), base + ring.req(slot),
                                      g.prompt_offset, base + ring.bias(slot), g.logit_bias_bytes,
                                      int(e.loop.extensions))
    return ErrorCode(code)


def _host_error(e: FuzzEngine, slot: int) -> ErrorCode:
    """What the host engines decide: EngineLoop's admission of what RingConsumer read."""
    e.queue(slot)
    (taken,) = e.loop.consumer.take_new()
    assert taken.slot == slot
    return e.loop._admission_error(taken)


def _spec(rng: random.Random, vocab: int) -> RequestSpec:
    """A valid request of any length the slot holds, some with extensions (penalties, bias, logprobs)."""
    ext = rng.random() < 0.3
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, GEOMETRY.max_prompt_len))]
    return RequestSpec(rng.getrandbits(64), prompt, rng.randint(1, 40), temperature=rng.choice([0.0, 0.7]),
                       top_k=rng.choice([0, 5]), presence_penalty=0.5 if ext else 0.0,
                       logit_bias=((3, 1.5),) if ext else (), num_logprobs=rng.choice([None, 2]) if ext else None,
                       stop_ids=(rng.randrange(vocab + 9),))


@pytest.mark.parametrize("context_len,num_blocks,extensions", [(64, 32, True), (16, 3, True), (64, 32, False)],
                         ids=["roomy", "short-context-few-blocks", "no-extensions"])
def test_device_admission_matches_the_host_engines(lib, model, context_len, num_blocks, extensions):
    e = _engine(model, context_len, num_blocks, extensions)
    rng, cases = random.Random(SEED), _corruptions(GEOMETRY, e.cfg.vocab_size)
    names = sorted(cases)
    seen: dict[ErrorCode, int] = {}
    try:
        for i in range(NUM_REQUESTS):
            slot = i % GEOMETRY.num_slots
            spec = _spec(rng, e.cfg.vocab_size)
            writer = e.write(slot, spec)  # the head and the prompt; then the other arrays
            for k, token in enumerate(spec.stop_ids):
                writer.put_stop(k, token)
            for k, (token, bias) in enumerate(spec.logit_bias):
                writer.put_bias(k, token, bias)
            picked = rng.sample(names, rng.choice([0, 1, 1, 2]))  # some stay valid
            for name in picked:
                cases[name](rng, writer)
            device, host = _device_error(lib, e, slot), _host_error(e, slot)
            assert device == host, f"seed {SEED}, request {i}: {picked} -> device {device!r}, host {host!r}"
            seen[host] = seen.get(host, 0) + 1
    finally:
        e.ring.close()
    print(f"\nadmission diff ({context_len=}, {num_blocks=}, {extensions=}): {NUM_REQUESTS} requests, {seen}")
    expected = {ErrorCode.NONE, ErrorCode.INVALID_PARAMS}
    if context_len < GEOMETRY.max_prompt_len:
        expected |= {ErrorCode.PROMPT_TOO_LONG, ErrorCode.NO_KV_CAPACITY}
    assert expected <= set(seen), f"the run never reached {expected - set(seen)}: the diff proves less than it says"


@pytest.mark.parametrize("extensions", [True, False], ids=["extensions", "no-extensions"])
def test_each_bad_word_gets_one_code_from_the_cpu_engine_and_the_loops_walk(lib, model, extensions):
    """Every corruption alone, on a request that is valid without it: INVALID_PARAMS from the cpu engine's
    admission and from the loop's walk over the raw slot (the fuzz above mixes them; this names each)."""
    e = _engine(model, MODEL_CONTEXT, 32, extensions)
    rng, cases = random.Random(SEED), _corruptions(GEOMETRY, e.cfg.vocab_size)
    try:
        for i, name in enumerate(sorted(set(cases) - {RANDOM_WORDS})):
            for _ in range(8):  # the cases draw their bad values at random
                slot = i % GEOMETRY.num_slots
                writer = e.write(slot, _base_spec(rng, e.cfg.vocab_size))
                cases[name](rng, writer)
                device, host = _device_error(lib, e, slot), _host_error(e, slot)
                assert device == host == ErrorCode.INVALID_PARAMS, f"{name}: device {device!r}, host {host!r}"
        writer = e.write(0, _base_spec(rng, e.cfg.vocab_size))  # and a valid one passes both
        assert _device_error(lib, e, 0) == _host_error(e, 0) == ErrorCode.NONE
    finally:
        e.ring.close()


def _host_queue(e: FuzzEngine, head: int, tail: int) -> tuple[int, list[int]]:
    """RingConsumer.take_new from `head` with the ring's tail at `tail`: the new head and the queue positions it
    read (each entry holds its own position's slot, or a slot past the ring for positions it skips)."""
    consumer, g = e.loop.consumer, GEOMETRY
    consumer._head = head
    e.ring.u64[R.HDR_SQ_TAIL // 8] = tail
    for k in range(g.num_slots):
        e.ring.u32[(g.sq_offset + 4 * k) // 4] = k
    read = [t.slot for t in consumer.take_new()]
    return consumer._head, read


def test_queue_span_matches_the_consumer(lib, model):
    """One lap at most, a tail behind the head reads nothing and keeps the head, near the top of u64 too."""
    e = FuzzEngine(model)
    rng, n = random.Random(SEED), GEOMETRY.num_slots
    try:
        pairs = [(0, 0), (5, 3), (3, 5), (0, n), (0, n + 1), (7, 7 + (1 << 40)), (U64 - 3, U64), (U64, 2)]
        pairs += [(h, h + rng.randrange(-20, 40)) for h in (rng.randrange(1 << 62) for _ in range(300))]
        for head, tail in pairs:
            tail = max(tail, 0)
            first, end = lib.blink_admit_host_first(head, tail, n), lib.blink_admit_host_end(head, tail)
            new_head, read = _host_queue(e, head, tail)
            assert (end, [k % n for k in range(first, end)]) == (new_head, read), (head, tail)
            assert end - first <= n
    finally:
        e.ring.close()


def test_room_matches_the_consumer(lib, model):
    """A `consumed` word past `produced` (or wrapped around u32) buys no room beyond the buffer."""
    e = FuzzEngine(model)
    rng, consumer = random.Random(SEED), None
    try:
        e.write(0, RequestSpec(1, [5], 4, ignore_eos=True))
        e.queue(0)
        consumer = e.loop.consumer
        consumer.take_new()
        resp = e.ring.resp(0)
        cases = [(16, 0, 0), (16, 16, 0), (16, 0, U32), (16, 3, 10), (8, 100, 92), (16, U32, 0), (16, 20, 1)]
        cases += [(rng.choice([8, 16]), rng.randrange(1 << 32), rng.randrange(1 << 32)) for _ in range(500)]
        for capacity, produced, consumed in cases:
            consumer._capacity[0], consumer._produced[0] = capacity, produced
            e.ring.u32[(resp + R.RESP_CONSUMED) // 4] = consumed
            assert lib.blink_admit_host_room(capacity, produced, consumed) == consumer.room(0), (capacity, produced,
                                                                                                consumed)
    finally:
        e.ring.close()
