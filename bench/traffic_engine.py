"""BENCHMARK-ONLY fake engine for `bench/ring_traffic.py`: a ring, a control plane, tokens at a set rate.

`TrafficEngine` plays a backend: it creates a ring, serves the control plane (Describe/Health) with a
WordLevel tokenizer, and answers every request with tokens at `tok_s` per stream (the first one as soon
as it sees the request), honouring cancels and backpressure. It never runs a model: it exists so that the
gateway's own cost can be measured without an engine's cost on top. Never serve clients with it.
Each token id encodes its publish time (`token_for`), so a reader can tell each token's latency (`lag_us`).
"""
from __future__ import annotations

import array
import bisect
import contextlib
import gc
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np

import protocols.ring as R
from gpu_backend.control_server import ControlServer
from gpu_backend.models import preset_config
from gpu_backend.models.demo import default_cache_dir
from gpu_backend.models.random_tokenizer import ensure_random_tokenizer
from protocols.messages import BackendDescription
from protocols.ring import EngineState, FinishReason, RingGeometry
from protocols.shm import create_ring
from protocols.shm_consumer import RingConsumer
from tests.conftest import free_port

MODEL_NAME = "ring-traffic"
TOKENIZER_CFG = preset_config("smollm2-135m")  # only its vocabulary size: the tokenizer is WordLevel w0..wN


TIME_UNIT_NS = 10_000  # streamed token ids encode their publish time in these units, modulo the vocabulary


def token_for(now_ns: int) -> int:
    return 1 + (now_ns // TIME_UNIT_NS) % (TOKENIZER_CFG.vocab_size - 1)


def lag_us(token: int, recv_ns: int) -> float:
    """Publish-to-receipt time of a token made by `token_for` (unambiguous below ~0.49 s)."""
    span = TOKENIZER_CFG.vocab_size - 1
    return ((recv_ns // TIME_UNIT_NS) % span - (token - 1)) % span * TIME_UNIT_NS / 1e3


def serve(engine, stop: mp.Event, stats_path: str | None) -> None:
    """Either fake engine's loop: the control plane up, `engine.step` until `stop` (sleeping `engine.idle_s`
    between steps; 0: spin), then everything closed and `engine.stats()` written to `stats_path`."""
    engine.control.start()
    engine.consumer.set_state(EngineState.SERVING)
    try:
        while not stop.is_set():
            engine.step(time.monotonic())
            if engine.idle_s:
                time.sleep(engine.idle_s)
    finally:
        engine.control.stop()
        engine.ring.close()
        if stats_path:
            Path(stats_path).write_text(json.dumps(engine.stats()))


class TrafficEngine:
    """The fake engine's loop (benchmark only): tokens at `tok_s` per stream, 0 = one per stream per step.
    Each token id encodes its publish time (`token_for`), so a client can measure per-token latency.

    Each step publishes every due token with a few vectorized reads and stores (one token id per step:
    they share its publish time), so that publishing 25k tokens/s costs the core it shares with the client
    little and comes out in small, even steps rather than in bursts after the client held the core."""

    def __init__(self, ring_name: str, control: str, tok_s: float, num_slots: int = 1024, idle_s: float = 0.0):
        self.ring = create_ring(ring_name, RingGeometry(num_slots, 4096, 1024), MODEL_NAME)
        self.consumer = RingConsumer(self.ring)  # requests in, finishes, heartbeat; tokens are stored here
        self.interval_s = 1.0 / tok_s if tok_s > 0 else 0.0
        desc = BackendDescription(MODEL_NAME, str(ensure_random_tokenizer(TOKENIZER_CFG, default_cache_dir())),
                           MODEL_NAME, 4096, TOKENIZER_CFG.vocab_size, (), "traffic")
        self.control = ControlServer(control, desc, self.ring)
        self.idle_s = idle_s  # sleep between loop iterations (0: spin)
        g, slots = self.ring.geometry, np.arange(num_slots)
        resp = g.responses_offset + slots * g.response_bytes  # [num_slots] byte offsets
        req = np.array([self.ring.req(slot) for slot in range(num_slots)])
        self.produced_w, self.consumed_w = (resp + R.RESP_PRODUCED) // 4, (resp + R.RESP_CONSUMED) // 4
        self.tokens_w = (resp + R.RESP_TOKENS) // 4
        self.first_ns_w, self.last_ns_w = (resp + R.RESP_FIRST_TOKEN_NS) // 8, (resp + R.RESP_LAST_TOKEN_NS) // 8
        self.cancel_w = (req + R.REQ_CANCEL_SEQ) // 8
        self.seq = np.zeros(num_slots, np.uint64)
        self.produced = np.zeros(num_slots, np.int64)
        self.max_tokens = np.zeros(num_slots, np.int64)
        self.capacity = np.zeros(num_slots, np.int64)
        self.due_s = np.full(num_slots, np.inf)  # next token's due time; inf: no request
        self.late_us = array.array("d")  # each token's publish time - its due time
        self.steps = array.array("q")  # per step that published: start monotonic ns, ns to publish, tokens, thread CPU ns
        self.sched = "normal"  # the loop thread's scheduling (`_raise_priority`)

    def run(self, stop: mp.Event, stats_path: str | None = None) -> None:
        # Before the control plane's threads start, so that they have it too: one of them holding the GIL
        # while the client has the core would hold this loop up. Never for a spinning loop (idle_s 0).
        self.sched = _raise_priority() if self.idle_s else "normal"
        serve(self, stop, stats_path)

    def stats(self) -> dict:
        """How evenly tokens went out: their lateness against their due times (us), and the loop's scheduling."""
        v = np.sort(np.frombuffer(self.late_us, dtype=np.float64)) if len(self.late_us) else np.zeros(1)
        return {"engine_sched": self.sched, "engine_late_us_p50": v[len(v) // 2],
                "engine_late_us_p99": v[int(0.99 * (len(v) - 1))], "engine_late_us_max": v[-1],
                "engine_steps": self.steps.tolist()}

    def step(self, now: float) -> None:
        """Publish every token that is due; a cancel is seen at the stream's next due time."""
        self.consumer.beat()
        for t in self.consumer.take_new():
            self.seq[t.slot], self.produced[t.slot], self.max_tokens[t.slot] = t.seq, 0, t.spec.max_tokens
            g = self.ring.geometry
            self.capacity[t.slot] = g.logprob_window if t.spec.num_logprobs is not None else g.max_output_len
            self.due_s[t.slot] = now
        due = np.flatnonzero(self.due_s <= now)
        if not len(due):
            return
        u32, u64 = self.ring.u32, self.ring.u64
        cancelled = u64[self.cancel_w[due]] == self.seq[due]
        for slot in due[cancelled]:
            self._finish(int(slot), FinishReason.CANCELLED)
        due = due[~cancelled]
        ok = due[self.produced[due] - u32[self.consumed_w[due]] < self.capacity[due]]  # room in the output buffer
        now_ns = time.monotonic_ns()
        produced = self.produced[ok]
        self.ring.i32[self.tokens_w[ok] + produced % self.ring.geometry.max_output_len] = token_for(now_ns)
        u64[self.first_ns_w[ok[produced == 0]]] = now_ns
        u64[self.last_ns_w[ok]] = now_ns
        self.produced[ok] = produced + 1
        u32[self.produced_w[ok]] = produced + 1  # after the tokens: a reader reads `produced` first
        u64[R.HDR_GENERATED_TOKENS // 8] += len(ok)
        self.steps.extend((int(now * 1e9), time.monotonic_ns() - now_ns, len(ok), time.thread_time_ns()))
        self.late_us.extend(((now - self.due_s[ok]) * 1e6).tolist())
        self.due_s[due] = np.maximum(self.due_s[due] + self.interval_s, now)
        for slot in ok[produced + 1 >= self.max_tokens[ok]]:
            self._finish(int(slot), FinishReason.LENGTH)

    def _finish(self, slot: int, reason: FinishReason) -> None:
        self.consumer.finish(slot, reason)
        self.due_s[slot] = np.inf


def _raise_priority() -> str:
    """The engine stands in for a GPU, which no client process delays: its loop thread preempts the client
    it shares a core with (SCHED_FIFO; it sleeps between steps, so it cannot starve that core), or at
    least outweighs it (nice -10) where real-time scheduling is not allowed. Returns what it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "fifo"
    except PermissionError:
        pass
    try:
        os.nice(-10)
        return "nice-10"
    except PermissionError:
        return "normal"


def _engine_main(ring: str, control: str, tok_s: float, stop: mp.Event, idle_s: float = 0.0,
                 cores: set[int] | None = None, stats_path: str | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cores:
        os.sched_setaffinity(0, cores)
    gc.freeze()  # what the fork inherited (torch's objects among them) stays out of every collection
    TrafficEngine(ring, control, tok_s, idle_s=idle_s).run(stop, stats_path)


@contextlib.contextmanager
def traffic_engine(tok_s: float, idle_s: float = 0.0, cores: set[int] | None = None, stats_path: str | None = None):
    """A TrafficEngine process with its ring and control plane; yields (ring name, control address, pid).
    With `stats_path`: the engine writes `TrafficEngine.stats()` there when it stops."""
    ring, control = f"blink-traffic-{os.getpid()}", f"127.0.0.1:{free_port()}"
    stop = mp.Event()
    engine = mp.get_context("fork").Process(target=_engine_main, daemon=True,
                                            args=(ring, control, tok_s, stop, idle_s, cores, stats_path))
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/dev/shm/{ring}") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the control plane starts right after the ring
        yield ring, control, engine.pid
    finally:
        stop.set()
        engine.join(timeout=10)


# ------------------------------------------------------------------ constrained mode (bench/mask_latency.py)
MASK_TOKENIZER_SEED = 0
MASK_PRESET = "smollm2-135m"  # the constrained mode's default vocabulary (size, BOS, EOS); llama-3-8b: 128,256
MAX_STEPS_LATE = 8  # the per-token histogram of steps waited for a mask: 0 .. MAX_STEPS_LATE (the last: or more)
SKIP_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64, 128)  # skipped steps by the waiting token's index: [0, 1), [1, 2) ... [128, inf)


def mask_tokenizer_dir(cache_dir: Path, preset: str = MASK_PRESET) -> Path:
    """A byte-level tokenizer folder of `preset`'s vocabulary size, BOS and EOS that JSON can be spelled in
    (`bench/structured_vocab.py`), with the random models' chat template; written once under `cache_dir`."""
    from gpu_backend.models.random_tokenizer import CHAT_TEMPLATE
    from structured_vocab import build_tokenizer

    cfg = preset_config(preset)
    eos = "-".join(map(str, cfg.eos_token_ids))
    target = Path(cache_dir) / f"mask-traffic-v{cfg.vocab_size}-b{cfg.bos_token_id}-e{eos}"
    if not (target / "tokenizer.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        tok = build_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids, MASK_TOKENIZER_SEED)
        tok.save(str(target / "tokenizer.json.tmp"))
        (target / "tokenizer.json.tmp").replace(target / "tokenizer.json")
        (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return target


class MaskTrafficEngine:
    """The fake engine in constrained mode (benchmark only): one step every `step_s` for all rows, as a GPU's
    decode steps. A constrained row (its request carries a mask) samples in a step only if the mask of the token
    it is about to sample has arrived (a seeded random allowed id; EOS whenever the mask allows it, so a JSON
    schema's output ends when complete); else it skips that step, as the real engine's row does. Between steps
    the loop watches the awaited masks, so it records per token: mask latency (publishing token i -> seeing
    mask i + 1 in the ring) and the steps rows skipped. An unconstrained row gets one fixed token per step."""

    def __init__(self, ring_name: str, control: str, step_s: float, num_slots: int = 256, idle_s: float = 0.0001,
                 preset: str = MASK_PRESET):
        cfg = preset_config(preset)
        g = RingGeometry(num_slots, 4096, 1024, mask_words=(cfg.vocab_size + 31) // 32)
        self.ring = create_ring(ring_name, g, MODEL_NAME)
        self.consumer = RingConsumer(self.ring)
        self.eos_id = cfg.eos_token_ids[0]
        desc = BackendDescription(MODEL_NAME, str(mask_tokenizer_dir(default_cache_dir(), preset)), MODEL_NAME, 4096,
                                  cfg.vocab_size, tuple(cfg.eos_token_ids), "traffic")
        self.control = ControlServer(control, desc, self.ring)
        self.step_s, self.idle_s, self.next_step_s = step_s, idle_s, 0.0
        self.rng = np.random.default_rng(0)
        # slot -> [seq, spec, produced, mask words of token `produced` or None, constrained, steps skipped for it]
        self.rows: dict[int, list] = {}
        self.published_ns: dict[int, int] = {}  # slot -> when its last token went out (awaiting the next mask)
        self.mask_latency_us = array.array("d")
        self.num_sampled = self.num_skipped = 0
        self.steps_late = np.zeros(MAX_STEPS_LATE + 1, np.int64)  # constrained tokens by the steps they waited
        # the steps skipped by the index of the token that waited, in SKIP_BUCKETS (is it a request's first tokens?)
        self.skipped_by_index = np.zeros(len(SKIP_BUCKETS), np.int64)
        self.skipped_by_second: dict[int, int] = {}  # whole seconds since the first step -> steps skipped then
        self.first_step_s = self.now_s = None

    def run(self, stop: mp.Event, stats_path: str | None = None) -> None:
        serve(self, stop, stats_path)

    def stats(self) -> dict:
        lat = np.sort(np.frombuffer(self.mask_latency_us, dtype=np.float64)) if len(self.mask_latency_us) else None
        pct = (lambda q: float(lat[int(q * (len(lat) - 1))])) if lat is not None else (lambda q: None)
        rows = self.num_sampled + self.num_skipped
        return {"step_ms": self.step_s * 1e3, "masks": len(self.mask_latency_us), "mask_latency_us_p50": pct(0.5),
                "mask_latency_us_p99": pct(0.99), "mask_latency_us_max": pct(1.0),
                "mask_over_one_step": int(np.sum(lat > self.step_s * 1e6)) if lat is not None else 0,
                "row_steps": rows, "skipped_steps": self.num_skipped,
                "skipped_fraction": self.num_skipped / rows if rows else None,
                "tokens_by_steps_waited": self.steps_late.tolist(),
                "skipped_by_second": [self.skipped_by_second.get(i, 0)
                                      for i in range(max(self.skipped_by_second, default=-1) + 1)],
                "skipped_by_token_index": {f"<{b}" if i < len(SKIP_BUCKETS) - 1 else f">={SKIP_BUCKETS[-2]}": int(n)
                                           for i, (b, n) in enumerate(zip(SKIP_BUCKETS, self.skipped_by_index))}}

    def step(self, now: float) -> None:
        self.now_s = now
        self.first_step_s = now if self.first_step_s is None else self.first_step_s
        self.consumer.beat()
        for t in self.consumer.take_new():
            mask0 = np.frombuffer(t.spec.token_mask, np.uint32) if t.spec.token_mask is not None else None
            self.rows[t.slot] = [t.seq, t.spec, 0, mask0, t.spec.token_mask is not None, 0]
        self._watch_masks()
        if now < self.next_step_s:
            return
        self.next_step_s = max(self.next_step_s + self.step_s, now)
        # every row's token first, then all of them out in one quick pass, as a GPU step ends: the masks a
        # row waits for are watched again only after the pass, so a slow pass would count against them
        picked = [(slot, token) for slot in list(self.rows) if (token := self._sample_row(slot)) is not None]
        for slot, token in picked:
            self._publish(slot, token)

    def _watch_masks(self) -> None:
        """Rows awaiting their next mask: the time it is first seen in the ring."""
        now_ns = time.monotonic_ns()
        for slot, sent_ns in list(self.published_ns.items()):
            row = self.rows[slot]
            words = self.consumer.mask(slot, row[2])
            if words is not None:
                row[3] = words
                self.mask_latency_us.append((now_ns - sent_ns) / 1e3)
                del self.published_ns[slot]

    def _sample_row(self, slot: int) -> int | None:
        """The row's token this step, or None: cancelled (finished now), no room, or waiting for its mask."""
        seq, spec, produced, words, constrained, waited = self.rows[slot]
        if self.consumer.cancelled(slot, seq):
            self._finish(slot, FinishReason.CANCELLED)
            return None
        if self.consumer.room(slot) == 0:
            return None
        if constrained and words is None:
            self.num_skipped += 1
            self.rows[slot][5] += 1
            self.skipped_by_index[min(bisect.bisect_right(SKIP_BUCKETS, produced), len(SKIP_BUCKETS) - 1)] += 1
            second = int(self.now_s - self.first_step_s)  # when in the run: bursts seconds apart, or spread?
            self.skipped_by_second[second] = self.skipped_by_second.get(second, 0) + 1
            return None  # this row waits for its mask; the others go on
        self.num_sampled += 1
        if constrained:
            self.steps_late[min(waited, MAX_STEPS_LATE)] += 1
            self.rows[slot][5] = 0
        return self._pick(words) if constrained else ord("a")

    def _publish(self, slot: int, token: int) -> None:
        seq, spec, produced, words, constrained, _ = self.rows[slot]
        if token == self.eos_id:
            return self._finish(slot, FinishReason.STOP)
        self.consumer.publish(slot, [token])
        self.rows[slot][2:4] = [produced + 1, None]
        if produced + 1 >= spec.max_tokens:
            return self._finish(slot, FinishReason.LENGTH)
        if constrained:
            self.published_ns[slot] = time.monotonic_ns()

    def _pick(self, words: np.ndarray) -> int:
        """EOS if allowed, else a seeded random allowed token (a random non-empty word, a random bit of it)."""
        if words[self.eos_id // 32] >> np.uint32(self.eos_id % 32) & 1:
            return self.eos_id
        nonzero = np.flatnonzero(words)
        index = int(nonzero[self.rng.integers(len(nonzero))])
        word = int(words[index])
        bits = [b for b in range(32) if word >> b & 1]
        return 32 * index + bits[int(self.rng.integers(len(bits)))]

    def _finish(self, slot: int, reason: FinishReason) -> None:
        self.consumer.finish(slot, reason)
        self.published_ns.pop(slot, None)
        del self.rows[slot]


def _mask_engine_main(ring: str, control: str, step_s: float, stop: mp.Event, stats_path: str | None,
                      preset: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()
    MaskTrafficEngine(ring, control, step_s, preset=preset).run(stop, stats_path)


@contextlib.contextmanager
def mask_traffic_engine(step_s: float, stats_path: str | None = None, preset: str = MASK_PRESET):
    """A MaskTrafficEngine process with `preset`'s vocabulary; yields (ring name, control address, pid); its
    stats go to `stats_path`."""
    mask_tokenizer_dir(default_cache_dir(), preset)  # built here once, before the engine's fork
    ring, control = f"blink-masktraffic-{os.getpid()}", f"127.0.0.1:{free_port()}"
    stop = mp.Event()
    engine = mp.get_context("fork").Process(target=_mask_engine_main, daemon=True,
                                            args=(ring, control, step_s, stop, stats_path, preset))
    engine.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/dev/shm/{ring}") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        yield ring, control, engine.pid
    finally:
        stop.set()
        engine.join(timeout=10)
