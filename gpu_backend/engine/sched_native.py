"""The scheduler every engine runs: `kernels/csrc/include/blink_sched.h`, the very code the GPU-resident
loop runs, built for the host (`kernels/sched_host.py`) and driven through ctypes by the `cpu` and `host`
engines (`engine/loop.py`). No torch, no device memory.

State is in the device loop's shapes: sequences indexed by ring slot, fixed arrays in one buffer (`state`,
a numpy array here, device memory in the loop). A plain-Python twin lives in the tests
(`tests/gpu_backend/reference_scheduler.py`); `tests/gpu_backend/test_sched_native.py` diffs the two step by
step. Sequences are named by slot, and `update` takes the sampled tokens as a list in entry order (what the
runner returns).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from kernels import sched_host
from kernels.sched_layout import MAX_BUCKETS, MAX_EOS, SCHED_ARRAYS, SchedConfig, SchedHeader, SeqStatus
from protocols.layout.views import shape_of
from protocols.ring import REQ_STOP_IDS, ErrorCode, FinishReason, RequestSpec, RingGeometry

SLOT_FREE = SeqStatus.FINISHED  # a finished slot is a free slot
_Config, _Header = SchedConfig, SchedHeader  # blink_sched_config, blink_sched_header (kernels/sched_decl.py)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 256  # per-step token budget
    max_num_seqs: int = 64  # running sequences at most
    context_len: int = 2048  # prompt + generated tokens a sequence may hold
    eos_token_ids: tuple[int, ...] = ()
    enable_prefix_caching: bool = False  # reuse cached prompt blocks named by the requests' block hashes

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.context_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")


def admit_limits(geometry: RingGeometry, vocab_size: int) -> sched_host.AdmitLimits:
    """The admission check's limits for a ring of `geometry` and a model of `vocab_size` tokens."""
    g = geometry
    return sched_host.AdmitLimits(g.max_prompt_len, g.max_stop_ids, g.max_logit_bias, g.max_logprobs, vocab_size,
                                  g.max_block_hashes, g.kv_block_size, g.mask_words)


def hash_slots_for(num_blocks: int, prefix_caching: bool) -> int:
    """Cells of the prefix cache's hash table: a power of two at least twice the blocks (1 with the cache off)."""
    return 1 << (2 * num_blocks - 1).bit_length() if prefix_caching else 1


class _Bound(ctypes.Structure):  # blink_sched: the header's address, then each carved array's, in list order
    _fields_ = [("h", ctypes.c_void_p)] + [(name, ctypes.c_void_p) for name, _, _ in SCHED_ARRAYS]


@dataclass(frozen=True)
class StepGeometry:
    """The step buffer the bucket graphs read (step_buffers.StepBuffers): T tokens, S rows, the buckets."""

    max_tokens: int
    max_seqs: int
    buckets: tuple[int, ...]


@dataclass(frozen=True)
class NativeEntry:
    slot: int
    q_len: int
    samples: bool


class NativeScheduler:
    """`add` -> `schedule` -> `fill` (the step buffer) -> (model runs) -> `update`; `finish` between steps."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_slots: int,
                 max_stop_ids: int = 16, step: StepGeometry | None = None):
        step = step or StepGeometry(config.max_num_batched_tokens, config.max_num_seqs, (config.max_num_batched_tokens,))
        if len(config.eos_token_ids) > MAX_EOS or len(step.buckets) > MAX_BUCKETS:
            raise ValueError(f"at most {MAX_EOS} eos ids and {MAX_BUCKETS} buckets")
        self.lib = sched_host.load()
        c = _Config(max_slots, num_blocks, block_size, config.context_len, config.max_num_batched_tokens,
                    config.max_num_seqs, max_stop_ids, len(config.eos_token_ids))
        c.eos_ids[: len(config.eos_token_ids)] = list(config.eos_token_ids)
        c.step_max_tokens, c.step_max_seqs, c.num_buckets = step.max_tokens, step.max_seqs, len(step.buckets)
        c.buckets[: len(step.buckets)] = list(step.buckets)
        c.prefix_caching = int(config.enable_prefix_caching)
        c.hash_slots = hash_slots_for(num_blocks, config.enable_prefix_caching)
        self.config, self.max_slots, self.max_stop_ids = config, max_slots, max_stop_ids
        nbytes = self.lib.blink_sched_state_bytes(ctypes.byref(c))
        self.state = np.zeros(-(-nbytes // 8), dtype=np.uint64)  # [bytes/8] u64: 8-byte aligned, host
        self.lib.blink_sched_host_init(self._mem, ctypes.byref(c))
        self.h = _Header.from_address(self._mem)
        self.a = self._views(max_slots, num_blocks, -(-config.context_len // block_size), config.context_len, c.hash_slots)
        self._scratch = np.zeros(max_slots, dtype=np.int32)
        offsets = np.zeros(15, dtype=np.uint64)  # BLINK_STEP_NUM_FIELDS
        self.step_bytes = self.lib.blink_sched_step_layout(step.max_tokens, step.max_seqs, self.a["block_table"].shape[1],
                                                           offsets.ctypes.data)

    @property
    def _mem(self) -> int:
        return self.state.ctypes.data

    def _views(self, n: int, blocks: int, mb: int, ctx: int, ht: int) -> dict[str, np.ndarray]:
        bound = _Bound()
        self.lib.blink_sched_host_bind(self._mem, ctypes.byref(bound))
        dims = {"N": n, "STOP": self.max_stop_ids, "MB": mb, "CTX": ctx, "BLOCKS": blocks, "HT": ht}
        views = {}
        for name, dtype, declared in SCHED_ARRAYS:
            shape = shape_of(declared, dims)
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raw = (ctypes.c_uint8 * nbytes).from_address(getattr(bound, name))
            views[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
        return views

    # ---- admission -------------------------------------------------------------------------------
    def admission_error(self, limits: sched_host.AdmitLimits, words: bytes, spec: RequestSpec,
                        has_ext: bool) -> ErrorCode:
        """Why the request taken from a ring slot can never run, or NONE: blink_admit.h's decision, the one
        the GPU loop takes. `words`: the slot's fixed part as the engine read it (once); `spec`: what the
        engine keeps of it, its arrays the slot's counts clipped to the geometry; `has_ext`: the engine
        applies penalties, logit bias and logprobs."""
        if len(words) != REQ_STOP_IDS:
            raise ValueError(f"words: {len(words)} bytes, a slot's fixed part is {REQ_STOP_IDS}")
        prompt = np.asarray(spec.prompt_ids, dtype=np.int32)  # [n] int32, host
        stops = np.asarray(spec.stop_ids, dtype=np.int32)
        bias_ids = np.asarray([token for token, _ in spec.logit_bias], dtype=np.int32)
        bias_values = np.asarray([bias for _, bias in spec.logit_bias], dtype=np.float32)
        return ErrorCode(self.lib.blink_admit_host_error(
            self._mem, ctypes.byref(limits), words, prompt.ctypes.data, prompt.size, stops.ctypes.data, stops.size,
            bias_ids.ctypes.data, bias_values.ctypes.data, bias_ids.size, int(has_ext)))

    def check(self, spec: RequestSpec) -> ErrorCode:
        """The scheduler's part of the admission (blink_sched_check: lengths, sampling parameters, KV
        capacity), which tests diff against the reference scheduler's."""
        return ErrorCode(self.lib.blink_sched_host_check(self._mem, len(spec.prompt_ids), spec.max_tokens,
                                                         spec.temperature, spec.top_p, spec.top_k, spec.min_p))

    def add(self, slot: int, spec: RequestSpec, rng_seed: int) -> None:
        if not 0 <= slot < self.max_slots or self.a["status"][slot] != SLOT_FREE:
            raise ValueError(f"slot {slot} is not a free slot of 0..{self.max_slots - 1}")
        if len(spec.stop_ids) > self.max_stop_ids:
            raise ValueError(f"stop_ids: {len(spec.stop_ids)} ids, at most {self.max_stop_ids}")
        prompt = np.asarray(spec.prompt_ids, dtype=np.int32)
        stops = np.asarray(spec.stop_ids, dtype=np.int32)
        hashes = np.asarray(spec.block_hashes, dtype=np.uint64)  # the scheduler keeps those of full prompt blocks
        self.lib.blink_sched_host_add(self._mem, slot, prompt.ctypes.data, len(prompt), spec.max_tokens, spec.priority,
                                      stops.ctypes.data, len(stops), int(spec.ignore_eos), spec.temperature,
                                      spec.top_k, spec.top_p, spec.min_p, rng_seed % (1 << 64), hashes.ctypes.data,
                                      len(hashes))

    def finish(self, slot: int) -> None:
        """Remove the sequence in `slot` wherever it is and free its blocks now (cancel, error)."""
        self.lib.blink_sched_host_finish(self._mem, slot)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self, room: np.ndarray) -> list[NativeEntry]:
        """room: [max_slots] int32, free space in each slot's output buffer."""
        room = np.ascontiguousarray(room, dtype=np.int32)
        if room.shape != (self.max_slots,):
            raise ValueError(f"room must have shape ({self.max_slots},), got {room.shape}")
        n = self.lib.blink_sched_host_schedule(self._mem, room.ctypes.data, self._scratch.ctypes.data)
        a = self.a
        return [NativeEntry(int(s), int(q), bool(x))
                for s, q, x in zip(a["entry_slot"][:n], a["entry_q_len"][:n], a["entry_samples"][:n])]

    @property
    def preempted(self) -> list[int]:
        return self.a["preempted"][: self.h.num_preempted].tolist()

    def fill(self, buf: np.ndarray, nthreads: int = 1) -> int:
        """Write the step into `buf` (a StepBuffers byte buffer); returns the bucket."""
        if buf.dtype != np.uint8 or not buf.flags.c_contiguous or buf.nbytes < self.step_bytes:
            raise ValueError(f"buf must be a contiguous uint8 array of at least {self.step_bytes} bytes")
        return self.lib.blink_sched_host_fill(self._mem, buf.ctypes.data, nthreads)

    def update(self, sampled: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, FinishReason]]]:
        """Apply one token per sampling entry, in entry order. Returns (slot, token) to publish and
        (slot, reason) of the sequences that finished; their blocks are already free."""
        tokens = np.asarray(sampled, dtype=np.int32)
        self.lib.blink_sched_host_update(self._mem, tokens.ctypes.data)
        a, h = self.a, self.h
        new = list(zip(a["new_slot"][: h.num_new].tolist(), a["new_token"][: h.num_new].tolist()))
        done = [(s, FinishReason(r)) for s, r in zip(a["fin_slot"][: h.num_finished].tolist(),
                                                     a["fin_reason"][: h.num_finished].tolist())]
        return new, done

    # ---- state, for stats and tests -----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.h.num_free

    @property
    def num_blocks(self) -> int:
        return self.h.cfg.num_blocks

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: the free ones and the evictable cached ones."""
        return self.h.num_free + self.h.num_evictable

    def prefix_cache_stats(self) -> tuple[int, int, int]:
        """(blocks holding a published hash, tokens looked up, tokens found cached): the ring header's words."""
        return self.h.num_cached, self.h.prefix_queries, self.h.prefix_hits

    def cached_tokens(self, slot: int) -> int:
        """Prompt tokens the sequence in `slot` took from the cache at its first admission."""
        return int(self.a["cached_tokens"][slot])

    def evictable(self) -> list[int]:
        """The evictable blocks, least recently used first."""
        out, b = [], self.h.lru_head
        while b >= 0:
            out.append(b)
            b = int(self.a["lru_next"][b])
        return out

    @property
    def num_running(self) -> int:
        return self.h.num_running

    @property
    def num_waiting(self) -> int:
        return self.h.num_waiting

    def free_list(self) -> list[int]:
        nb, head = self.h.cfg.num_blocks, self.h.free_head
        return [int(self.a["free_blocks"][(head + k) % nb]) for k in range(self.h.num_free)]

    @property
    def running(self) -> list[int]:
        return self.a["running"][: self.h.num_running].tolist()

    @property
    def waiting(self) -> list[int]:
        return self.a["waiting"][: self.h.num_waiting].tolist()

    def block_table(self, slot: int) -> list[int]:
        return self.a["block_table"][slot, : self.a["num_table"][slot]].tolist()

    def token_ids(self, slot: int) -> list[int]:
        return self.tokens(slot).tolist()

    def tokens(self, slot: int) -> np.ndarray:
        """[num_tokens] int32: prompt + generated, a view of the live state (valid until the slot is reused)."""
        return self.a["tokens"][slot, : self.a["num_tokens"][slot]]
