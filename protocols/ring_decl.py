"""The ring's fixed layout, declared once: header, request slot, response slot, their flags, enums and
constants. `python -m protocols.layout.gen` writes `protocols/ring_layout.py` (imported by
`protocols/ring.py`, which adds the geometry) and `kernels/csrc/include/blink_ring_layout.h` (included by
`blink_ring.h`). Writers: "creator" (the backend, once, before anyone attaches), "engine", "gateway".
"""
from protocols.layout import FLEX, Const, Enum, Field, Layout, Struct

_HEADER = (
    Field("magic", "uint64_t", writer="creator", doc="RING_MAGIC, stored last"),
    Field("version", "uint32_t", writer="creator"),
    Field("header_bytes", "uint32_t", writer="creator"),
    Field("num_slots", "uint32_t", writer="creator"),
    Field("max_prompt_len", "uint32_t", writer="creator"),
    Field("max_output_len", "uint32_t", writer="creator"),
    Field("max_stop_ids", "uint32_t", writer="creator"),
    Field("request_bytes", "uint32_t", writer="creator"),
    Field("response_bytes", "uint32_t", writer="creator"),
    Field("sq_offset", "uint64_t", writer="creator"),
    Field("requests_offset", "uint64_t", writer="creator"),
    Field("responses_offset", "uint64_t", writer="creator"),
    Field("total_bytes", "uint64_t", writer="creator"),
    Field("max_logit_bias", "uint32_t", writer="creator", doc="version 2"),
    Field("max_logprobs", "uint32_t", writer="creator"),
    Field("logprob_window", "uint32_t", writer="creator"),
    Field("kv_block_size", "uint32_t", writer="creator",
          doc="version 3: tokens per KV block (what each block hash covers)"),
    Field("logit_bias_offset", "uint64_t", writer="creator", doc="the logprobs region follows this one"),
    Field("fingerprint", "char", 32, writer="creator", doc="ASCII, NUL-padded"),
    Field("heartbeat", "uint64_t", writer="engine", at=128, doc="bumped every engine loop iteration"),
    Field("engine_state", "uint32_t", writer="engine", doc="EngineState"),
    Field("cached_kv_blocks", "uint32_t", writer="engine", doc="version 3: KV blocks holding a published hash"),
    Field("sq_head", "uint64_t", writer="engine", doc="submission-queue entries consumed so far"),
    Field("free_kv_blocks", "uint32_t", writer="engine"),
    Field("total_kv_blocks", "uint32_t", writer="engine"),
    Field("running", "uint32_t", writer="engine", doc="sequences in the running batch"),
    Field("waiting", "uint32_t", writer="engine", doc="admitted-but-waiting sequences"),
    Field("generated_tokens", "uint64_t", writer="engine", doc="total tokens published"),
    Field("prefix_cache_queries", "uint64_t", writer="engine", doc="version 3: prompt tokens looked up"),
    Field("prefix_cache_hits", "uint64_t", writer="engine", doc="version 3: of those, tokens found cached"),
    Field("sq_tail", "uint64_t", writer="gateway", at=192, doc="submission-queue entries written so far"),
    Field("mask_words", "uint32_t", writer="creator", doc="version 3: u32 words of a token mask, ceil(vocab / 32); "
          "0: this ring takes no constrained requests. Lines 0-2 are full; written before anyone attaches and "
          "never again, so it shares the gateway's line without false sharing"),
)

_REQUEST = (
    Field("seq", "uint64_t", writer="gateway", doc="nonzero submission number, stored last: validates the rest"),
    Field("request_id", "uint64_t", writer="gateway"),
    Field("prompt_len", "uint32_t", writer="gateway"),
    Field("max_tokens", "uint32_t", writer="gateway"),
    Field("temperature", "float", writer="gateway", doc="0 means greedy"),
    Field("top_p", "float", writer="gateway"),
    Field("top_k", "int32_t", writer="gateway", doc="0 means off"),
    Field("min_p", "float", writer="gateway"),
    Field("seed", "uint64_t", writer="gateway"),
    Field("flags", "uint32_t", writer="gateway", doc="FLAG_*"),
    Field("priority", "uint32_t", writer="gateway", doc="0 = latency-sensitive (first), larger = later"),
    Field("num_stop_ids", "uint32_t", writer="gateway"),
    Field("cancel_seq", "uint64_t", writer="gateway", doc="equals seq once the gateway asks to cancel"),
    Field("presence_penalty", "float", writer="gateway", doc="0 means off (version 2)"),
    Field("frequency_penalty", "float", writer="gateway", doc="0 means off"),
    Field("repetition_penalty", "float", writer="gateway", doc="1 means off"),
    Field("num_logit_bias", "uint32_t", writer="gateway", doc="entries in the slot's logit-bias area"),
    Field("num_logprobs", "uint32_t", writer="gateway", doc="alternatives per token with FLAG_LOGPROBS"),
    Field("num_block_hashes", "uint32_t", writer="gateway",
          doc="version 3: entries in the slot's block-hash area (one per full prompt block, chained)"),
    Field("stop_ids", "int32_t", FLEX, writer="gateway", at=128,
          doc="[max_stop_ids], then the prompt [max_prompt_len] at the geometry's prompt_offset"),
)

_RESPONSE = (
    Field("seq", "uint64_t", writer="engine", doc="the request seq these counters belong to, stored last"),
    Field("produced", "uint32_t", writer="engine", doc="tokens written so far; token i at tokens[i % max_output_len]"),
    Field("finish_reason", "uint32_t", writer="engine", doc="FinishReason, after the last produced"),
    Field("first_token_ns", "uint64_t", writer="engine", doc="engine clock (CLOCK_MONOTONIC or GPU globaltimer)"),
    Field("last_token_ns", "uint64_t", writer="engine"),
    Field("prompt_len", "uint32_t", writer="engine", doc="prompt tokens the engine accepted"),
    Field("error_code", "uint32_t", writer="engine", doc="ErrorCode when finish_reason is ERROR"),
    Field("cached_tokens", "uint32_t", writer="engine",
          doc="version 3: prompt tokens taken from the prefix cache, before the first produced"),
    Field("consumed", "uint32_t", writer="gateway", at=64,
          doc="tokens read so far (backpressure: produced - consumed <= capacity)"),
    Field("tokens", "int32_t", FLEX, writer="engine", at=128, doc="[max_output_len], a circular buffer"),
)

LAYOUT = Layout(
    name="ring",
    py_out="protocols/ring_layout.py",
    c_out="kernels/csrc/include/blink_ring_layout.h",
    doc="The ring's fixed layout (protocols/ring.py adds the geometry; DESIGN.md, \"The rings\").",
    items=(
        Const("RING_MAGIC", "BLINK_RING_MAGIC", 0x474E_4952_4B4E_494C, 'b"LINKRING" little-endian', hex=True,
              c_suffix="ULL"),
        Const("RING_VERSION", "BLINK_RING_VERSION", 3, "2: penalties, logit bias and logprobs; 3: block hashes and "
              "token masks"),
        Const("HEADER_BYTES", "BLINK_RING_HEADER_BYTES", 256),
        Const("FINGERPRINT_BYTES", "BLINK_RING_FINGERPRINT_BYTES", 32),
        Const("FLAG_HAS_SEED", "BLINK_RING_FLAG_HAS_SEED", 1 << 0, "request flags: RequestSpec booleans"),
        Const("FLAG_IGNORE_EOS", "BLINK_RING_FLAG_IGNORE_EOS", 1 << 1),
        Const("FLAG_LOGPROBS", "BLINK_RING_FLAG_LOGPROBS", 1 << 2,
              "publish the chosen token's logprob and num_logprobs alternatives per token"),
        Const("FLAG_CONSTRAINED", "BLINK_RING_FLAG_CONSTRAINED", 1 << 3,
              "every generated token i is sampled under the slot's mask i (the mask area's mask_seq = i + 1)"),
        Enum("blink_finish_reason", "FinishReason", "BLINK_FINISH_", (
            ("NONE", 0, "still running"), ("STOP", 1, "EOS or a stop token id"), ("LENGTH", 2, "max_tokens reached"),
            ("CANCELLED", 3, "the producer asked (client gone, stop string matched)"),
            ("ERROR", 4, "see ErrorCode")), doc="Why a request ended. Written by the engine into the response area."),
        Enum("blink_error_code", "ErrorCode", "BLINK_ERROR_", (
            ("NONE", 0, ""),
            ("PROMPT_TOO_LONG", 1, "the prompt plus max_tokens exceeds the model's context length"),
            ("INVALID_PARAMS", 2, "the engine rejected the sampling parameters"),
            ("NO_KV_CAPACITY", 3, "the request needs more KV cache than the whole engine holds"),
            ("ENGINE_STOPPING", 4, "the engine is shutting down and did not finish this request"),
            ("INTERNAL", 5, "the engine failed while running this request")),
            doc="Detail for FinishReason.ERROR, with a message the gateway can show to the client.", messages=True),
        Enum("blink_engine_state", "EngineState", "BLINK_ENGINE_", (
            ("STARTING", 0, ""), ("SERVING", 1, ""), ("STOPPING", 2, ""), ("STOPPED", 3, "")),
            doc="Engine lifecycle, written by the engine into the header."),
        Struct("blink_ring_header", _HEADER, size=256, prefix="HDR_", fields_dict="HEADER_FIELDS",
               dtype_name="HEADER_DTYPE",
               doc="lines 0-1 by the creator (magic last), line 2 by the engine, line 3 by the gateway (but the "
                   "creator's mask_words)"),
        Struct("blink_request_slot", _REQUEST, prefix="REQ_", fields_dict="REQUEST_FIELDS",
               dtype_name="REQUEST_DTYPE", doc="fixed part of a request slot (gateway writes; seq last)"),
        Struct("blink_response_slot", _RESPONSE, prefix="RESP_", fields_dict="RESPONSE_FIELDS",
               dtype_name="RESPONSE_DTYPE", doc="line 0 and the tokens by the engine, line 1 by the gateway"),
    ),
)
