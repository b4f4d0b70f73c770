"""The scheduler's state, declared once: its config and header structs and the arrays carved after them
from one buffer (device memory in the loop, a numpy array on the host), the "hot" ones first (every step
touches them; the loop copies that prefix to shared memory), then the "cold" ones. Dimensions: N slots,
STOP stop ids per slot, MB blocks per sequence, CTX context length, BLOCKS KV blocks, HT cells of the prefix
cache's hash table.
`python -m protocols.layout.gen` writes `kernels/sched_layout.py` (used by
`gpu_backend/engine/sched_native.py`) and `kernels/csrc/include/blink_sched_layout.h` (`blink_sched.h`).
"""
from protocols.layout import Array, ArrayBlock, Const, Enum, Field, Layout, Struct
from protocols.ring_decl import LAYOUT as RING

MAX_EOS, MAX_BUCKETS = 8, 32
_RING_ERRORS = next(e for e in RING.items if isinstance(e, Enum) and e.py_name == "ErrorCode").values

_CONFIG = (
    Field("max_slots", "int32_t", doc="ring slots: sequence state is indexed by slot"),
    Field("num_blocks", "int32_t"),
    Field("block_size", "int32_t"),
    Field("context_len", "int32_t", doc="prompt + generated tokens a sequence may hold"),
    Field("budget", "int32_t", doc="max_num_batched_tokens"),
    Field("max_num_seqs", "int32_t", doc="running sequences at most"),
    Field("max_stop_ids", "int32_t"),
    Field("num_eos", "int32_t"),
    Field("eos_ids", "int32_t", MAX_EOS),
    Field("step_max_tokens", "int32_t", doc="T of the step buffer the bucket graphs read"),
    Field("step_max_seqs", "int32_t", doc="S (a bucket's graph has min(bucket, S) rows)"),
    Field("num_buckets", "int32_t"),
    Field("buckets", "int32_t", MAX_BUCKETS),
    Field("prefix_caching", "int32_t", doc="0: no lookups, no publishing (the scheduler as before the cache)"),
    Field("hash_slots", "int32_t", doc="HT: cells of the hash -> block table, a power of two > num_blocks"),
)

_HEADER = (
    Field("cfg", "blink_sched_config"),
    Field("next_arrival", "int64_t"),
    Field("free_head", "int32_t", doc="free blocks: a FIFO ring (pop left, push right)"),
    *(Field(n, "int32_t") for n in ("num_free", "num_running", "num_waiting", "num_entries", "num_preempted",
                                    "num_new", "num_finished", "bucket", "num_tokens", "num_sampled", "all_greedy")),
    Field("spec_mode", "int32_t", doc="the loop's speculation: nothing is preempted, a step that would need it"),
    Field("spec_tainted", "int32_t", doc="sets this, and the loop schedules that step again from the real state"),
    Field("lru_head", "int32_t", doc="prefix cache: unreferenced cached blocks, least recently used first"),
    Field("lru_tail", "int32_t"),
    Field("num_evictable", "int32_t", doc="blocks on that list: allocatable, like the free ones"),
    Field("num_cached", "int32_t", doc="blocks holding a published hash"),
    Field("prefix_queries", "int64_t", doc="tokens of the sequences looked up (vLLM's queries)"),
    Field("prefix_hits", "int64_t", doc="of those, tokens found cached"),
)


def _hot(name: str, ctype: str, *shape: str, doc: str = "") -> Array:
    return Array(name, ctype, shape or ("N",), doc=doc, group="hot")


def _cold(name: str, ctype: str, *shape: str, doc: str = "") -> Array:
    return Array(name, ctype, shape, doc=doc, group="cold")


_ARRAYS = (
    _hot("status", "int32_t", doc="blink_seq_status"), _hot("prompt_len", "int32_t"), _hot("num_tokens", "int32_t"),
    _hot("num_computed", "int32_t"), _hot("num_table", "int32_t"), _hot("num_preemptions", "int32_t"),
    _hot("priority", "int64_t"), _hot("arrival", "int64_t"), _hot("max_tokens", "int64_t"),
    _hot("ignore_eos", "int32_t"), _hot("num_stop", "int32_t"),
    _hot("temperature", "float"), _hot("top_p", "float"), _hot("min_p", "float"), _hot("top_k", "int32_t"),
    _hot("seed", "uint64_t"), _hot("scheduled", "uint8_t", doc="scratch of one step"),
    _hot("running", "int32_t", doc="slot ids, in the reference's list order"), _hot("waiting", "int32_t"),
    _hot("entry_slot", "int32_t", doc="one step's batch"), _hot("entry_q_len", "int32_t"),
    _hot("entry_samples", "int32_t"), _hot("entry_start", "int32_t"), _hot("entry_q_start", "int32_t", "N+1"),
    _hot("preempted", "int32_t"), _hot("new_slot", "int32_t", doc="update's results"), _hot("new_token", "int32_t"),
    _hot("fin_slot", "int32_t"), _hot("fin_reason", "int32_t"),
    _hot("num_hashes", "int32_t", doc="the request's block hashes (prompt blocks)"),
    _hot("num_published", "int32_t", doc="leading blocks of the table already in the cache or passed over"),
    _cold("stop_ids", "int32_t", "N", "STOP"), _cold("block_table", "int32_t", "N", "MB"),
    _cold("tokens", "int32_t", "N", "CTX", doc="prompt + generated"), _cold("free_blocks", "int32_t", "BLOCKS"),
    _cold("cached_tokens", "int32_t", "N", doc="prompt tokens the first admission took from the cache"),
    _cold("seq_hashes", "uint64_t", "N", "MB"), _cold("block_hash", "uint64_t", "BLOCKS", doc="0: none"),
    _cold("block_ref", "int32_t", "BLOCKS", doc="sequences holding the block"),
    _cold("lru_prev", "int32_t", "BLOCKS"), _cold("lru_next", "int32_t", "BLOCKS"),
    _cold("block_mark", "uint32_t", "BLOCKS", doc="scratch of one lookup: 1 for a block it met, 0 between lookups"),
    _cold("hash_table", "int32_t", "HT", doc="block ids, -1 empty; the key is the block's hash"),
)

LAYOUT = Layout(
    name="sched",
    py_out="kernels/sched_layout.py",
    c_out="kernels/csrc/include/blink_sched_layout.h",
    doc="The scheduler's state (kernels/csrc/include/blink_sched.h): config, header, carved arrays.",
    items=(
        Const("MAX_EOS", "BLINK_SCHED_MAX_EOS", MAX_EOS, c_suffix=""),
        Const("MAX_BUCKETS", "BLINK_SCHED_MAX_BUCKETS", MAX_BUCKETS, c_suffix=""),
        Const("TOKEN_WAIT", "BLINK_TOKEN_WAIT", -2147483647, c_suffix="",
              doc="a sampled row's 'token' when its mask had not come: no token, the same position runs again"),
        Const("TOKEN_MASK_EMPTY", "BLINK_TOKEN_MASK_EMPTY", -2147483646, c_suffix="",
              doc="a sampled row's 'token' when its mask allows nothing: the request ends with INVALID_PARAMS"),
        Enum("blink_seq_status", "SeqStatus", "BLINK_SEQ_", (
            ("WAITING", 0, ""), ("RUNNING", 1, ""), ("FINISHED", 2, "the slot is free"),
            ("STOPPING", 3, "the loop's asynchronous take only: a stop token sampled after the next step launched")),
            doc="A slot's sequence"),
        Enum("blink_sched_error", "SchedError", "BLINK_ERR_", _RING_ERRORS[:4],
             doc="Why a request can never run: the ring's ErrorCode values (protocols/ring_decl.py)"),
        Struct("blink_sched_config", _CONFIG, ctypes_name="SchedConfig"),
        Struct("blink_sched_header", _HEADER, ctypes_name="SchedHeader"),
        ArrayBlock("SCHED", _ARRAYS, dims=("N", "STOP", "MB", "CTX", "BLOCKS", "HT"),
                   doc="per slot (N), then shared, then one step's batch; the cold arrays last"),
    ),
)
