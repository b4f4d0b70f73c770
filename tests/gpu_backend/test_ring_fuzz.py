"""The ring as a trust boundary: random and adversarial requests written as raw words straight into a ring
(past RequestSpec.validate, as a broken or hostile gateway would) against the in-process `cpu` engine.

Every bad request ends with an error status for its slot (or, for a queue entry that names no slot, is
skipped), the engine keeps stepping, nothing it holds leaks (KV blocks, live slots), and a normal request
afterwards gets the tokens an independent greedy generator gives.

BLINK_FUZZ_REQUESTS sets how many bad requests are written (default 100,000, the issue's count, which CI runs:
about 10 s on two slow cores, since each ends at admission). BLINK_FUZZ_SEED picks the seed (default 27); a
failure prints the seed and the case.
"""
from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from conftest_models import tiny_cfg
from gpu_backend.engine.cpu_runner import CpuRunner
from gpu_backend.engine.loop import EngineConfig, EngineLoop
from gpu_backend.models import LlamaModel, greedy_generate
from kernels import sched_host
from protocols import ring as R
from protocols.ring import ErrorCode, FinishReason, RequestSpec, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

if sched_host.host_compiler() is None:
    pytest.skip("no C++ compiler on PATH: the native scheduler cannot be built", allow_module_level=True)

CONTEXT_LEN = 64
GEOMETRY = RingGeometry(num_slots=8, max_prompt_len=32, max_output_len=16, max_stop_ids=4, max_logit_bias=4,
                        max_logprobs=3, logprob_window=8)
NUM_REQUESTS = int(os.environ.get("BLINK_FUZZ_REQUESTS", "100000"))
SEED = int(os.environ.get("BLINK_FUZZ_SEED", "27"))
U32, I32_MIN = (1 << 32) - 1, -(1 << 31)
NAN, INF = float("nan"), float("inf")
RANDOM_WORDS = "random_words"  # every field random: almost surely invalid, but only a finish is asserted


@pytest.fixture(scope="module")
def model():
    cfg = tiny_cfg("llama", max_position_embeddings=CONTEXT_LEN)
    torch.manual_seed(0)
    return cfg, LlamaModel(cfg).eval()


class FuzzEngine:
    """An EngineLoop on a fresh shm ring, and a raw writer in the gateway's place: requests are packed into a
    slot with the ring's generated struct, corrupted word by word, then validated by `seq` and queued."""

    def __init__(self, model):
        self.cfg, m = model
        self.ring = create_ring(f"blink-fuzz-{os.getpid()}", GEOMETRY, "fuzz")
        runner = CpuRunner(m, self.cfg, 32, 4, context_len=CONTEXT_LEN, max_num_batched_tokens=16, max_num_seqs=4)
        self.loop = EngineLoop(runner, self.cfg, RingConsumer(self.ring),
                               EngineConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=4), CONTEXT_LEN)
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the loop on its own thread, as the backend does; `advance` then only waits."""
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.loop.stop_event.set()
            self.thread.join(timeout=10)

    def advance(self) -> None:
        """One engine step by hand, or a moment of the engine thread's time."""
        if self.thread is None:
            self.loop.step()
        else:
            time.sleep(0.0005)

    def write(self, slot: int, spec: RequestSpec) -> "SlotWriter":
        return write_request(self.ring, slot, spec)

    def queue(self, slot: int) -> None:
        queue_slot(self.ring, slot)

    def drain(self, slots: list[int], max_steps: int = 500,
              consume: bool = True) -> dict[int, tuple[FinishReason, ErrorCode]]:
        """Step until every slot's response (for the seq its request holds) has a finish reason; with
        `consume`, each step's tokens are marked read (the gateway's `consumed` word)."""
        done = {}
        for _ in range(max_steps):
            self.advance()
            for slot in slots:
                resp, req = self.ring.response_fields(slot), self.ring.request_fields(slot)
                if consume:
                    resp["consumed"] = resp["produced"]
                if resp["seq"] == req["seq"] and resp["finish_reason"] != FinishReason.NONE:
                    done[slot] = FinishReason(int(resp["finish_reason"])), ErrorCode(int(resp["error_code"]))
            if len(done) == len(slots):
                return done
        raise AssertionError(f"no finish for slots {sorted(set(slots) - set(done))} after {max_steps} steps")


def write_request(ring, slot: int, spec: RequestSpec) -> "SlotWriter":
    """The payload of a well-formed request in `slot` of a GEOMETRY ring (not yet validated or queued), as a raw
    writer in the gateway's place stores it (also the GPU fuzzer's, test_ring_fuzz_gpu.py)."""
    R.REQUEST_HEAD.pack_into(ring.buf, ring.req(slot) + R.REQ_REQUEST_ID, *R.request_head(spec))
    p0 = (ring.req(slot) + GEOMETRY.prompt_offset) // 4
    ring.i32[p0 : p0 + len(spec.prompt_ids)] = spec.prompt_ids
    ring.u32[(ring.resp(slot) + R.RESP_CONSUMED) // 4] = 0
    writer = SlotWriter(ring, slot)
    writer.put("seq", ring.hdr_u64(R.HDR_SQ_TAIL) + 1)
    return writer


def queue_slot(ring, slot: int) -> None:
    """The submission-queue entry for `slot`, then the tail."""
    tail = ring.hdr_u64(R.HDR_SQ_TAIL)
    ring.u32[(GEOMETRY.sq_offset + 4 * (tail % GEOMETRY.num_slots)) // 4] = slot
    ring.u64[R.HDR_SQ_TAIL // 8] = tail + 1


# ---- adversarial words ----------------------------------------------------------------------------------
def _base_spec(rng: random.Random, vocab: int) -> RequestSpec:
    return RequestSpec(rng.getrandbits(64), [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))],
                       rng.randint(1, 4), temperature=rng.choice([0.0, 0.7]), ignore_eos=True)


def _bad_float(rng: random.Random) -> float:
    return rng.choice([NAN, INF, -INF, -1.0, -1e-30, 3.4e38, -3.4e38, 2.0])


def _corruptions(g: RingGeometry, vocab: int) -> dict[str, object]:
    """name -> f(rng, put) that writes one bad field; put(field, value) stores into the request slot's words,
    put_prompt(i, id)/put_stop/put_bias(i, id, bias) into its arrays. Each makes the request invalid."""
    bad_id = lambda rng: rng.choice([-1, I32_MIN, vocab, vocab + 1, (1 << 31) - 1])  # noqa: E731
    # stop and logit-bias ids past the vocabulary are ignored by every engine (the GPU loop too:
    # test_persistent_extensions feeds one), so only negative ones make a request invalid
    negative_id = lambda rng: rng.choice([-1, -7, I32_MIN])  # noqa: E731
    return {
        "prompt_len_zero": lambda rng, w: w.put("prompt_len", 0),
        "prompt_len_negative": lambda rng, w: w.put("prompt_len", U32 - rng.randrange(16)),
        "prompt_len_over_slot": lambda rng, w: w.put("prompt_len", g.max_prompt_len + 1 + rng.randrange(1000)),
        "prompt_id_out_of_vocab": lambda rng, w: w.put_prompt(0, bad_id(rng)),
        "stop_id_negative": lambda rng, w: (w.put("num_stop_ids", 1), w.put_stop(0, negative_id(rng))),
        "max_tokens_zero": lambda rng, w: w.put("max_tokens", 0),
        "temperature": lambda rng, w: w.put("temperature", rng.choice([NAN, INF, -INF, -1.0, -1e-30])),
        "top_p": lambda rng, w: w.put("top_p", rng.choice([NAN, INF, -INF, 0.0, -0.5, 1.5])),
        "min_p": lambda rng, w: w.put("min_p", rng.choice([NAN, INF, -INF, -0.5, 1.5])),
        "top_k_negative": lambda rng, w: w.put("top_k", rng.choice([-1, I32_MIN])),
        "num_stop_ids_over_max": lambda rng, w: w.put("num_stop_ids", g.max_stop_ids + 1 + rng.randrange(U32 - 64)),
        "num_logit_bias_over_max": lambda rng, w: w.put("num_logit_bias", g.max_logit_bias + 1 + rng.randrange(99)),
        "logit_bias_id_negative": lambda rng, w: (w.put("num_logit_bias", 1), w.put_bias(0, negative_id(rng), 1.0)),
        "logit_bias_value": lambda rng, w: (w.put("num_logit_bias", 1), w.put_bias(0, 5, rng.choice([NAN, INF]))),
        "num_logprobs_over_max": lambda rng, w: (w.put("flags", R.FLAG_LOGPROBS),
                                                 w.put("num_logprobs", g.max_logprobs + 1 + rng.randrange(U32 - 64))),
        "penalty": lambda rng, w: w.put(rng.choice(["presence_penalty", "frequency_penalty", "repetition_penalty"]),
                                        rng.choice([NAN, INF, -INF, -3.0])),
        "unknown_flags": lambda rng, w: w.put("flags", 1 << rng.randrange(3, 32)),
        "seq_zero": lambda rng, w: w.put("seq", 0),
        RANDOM_WORDS: lambda rng, w: w.fill_random(rng),
    }


class SlotWriter:
    """Raw stores into one request slot through the ring's generated views (REQUEST_DTYPE fields, i32/f32
    words): nothing here goes through RequestSpec.validate."""

    def __init__(self, ring, slot: int):
        self.ring, self.slot = ring, slot
        self.fields = ring.request_fields(slot)

    def put(self, name: str, value) -> None:
        kind = R.REQUEST_DTYPE.fields[name][0].kind
        if kind == "f":
            self.fields[name] = value
        else:  # wrap into the word's width: a negative count is a huge u32, as a C writer would store it
            bits = 8 * R.REQUEST_DTYPE.fields[name][0].itemsize
            v = value % (1 << bits)
            self.fields[name] = v - (1 << bits) if kind == "i" and v >= 1 << (bits - 1) else v

    def fill_random(self, rng: random.Random) -> None:
        """Random bytes over every field after `seq` and over the slot's arrays."""
        base, g = self.ring.req(self.slot), GEOMETRY
        start, stop = base + R.REQ_REQUEST_ID, base + g.request_bytes
        self.ring.buf[start:stop] = np.frombuffer(rng.randbytes(stop - start), dtype=np.uint8)
        b0 = self.ring.bias(self.slot)
        self.ring.buf[b0 : b0 + g.logit_bias_bytes] = np.frombuffer(rng.randbytes(g.logit_bias_bytes), dtype=np.uint8)

    def put_prompt(self, i: int, token: int) -> None:
        self.ring.i32[(self.ring.req(self.slot) + GEOMETRY.prompt_offset) // 4 + i] = token

    def put_stop(self, i: int, token: int) -> None:
        self.ring.i32[(self.ring.req(self.slot) + R.REQ_STOP_IDS) // 4 + i] = token

    def put_bias(self, i: int, token: int, bias: float) -> None:
        b0 = self.ring.bias(self.slot)
        self.ring.i32[b0 // 4 + i] = token
        self.ring.f32[(b0 + GEOMETRY.logit_bias_bytes // 2) // 4 + i] = bias


# ---- the fuzzer -----------------------------------------------------------------------------------------
def test_adversarial_requests_end_in_errors_and_the_engine_keeps_serving(model):
    e = FuzzEngine(model)
    try:
        t0 = time.monotonic()
        counts = _fuzz(e, NUM_REQUESTS, SEED)
        elapsed = time.monotonic() - t0
        print(f"\nring fuzz: {NUM_REQUESTS} bad requests in {elapsed:.2f} s (seed {SEED}); per case {counts}")
        _assert_still_serves(e, model[1])
    finally:
        e.ring.close()


def test_the_engine_thread_survives_bad_requests(model):
    """The same words against `EngineLoop.run` on its own thread (the backend's shape): it is alive after
    them and serves; its heartbeat kept moving."""
    e = FuzzEngine(model)
    e.start()
    try:
        _fuzz(e, min(NUM_REQUESTS, 2000), SEED + 1)
        assert e.thread.is_alive() and e.loop.failed is None and e.ring.heartbeat > 0
        _assert_still_serves(e, model[1])
    finally:
        e.stop()
        e.ring.close()
    assert not e.thread.is_alive()


def _fuzz(e: FuzzEngine, num_requests: int, seed: int) -> dict[str, int]:
    """Write `num_requests` bad requests, a slotful at a time; check each one's finish and that nothing
    leaked. Returns how often each corruption was written."""
    rng, cases = random.Random(seed), _corruptions(GEOMETRY, e.cfg.vocab_size)
    names = sorted(cases)
    counts = dict.fromkeys(names, 0)
    for first in range(0, num_requests, GEOMETRY.num_slots):
        batch = {}
        for slot in range(min(GEOMETRY.num_slots, num_requests - first)):
            writer = e.write(slot, _base_spec(rng, e.cfg.vocab_size))
            batch[slot] = rng.sample(names, rng.choice([1, 1, 2, 3]))  # one bad field, or a few at once
            for name in batch[slot]:
                cases[name](rng, writer)
                counts[name] += 1
            e.queue(slot)
        for slot, (finish, error) in e.drain(list(batch)).items():
            assert RANDOM_WORDS in batch[slot] or (finish, error) == (FinishReason.ERROR, ErrorCode.INVALID_PARAMS), \
                f"seed {seed}: {batch[slot]} ended {finish!r} {error!r}"
        assert not e.loop.live and e.loop.scheduler.num_free == e.loop.scheduler.num_blocks
    return counts


def test_queue_words_that_name_no_slot_or_jump_ahead_are_refused(model):
    """Submission-queue entries past num_slots, a tail far beyond the head, cancel words on free slots and a
    `consumed` word past `produced`: the engine skips or bounds them and then serves normally."""
    m = model[1]
    e = FuzzEngine(model)
    try:
        ring, g = e.ring, GEOMETRY
        for slot in range(g.num_slots):  # cancel words that match no live request
            ring.request_fields(slot)["cancel_seq"] = random.Random(slot).getrandbits(64)
        tail = ring.hdr_u64(R.HDR_SQ_TAIL)
        for k, bad_slot in enumerate([g.num_slots, U32, 1 << 20]):
            ring.u32[(g.sq_offset + 4 * ((tail + k) % g.num_slots)) // 4] = bad_slot
        ring.u64[R.HDR_SQ_TAIL // 8] = tail + 3
        e.loop.step()
        assert ring.hdr_u64(R.HDR_SQ_HEAD) == tail + 3 and not e.loop.live
        # a tail 2^40 entries ahead: at most one lap is read (bounded work), each entry a free, zeroed slot
        ring.u64[R.HDR_SQ_TAIL // 8] = tail + 3 + (1 << 40)
        started = time.monotonic()
        e.loop.step()
        assert time.monotonic() - started < 5 and not e.loop.live
        e.write(0, RequestSpec(7, [5, 6, 7], 40, temperature=0.0, ignore_eos=True))
        e.queue(0)
        e.loop.step()
        ring.u32[(ring.resp(0) + R.RESP_CONSUMED) // 4] = U32  # consumed far past produced: no extra room
        assert 0 <= e.loop.consumer.room(0) <= g.max_output_len
        assert e.drain([0], consume=False) == {0: (FinishReason.LENGTH, ErrorCode.NONE)}
        _assert_still_serves(e, m)
    finally:
        e.ring.close()


def test_extreme_but_legal_words_run_to_a_normal_finish(model):
    """Fields at the edges of their words that are still valid (max_tokens and priority at u32's top, top_k
    past the vocabulary, a huge finite temperature, a tiny top_p, seq numbers out of order): served, not
    refused, and bounded by the context length."""
    m = model[1]
    e = FuzzEngine(model)
    try:
        extremes = [("max_tokens", U32), ("priority", U32), ("top_k", (1 << 31) - 1), ("temperature", 3.0e38),
                    ("top_p", 1e-30), ("seed", (1 << 64) - 1), ("seq", 1), ("seq", (1 << 64) - 1)]
        for slot, (name, value) in enumerate(extremes):
            e.write(slot, RequestSpec(slot, [4 + slot, 9, 11], 5, temperature=0.8, ignore_eos=True)).put(name, value)
            e.queue(slot)
        done = e.drain(list(range(len(extremes))), max_steps=2000)
        assert all(f is FinishReason.LENGTH and err is ErrorCode.NONE for f, err in done.values()), done
        assert int(e.ring.response_fields(0)["produced"]) == CONTEXT_LEN - 3  # max_tokens clipped by the context
        _assert_still_serves(e, m)
    finally:
        e.ring.close()


def _assert_still_serves(e: FuzzEngine, m) -> None:
    """A gateway's producer attaches after the raw words (every slot finished or never used: all free) and a
    normal request gets the independent generator's tokens."""
    prompt = [5, 9, 14, 3, 27]
    want = greedy_generate(m, [prompt], 6, block_size=4)[0]
    prod = ShmProducer(attach_ring(e.ring.name))
    assert prod.free_slots == GEOMETRY.num_slots
    slot = prod.submit(RequestSpec(1, prompt, 6, temperature=0.0, ignore_eos=True))
    tokens = []
    for _ in range(2000):
        e.advance()
        upd = prod.poll(slot)
        tokens += upd.tokens
        if upd.finish is not FinishReason.NONE:
            break
    assert upd.finish is FinishReason.LENGTH and tokens == want
    assert e.loop.scheduler.num_free == e.loop.scheduler.num_blocks
