"""The ring as a trust boundary on the GPU: the fuzzer's adversarial requests (test_ring_fuzz.py lists the
attacks) written as raw words straight into the ring of a running `persistent` engine (the GPU-resident
loop), past every gateway check. Runs on the device machine (skipped elsewhere), and under compute-sanitizer's
memcheck with kernels/ring_fuzz_sanitizer.sh. The same test drives the `cpu` engine on its own thread (host =
persistent: it is the reference the loop must match, and CI's run of this file, with fewer requests).

- every bad request ends with FINISH_ERROR and INVALID_PARAMS in its own response (what the host engines
  write), taken by the idle full step and by the speculation (a long request decodes in slot 0 beside them);
- queue entries that name no slot are skipped; a tail moved back takes nothing; a tail 2^40 entries ahead
  costs one lap of the queue;
- a `consumed` word past `produced` buys room only up to consumed + capacity, and one wrapped around u32 never
  stalls the request (RingConsumer.room);
- a slot resubmitted while its request runs: the old request is dropped, the new one gets its own tokens;
- afterwards the loop has no fault, every KV block is free, and a normal request gets the host engine's tokens.

BLINK_FUZZ_REQUESTS: bad requests per GPU engine (default 2,000; the cpu engine gets at most 300);
BLINK_FUZZ_SEED: the seed (default 27);
BLINK_FUZZ_TIMEOUT_S: the longest wait for one answer (default 60; the sanitizer run raises it).
"""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from test_gpu_runner import _drive, _peaky_model
from test_persistent import CONFIG
from test_ring_fuzz import GEOMETRY, RANDOM_WORDS, SEED, _base_spec, _corruptions, queue_slot, write_request
from gpu_backend.engine.cpu_runner import CpuRunner
from gpu_backend.engine.loop import EngineLoop
from protocols import ring as R
from protocols.ring import ErrorCode, FinishReason, RequestSpec
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

NUM_REQUESTS = int(os.environ.get("BLINK_FUZZ_REQUESTS", "2000"))
TIMEOUT_S = float(os.environ.get("BLINK_FUZZ_TIMEOUT_S", "60"))
BACKGROUND = 0  # the slot of the long request decoding beside the bad ones
BACKGROUND_TOKENS = 400
BACKGROUND_SPEC = RequestSpec(9, [7, 8, 9], BACKGROUND_TOKENS, temperature=0.7, seed=3, ignore_eos=True)
FUZZ_SLOTS = range(1, GEOMETRY.num_slots)
NORMAL = RequestSpec(1, [5, 9, 14, 3, 27, 300, 411], 6, temperature=0.0, ignore_eos=True)
U32 = (1 << 32) - 1


@pytest.fixture(scope="module", params=["cpu", pytest.param("gpu-plain", marks=GPU),
                                        pytest.param("gpu-extensions", marks=GPU)])
def runner_cfg(request):
    """(runner, model config, kind): the cpu engine's runner, or a GpuRunner for the persistent loop without
    and with the sampling extensions."""
    cfg, model = _peaky_model()
    if request.param == "cpu":
        return CpuRunner(model, cfg, 96, 16, context_len=512, max_num_batched_tokens=64, max_num_seqs=8), cfg, "cpu"
    from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig

    runner = GpuRunner(model.to(device="cuda", dtype=torch.bfloat16), cfg,
                       GpuRunnerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=16, context_len=512,
                                       num_kv_blocks=96, sampling_extensions=request.param == "gpu-extensions"),
                       progress=False, keep_graphs=True)
    return runner, cfg, request.param


class ThreadEngine:
    """The cpu engine's EngineLoop on its own thread, with the persistent engine's face as this test uses it."""

    def __init__(self, runner, cfg, ring):
        self.loop = EngineLoop(runner, cfg, RingConsumer(ring), CONFIG, context_len=512)
        self.thread: threading.Thread | None = None
        self.ctl, self.final_ctl = "(cpu engine)", {"error": 0}

    @property
    def failed(self) -> str | None:
        return self.loop.failed

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        if self.thread is not None:
            self.loop.stop_event.set()
            self.thread.join(timeout=30)
            self.final_ctl = {"error": int(self.thread.is_alive())}

    def scheduler_header(self):
        return self.loop.scheduler.h


class LoopFuzz:
    """A persistent engine on a GEOMETRY ring, with raw words in the gateway's place; slot 0 keeps a long
    request decoding (resubmitted when it ends) while `background` is set, so that admissions also run in
    the speculation."""

    def __init__(self, runner, cfg, gpu: bool):
        self.ring = create_ring(f"blink-fuzz-gpu-{os.getpid()}", GEOMETRY, "fuzz")
        self.gpu = gpu
        if gpu:
            from gpu_backend.engine.persistent import PersistentEngine

            self.engine = PersistentEngine(runner, cfg, self.ring, CONFIG, context_len=512)
        else:
            self.engine = ThreadEngine(runner, cfg, self.ring)
        self.vocab = cfg.vocab_size
        self.background = False
        self.consume = {BACKGROUND}  # slots whose tokens are marked read as they come

    def head(self) -> int:
        return self.ring.hdr_u64(R.HDR_SQ_HEAD)

    def tail(self) -> int:
        return self.ring.hdr_u64(R.HDR_SQ_TAIL)

    def finish(self, slot: int) -> tuple[FinishReason, ErrorCode] | None:
        """The slot's finish, once its response belongs to the request now in the slot."""
        resp, req = self.ring.response_fields(slot), self.ring.request_fields(slot)
        if int(resp["seq"]) != int(req["seq"]) or int(resp["finish_reason"]) == FinishReason.NONE:
            return None
        return FinishReason(int(resp["finish_reason"])), ErrorCode(int(resp["error_code"]))

    def submit(self, slot: int, spec: RequestSpec) -> None:
        write_request(self.ring, slot, spec)
        queue_slot(self.ring, slot)

    def wait(self, until, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not until():
            for slot in self.consume:
                resp = self.ring.response_fields(slot)
                resp["consumed"] = resp["produced"]
            if self.background and self.finish(BACKGROUND):  # all its tokens: the bad requests beside it left no mark
                produced = int(self.ring.response_fields(BACKGROUND)["produced"])
                assert (self.finish(BACKGROUND), produced) == ((FinishReason.LENGTH, ErrorCode.NONE), BACKGROUND_TOKENS)
                self.submit(BACKGROUND, BACKGROUND_SPEC)
            assert time.monotonic() < deadline, f"{what}: nothing after {TIMEOUT_S} s; loop ctl {self.engine.ctl}"
            time.sleep(0.0002)

    def beats(self, n: int) -> None:
        """Wait until the loop has bumped its heartbeat n more times (it looked at the ring since)."""
        start = self.ring.heartbeat
        self.wait(lambda: self.ring.heartbeat >= start + n, f"{n} heartbeats")

    def tokens(self, slot: int) -> list[int]:
        resp = self.ring.response_fields(slot)
        n = int(resp["produced"])
        assert n <= GEOMETRY.max_output_len
        t0 = (self.ring.resp(slot) + R.RESP_TOKENS) // 4
        return self.ring.i32[t0 : t0 + n].tolist()

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self.ring.close()


def test_bad_requests_end_in_errors_and_the_loop_keeps_serving(runner_cfg):
    runner, cfg, kind = runner_cfg
    want, _, _ = _drive(runner, cfg, [NORMAL], config=CONFIG)  # before the loop holds the runner's graphs
    f = LoopFuzz(runner, cfg, gpu=kind != "cpu")
    num_requests = NUM_REQUESTS if f.gpu else min(NUM_REQUESTS, 300)
    try:
        f.engine.start()
        f.background = True
        f.submit(BACKGROUND, BACKGROUND_SPEC)
        t0 = time.monotonic()
        counts = _fuzz(f, num_requests, SEED)
        elapsed = time.monotonic() - t0
        print(f"\n{kind} ring fuzz: {num_requests} bad requests in {elapsed:.1f} s (seed {SEED}); {counts}")
        _queue_attacks(f)
        _room_attacks(f)
        _resubmit_live_slot(f, want[0])
        _still_serves(f, want[0])
        f.engine.shutdown()
        ctl = f.engine.final_ctl
        assert f.engine.failed is None and ctl["error"] == 0, (f.engine.failed, ctl)
        assert not f.gpu or ctl["spec_hits"] > 0  # the background request decoded through the speculation
        header = f.engine.scheduler_header()
        assert header.num_free == runner.num_blocks and header.num_running == header.num_waiting == 0
    finally:
        f.close()


def _fuzz(f: LoopFuzz, num_requests: int, seed: int) -> dict[str, int]:
    """Bad requests, a batch in every fuzz slot at a time: each ends FINISH_ERROR / INVALID_PARAMS."""
    rng, cases = random.Random(seed), _corruptions(GEOMETRY, f.vocab)
    names = sorted(cases)
    counts = dict.fromkeys(names, 0)
    for first in range(0, num_requests, len(FUZZ_SLOTS)):
        batch = {}
        for slot in FUZZ_SLOTS[: num_requests - first]:
            writer = write_request(f.ring, slot, _base_spec(rng, f.vocab))
            batch[slot] = rng.sample(names, rng.choice([1, 1, 2, 3]))
            for name in batch[slot]:
                cases[name](rng, writer)
                counts[name] += 1
            queue_slot(f.ring, slot)
        tail = f.tail()
        f.wait(lambda: f.head() >= tail and all(f.finish(s) for s in batch), f"batch at request {first}")
        for slot, picked in batch.items():
            got = f.finish(slot)
            assert RANDOM_WORDS in picked or got == (FinishReason.ERROR, ErrorCode.INVALID_PARAMS), \
                f"seed {seed}, request {first}: {picked} ended {got}"
    return counts


def _responses(f: LoopFuzz) -> list[tuple[int, int, int]]:
    return [(int(r["seq"]), int(r["finish_reason"]), int(r["produced"]))
            for r in (f.ring.response_fields(s) for s in FUZZ_SLOTS)]


def _queue_attacks(f: LoopFuzz) -> None:
    """Entries naming no slot, a tail moved back, a tail 2^40 entries ahead."""
    g, n = GEOMETRY, GEOMETRY.num_slots
    before, tail = _responses(f), f.tail()
    for k, bad_slot in enumerate([n, U32, 1 << 20]):
        f.ring.u32[(g.sq_offset + 4 * ((tail + k) % n)) // 4] = bad_slot
    f.ring.u64[R.HDR_SQ_TAIL // 8] = tail + 3
    f.wait(lambda: f.head() >= tail + 3, "entries naming no slot")
    assert _responses(f) == before
    f.background = False  # from here the test alone moves the tail
    req = f.ring.request_fields(BACKGROUND)
    req["cancel_seq"] = req["seq"]
    f.wait(lambda: f.finish(BACKGROUND) is not None, "the background request's cancel")
    tail = f.tail()
    f.ring.u64[R.HDR_SQ_TAIL // 8] = tail - 5  # behind the head: nothing is taken, the head stays
    f.beats(20)
    assert f.head() == tail and _responses(f) == before
    f.ring.u64[R.HDR_SQ_TAIL // 8] = tail
    f.beats(5)
    assert f.head() == tail and _responses(f) == before
    for k in range(n):  # one lap of entries, each naming a fuzz slot (its bad words are still there)
        f.ring.u32[(g.sq_offset + 4 * k) // 4] = FUZZ_SLOTS[k % len(FUZZ_SLOTS)]
    far = tail + (1 << 40)
    f.ring.u64[R.HDR_SQ_TAIL // 8] = far
    f.wait(lambda: f.head() == far, "a tail 2^40 entries ahead")
    f.beats(5)
    assert all(f.finish(s) is not None and f.finish(s)[0] is FinishReason.ERROR for s in FUZZ_SLOTS if
               before[s - 1][1] == FinishReason.ERROR)


def _room_attacks(f: LoopFuzz) -> None:
    """`consumed` 5 past `produced`: the request runs to consumed + capacity and waits there; `consumed` at
    u32's top (a wrapped counter): room is the capacity, the request never stalls."""
    cap, slot = GEOMETRY.max_output_len, BACKGROUND
    f.submit(slot, RequestSpec(10, [7, 8, 9], 60, temperature=0.0, ignore_eos=True))
    f.consume.discard(slot)
    resp = f.ring.response_fields(slot)
    f.wait(lambda: int(resp["seq"]) == int(f.ring.request_fields(slot)["seq"]) and int(resp["produced"]) >= 2,
           "the room request's first tokens")
    produced = int(resp["produced"])
    resp["consumed"] = produced + 5
    f.wait(lambda: int(resp["produced"]) >= produced + 5 + cap, "room up to consumed + capacity")
    f.beats(20)
    assert int(resp["produced"]) == produced + 5 + cap and f.finish(slot) is None
    f.consume.add(slot)
    f.wait(lambda: f.finish(slot) is not None, "the room request's end")
    f.consume.discard(slot)
    write_request(f.ring, slot, RequestSpec(11, [7, 8, 9], 3 * cap, temperature=0.0, ignore_eos=True))
    resp["consumed"] = U32  # before it is queued: produced - consumed is negative from its first token on
    queue_slot(f.ring, slot)
    f.wait(lambda: f.finish(slot) is not None, "the wrapped-consumed request")
    assert f.finish(slot) == (FinishReason.LENGTH, ErrorCode.NONE) and int(resp["produced"]) == 3 * cap
    f.consume.add(slot)


def _resubmit_live_slot(f: LoopFuzz, want: list[int]) -> None:
    """A long request in slot 0, then a new one written over it while it runs: the new one's response holds
    its own tokens only (none of the old request's, no early finish)."""
    f.submit(BACKGROUND, RequestSpec(12, [7, 8, 9], 400, temperature=0.7, seed=5, ignore_eos=True))
    resp = f.ring.response_fields(BACKGROUND)
    f.wait(lambda: int(resp["seq"]) == int(f.ring.request_fields(BACKGROUND)["seq"]) and int(resp["produced"]) >= 3,
           "the long request's first tokens")
    f.consume.discard(BACKGROUND)  # NORMAL's 6 tokens fit the output area unread
    f.submit(BACKGROUND, NORMAL)
    f.wait(lambda: f.finish(BACKGROUND) is not None, "the request written over a live one")
    assert f.finish(BACKGROUND) == (FinishReason.LENGTH, ErrorCode.NONE)
    assert f.tokens(BACKGROUND) == want
    f.consume.add(BACKGROUND)


def _still_serves(f: LoopFuzz, want: list[int]) -> None:
    """A gateway's producer attaches (every slot finished: all free) and a normal request gets the host
    engine's tokens."""
    prod = ShmProducer(attach_ring(f.ring.name))
    assert prod.free_slots == GEOMETRY.num_slots
    slot = prod.submit(NORMAL)
    tokens: list[int] = []
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        upd = prod.poll(slot)
        tokens += upd.tokens
        if upd.finish is not FinishReason.NONE:
            break
        assert time.monotonic() < deadline, "the normal request got no finish"
        time.sleep(0.0005)
    assert upd.finish is FinishReason.LENGTH and tokens == want
