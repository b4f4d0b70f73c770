"""The structs `gateway/streaming/stream_round.py` hands to the C round (`gateway/streaming/csrc/stream_round.c`), declared once.
`python -m protocols.layout.gen` writes `gateway/streaming/stream_round_layout.py` (ctypes) and
`gateway/streaming/csrc/stream_round_layout.h`. Writers: "python" (the gateway's Python side), "c" (the round).
"""
from protocols.layout import Enum, Field, Layout, Struct

_RING = (
    Field("ring", "uint8_t*", writer="python", doc="the mapping's first byte"),
    Field("responses_offset", "uint64_t", writer="python", doc="bytes"),
    Field("response_bytes", "uint32_t", writer="python"),
    Field("num_slots", "uint32_t", writer="python"),
    Field("off_seq", "uint32_t", writer="python", doc="a response's words (protocols/ring.py RESP_*)"),
    Field("off_produced", "uint32_t", writer="python"),
    Field("off_finish", "uint32_t", writer="python"),
    Field("off_consumed", "uint32_t", writer="python"),
    Field("off_tokens", "uint32_t", writer="python"),
    Field("max_output_len", "uint32_t", writer="python", doc="tokens a response holds (a circular buffer)"),
    Field("piece_offsets", "const uint32_t*", writer="python", doc="[vocab_size + 1] into piece_bytes"),
    Field("piece_bytes", "const uint8_t*", writer="python"),
    Field("vocab_size", "uint32_t", writer="python"),
)

_TAKEN = (
    Field("consumed", "int32_t", writer="c", doc="tokens read from the response"),
    Field("num_tokens", "int32_t", writer="c", doc="tokens the stream has taken (the usage count)"),
    Field("num_pending", "int32_t", writer="c", doc="bytes of an incomplete character"),
    Field("unsent_len", "int32_t", writer="c", doc="a chunk's rest the socket did not take"),
    Field("reason", "int32_t", writer="c", doc="sr_back_reason: why C handed the stream back"),
    Field("last_token_ns", "int64_t", writer="c"),
    Field("bytes_sent", "uint64_t", writer="c"),
    Field("pending", "uint8_t", 4, writer="c"),
)

_TAP = (
    Field("times_ns", "int64_t*", writer="python", doc="[cap_entries] each chunk's send time (CLOCK_MONOTONIC)"),
    Field("ends", "int64_t*", writer="python", doc="[cap_entries] its end in bytes"),
    Field("bytes", "uint8_t*", writer="python", doc="[cap_bytes]"),
    Field("cap_entries", "uint64_t", writer="python"),
    Field("cap_bytes", "uint64_t", writer="python"),
    Field("num_entries", "uint64_t", writer="c"),
    Field("num_bytes", "uint64_t", writer="c"),
)

LAYOUT = Layout(
    name="stream_round",
    py_out="gateway/streaming/stream_round_layout.py",
    c_out="gateway/streaming/csrc/stream_round_layout.h",
    doc="What the gateway's Python side and its C stream round exchange (gateway/csrc/stream_round.c).",
    items=(
        Enum("sr_back_reason", "BackReason", "SR_BACK_", (
            ("NONE", 0, "not handed back"), ("FINISH", 1, "the request finished"),
            ("SEQ", 2, "the response belongs to another request"), ("TOKEN", 3, "a token outside the vocabulary, or more than a response holds"),
            ("UTF8", 4, "an invalid UTF-8 sequence"), ("BUDGET", 5, "the key's token budget"),
            ("SIZE", 6, "an update too large for one chunk"), ("AGAIN", 7, "the socket would block"),
            ("ERROR", 8, "the socket failed"), ("PARTIAL", 9, "the socket took a chunk only in part")),
            doc="Why C handed a stream back to Python"),
        Struct("sr_ring", _RING, ctypes_name="SrRing", doc="what the Python side fills once per ring"),
        Struct("sr_taken", _TAKEN, ctypes_name="SrTaken", doc="a stream's state as it comes back to Python"),
        Struct("sr_tap", _TAP, ctypes_name="SrTap", doc="a benchmark's tap: each chunk C sends (bench/gateway_probe.py)"),
    ),
)
