"""The tcp transport's frames: every message round-trips; garbage is a WireError, never a crash."""
import asyncio
import struct

import pytest

from protocols import tcp_wire as W
from protocols.ring import EngineState, ErrorCode, FinishReason, RequestSpec, RingGeometry, TokenLogprob

GEOM = RingGeometry(num_slots=8, max_prompt_len=64, max_output_len=16, max_stop_ids=4)
SPEC = RequestSpec(request_id=2**63 + 1, prompt_ids=(5, -1, 2**31 - 1), max_tokens=9, temperature=0.5, top_p=0.75,
                   top_k=3, min_p=0.125, seed=2**64 - 1, stop_ids=(7, 8), ignore_eos=True, priority=2)

MESSAGES = [
    W.Hello(GEOM, "fp-abc", (0, 3, 7)),
    W.Submit(5, SPEC),
    W.Submit(0, RequestSpec(request_id=1, prompt_ids=(1,), max_tokens=1)),
    W.Submit(1, RequestSpec(request_id=3, prompt_ids=(1, 2), max_tokens=4, presence_penalty=0.5,
                            frequency_penalty=-1.25, repetition_penalty=1.5, logit_bias=((7, -100.0), (9, 2.5)),
                            num_logprobs=0)),
    W.Submit(2, RequestSpec(request_id=4, prompt_ids=tuple(range(40)), max_tokens=2, block_hashes=(1, 2**64 - 1))),
    W.Submit(2, RequestSpec(request_id=4, prompt_ids=(3,), max_tokens=2, token_mask=b"\x01\0\0\0\0\0\0\x80")),
    W.Mask(3, 17, b"\xff\0\0\0\x01\0\0\0"),
    W.Mask(1, 2**32 - 2, b""),
    W.Submit(5, RequestSpec(request_id=6, prompt_ids=tuple(range(40)), max_tokens=2, block_hashes=(5, 6),
                            token_mask=b"\x03\0\0\0")),
    W.Cancel(4),
    W.Consumed(((1, 10), (2, 2**32 - 1))),
    W.Ping(),
    W.Tokens(3, (1, 2, 3), FinishReason.ERROR, ErrorCode.NO_KV_CAPACITY, 17),
    W.Tokens(3),
    W.Tokens(3, (9,), cached_tokens=32),
    W.Tokens(2, (4, 5), logprobs=(TokenLogprob(-0.5, ((4, -0.5), (1, -1.25))), TokenLogprob(-2.0, ((9, -0.25), (5, -2.0))))),
    W.Tokens(2, (4,), logprobs=(TokenLogprob(-0.5),)),
    W.Freed((1, 2)),
    W.State(12345, EngineState.SERVING, {n: i + 1 for i, n in enumerate(W.State.STAT_NAMES)}),
]


def _roundtrip(frame: bytes):
    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        return await W.read_message(reader)
    return asyncio.run(read())


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert _roundtrip(W.encode(msg)) == msg


def test_an_agent_of_another_wire_version_is_told_apart():
    frame = W.encode(W.Hello(GEOM, "fp", (1,), version=1))
    assert _roundtrip(frame).version == 1


def test_seedless_spec_stays_seedless():
    got = _roundtrip(W.encode(W.Submit(1, RequestSpec(request_id=1, prompt_ids=[1], max_tokens=1))))
    assert got.spec.seed is None and got.spec.ignore_eos is False


@pytest.mark.parametrize("frame, words", [
    (struct.pack("<IB", 0, 99), "unknown message type"),
    (struct.pack("<IB", 2, W.Submit.TYPE) + b"xx", "malformed Submit"),
    (struct.pack("<IB", W.MAX_FRAME_BYTES + 1, 1), "over the limit"),
    (W.encode(W.Hello(GEOM, "fp", ())).replace(struct.pack("<I", W.WIRE_MAGIC), b"XXXX", 1), "bad magic"),
    (W.encode(W.Tokens(1)).replace(struct.pack("<II", 1, 0), struct.pack("<II", 1, 77), 1), "unknown finish"),
])
def test_garbage_is_a_wire_error(frame, words):
    with pytest.raises(W.WireError, match=words):
        _roundtrip(frame)


def test_outbox_writes_frames_back_to_back():
    class Sink:
        data = b""

        def write(self, b):
            self.data += b
    box, sink = W.Outbox(), Sink()
    box.put(W.Ping())
    box.put(W.Cancel(2))
    box.flush(sink)
    assert sink.data == W.encode(W.Ping()) + W.encode(W.Cancel(2)) and not box
