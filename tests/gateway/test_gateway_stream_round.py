"""The native stream round (`gateway/streaming/stream_round.py`, `gateway/streaming/csrc/stream_round.c`) on a real shared-memory
ring and real sockets: its chunks are the Python path's byte for byte, and it hands every stream back with
nothing lost or sent twice whenever it does not deliver an update itself."""

from __future__ import annotations

import codecs
import os
import random
import socket
import time
from json.encoder import encode_basestring

import pytest

from gateway.streaming import stream_round
from gateway.streaming.stream_round import PieceTable, StreamRound
from protocols import ring as R
from protocols.ring import FinishReason, RequestSpec, RingGeometry
from protocols.shm import create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

GEOM = RingGeometry(num_slots=8, max_prompt_len=16, max_output_len=64, max_stop_ids=4)
HEAD, TAIL = b'data: {"choices":[{"text":', b'}]}\n\n'
# Pieces chosen to be hard: JSON's escapes, every control byte class, and multi-byte characters whose bytes
# are split over several tokens (U+00E9, U+4E16, U+1F642), plus bytes that are never valid UTF-8.
PIECES = [b"a", b" b", b'"', b"\\", b"\n", b"\t", b"\x01", b"\x1f", b"\x7f", b"\xc3", b"\xa9", b"\xe4\xb8",
          b"\x96", b"\xf0\x9f", b"\x99\x82", b"\xff", b"\xed\xa0\x80", b"", "é€".encode(), b"/<>&", b"z" * 1000]
SPLIT = {9: [10], 11: [12], 13: [14]}  # an id that starts a character -> the ids that complete it
INVALID = (10, 12, 14, 15, 16)  # alone: never valid UTF-8 (a lone continuation byte, 0xff, a surrogate)
FIRSTS = [i for i in range(len(PIECES)) if i not in INVALID]


@pytest.fixture()
def rig():
    lib = stream_round.load()
    if lib is None:
        pytest.skip("no C compiler")
    ring = create_ring(f"blink-sr-test-{os.getpid()}", GEOM, "fp")
    producer, engine = ShmProducer(ring), RingConsumer(ring)
    native = StreamRound(lib, ring.buf, GEOM, PieceTable(PIECES))
    a, b = socket.socketpair()
    a.setblocking(False)
    b.settimeout(5)
    yield producer, engine, native, a, b
    native.close()
    a.close()
    b.close()
    ring.close()


def _start(producer, engine, native, sock, *, budget=None, chunked=True, pending=b"", max_tokens=50) -> int:
    slot = producer.submit(RequestSpec(1, [1, 2], max_tokens, temperature=0.0))
    engine.take_new()
    seq, consumed = producer.position(slot)
    assert native.enable(slot, sock.fileno(), seq, consumed, 0, budget, max_tokens, chunked, pending, HEAD, TAIL)
    return slot


def _round(native, slot):
    return native.round([slot], 123)


def _python_frame(text: str, chunked: bool = True) -> bytes:
    """The Python path's frame of a plain text chunk (`gateway.api.sse`: `_frame_parts` + `_write`)."""
    body = HEAD + encode_basestring(text).encode() + TAIL
    return b"%x\r\n%s\r\n" % (len(body), body) if chunked else body


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def _nothing_sent(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return not sock.recv(1)  # b"": closed, nothing more
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(5)


@pytest.mark.parametrize("chunked", [True, False])
def test_chunks_are_the_python_paths_byte_for_byte(rig, chunked):
    """Random token sequences (characters split over updates included): every frame is what the Python path
    writes for the same text, a character's bytes wait for the token that completes it, and the ring's
    consumed counter follows."""
    producer, engine, native, a, b = rig
    slot = _start(producer, engine, native, a, chunked=chunked, max_tokens=10_000)
    rnd, utf8, num_tokens = random.Random(7), codecs.getincrementaldecoder("utf-8")(), 0  # the Python path's decoding
    for _ in range(300):
        ids = []
        for _ in range(rnd.randint(1, 4)):
            first = rnd.choice(FIRSTS)
            ids += [first, *SPLIT.get(first, [])]
        cut = rnd.randint(1, len(ids))  # one update, then the rest: characters split between them
        for part in (ids[:cut], ids[cut:]):
            if not part:
                continue
            engine.publish(slot, part)
            num_tokens += len(part)
            assert _round(native, slot) == ([], 1, len(part))
            text = utf8.decode(b"".join(PIECES[i] for i in part))
            frame = _python_frame(text, chunked) if text else b""
            assert _read(b, len(frame)) == frame and _nothing_sent(b)
    taken = native.take_back(slot)
    assert (taken.pending, taken.consumed, taken.num_tokens) == (utf8.getstate()[0], num_tokens, num_tokens)
    assert int(engine.ring.u32[(engine.ring.resp(slot) + R.RESP_CONSUMED) // 4]) == num_tokens


def test_take_back_returns_what_the_round_did(rig):
    producer, engine, native, a, b = rig
    slot = _start(producer, engine, native, a, pending=b"\xc3")
    engine.publish(slot, [10, 0, 13])  # completes the pending é, then "a", then opens an emoji
    assert _round(native, slot) == ([], 1, 3)
    frame = _python_frame("éa")
    assert _read(b, len(frame)) == frame
    taken = native.take_back(slot)
    assert (taken.consumed, taken.num_tokens, taken.pending, taken.bytes_sent, taken.unsent) == (3, 3, b"\xf0\x9f", len(frame), b"")
    assert taken.last_token_ns == 123 and taken.reason == "none"
    assert native.take_back(slot) is None  # not the round's any more
    engine.publish(slot, [0])
    assert _round(native, slot) == ([slot], 0, 0)  # news, for Python now


@pytest.mark.parametrize("case", ["finish", "utf8", "token", "budget"])
def test_updates_it_does_not_deliver_go_back_untouched(rig, case):
    """A finish, an invalid UTF-8 sequence, a token id outside the table, a key's budget reached: the slot is
    handed back with none of the update consumed, so that Python's poll reads all of it."""
    producer, engine, native, a, b = rig
    slot = _start(producer, engine, native, a, budget=3 if case == "budget" else None)
    engine.publish(slot, [0])
    assert _round(native, slot) == ([], 1, 1)
    _read(b, len(_python_frame("a")))
    if case == "finish":
        engine.publish(slot, [1])
        engine.finish(slot, FinishReason.LENGTH)
    else:
        engine.publish(slot, {"utf8": [0, 15], "token": [0, len(PIECES)], "budget": [1, 1]}[case])
    assert _round(native, slot) == ([slot], 0, 0)
    taken = native.take_back(slot)
    assert (taken.reason, taken.consumed, taken.num_tokens) == (case, 1, 1)
    producer.resume_at(slot, taken.consumed)
    update = producer.poll(slot)
    assert update.tokens == {"finish": [1], "utf8": [0, 15], "token": [0, len(PIECES)], "budget": [1, 1]}[case]
    assert _nothing_sent(b)


def test_a_full_socket_goes_back_with_nothing_sent(rig):
    producer, engine, native, a, b = rig
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    while True:  # fill the socket: the peer reads nothing
        try:
            a.send(b"x" * 4096)
        except BlockingIOError:
            break
    slot = _start(producer, engine, native, a)
    engine.publish(slot, [0, 1])
    assert _round(native, slot) == ([slot], 0, 0)
    taken = native.take_back(slot)
    assert (taken.reason, taken.consumed, taken.bytes_sent, taken.unsent) == ("again", 0, 0, b"")


def test_a_chunk_taken_in_part_leaves_its_rest_for_python(rig):
    """Over TCP, as the gateway's clients: a chunk larger than the room left in the socket is sent in part;
    the rest comes back for Python's transport to write before anything else, and the update is consumed."""
    producer, engine, native, _, _ = rig
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small windows: the peer's, inherited
        server.bind(("127.0.0.1", 0))
        server.listen()
        a = socket.socket()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        a.connect(server.getsockname())
        b, _ = server.accept()
    with a, b:
        a.setblocking(False)
        b.settimeout(5)
        slot = _start(producer, engine, native, a, max_tokens=64)
        queued = 0
        while True:  # fill the connection: the peer reads nothing yet
            try:
                queued += a.send(b"y" * 1024)
            except BlockingIOError:
                break
        engine.publish(slot, [20] * 15)  # one chunk of 15,000 bytes of text: more than the socket has room for
        _read(b, min(queued, 4096))  # some room, not enough
        time.sleep(0.1)
        queued -= min(queued, 4096)
        assert _round(native, slot) == ([slot], 1, 15)
        taken = native.take_back(slot)
        frame = _python_frame("z" * 15_000)
        assert (taken.reason, taken.consumed, taken.num_tokens) == ("partial", 15, 15)
        assert 0 < taken.bytes_sent < len(frame) and taken.bytes_sent + len(taken.unsent) == len(frame)
        assert _read(b, queued + taken.bytes_sent)[queued:] + taken.unsent == frame


def test_a_closed_peer_goes_back_as_an_error(rig):
    producer, engine, native, a, b = rig
    slot = _start(producer, engine, native, a)
    b.close()
    engine.publish(slot, [0])
    assert _round(native, slot) == ([slot], 0, 0)
    assert native.take_back(slot).reason == "error"


def test_the_round_writes_to_its_own_dup_of_the_socket(rig):
    """The gateway's transport may close its socket before it takes the stream back: the round's sends then
    go to the same connection, never to whatever the descriptor number is reused for."""
    producer, engine, native, a, b = rig
    slot = _start(producer, engine, native, a)
    a.close()  # the descriptor number is free again, and the next socket may get it
    other_a, other_b = socket.socketpair()
    try:
        engine.publish(slot, [0])
        assert _round(native, slot) == ([], 1, 1)
        assert _read(b, len(_python_frame("a"))) == _python_frame("a")  # the original connection got it
        other_b.settimeout(0.05)
        with pytest.raises(TimeoutError):
            other_b.recv(10)
    finally:
        other_a.close()
        other_b.close()


def test_slots_it_does_not_own_come_back_when_they_have_news(rig):
    producer, engine, native, a, b = rig
    s1 = producer.submit(RequestSpec(1, [1], 5, temperature=0.0))
    s2 = producer.submit(RequestSpec(2, [1], 5, temperature=0.0))
    engine.take_new()
    slots = sorted([s1, s2])
    assert native.round(slots, 1) == ([], 0, 0)
    engine.publish(s2, [0])
    assert native.round(slots, 1) == ([s2], 0, 0)
    producer.poll(s2)
    engine.finish(s1, FinishReason.STOP)
    assert native.round(slots, 1) == ([s1], 0, 0)


def test_outstanding_tokens_fall_by_what_max_tokens_leaves(rig):
    producer, engine, native, a, b = rig
    slot = _start(producer, engine, native, a, max_tokens=3)
    engine.publish(slot, [0, 0])
    assert _round(native, slot)[2] == 2
    engine.publish(slot, [0, 0])  # past max_tokens (an engine may overshoot): the count stops at zero
    assert _round(native, slot)[2] == 1


def test_enable_refuses_what_it_cannot_hold(rig):
    producer, engine, native, a, b = rig
    slot = producer.submit(RequestSpec(1, [1], 5, temperature=0.0))
    seq, consumed = producer.position(slot)
    big = b"h" * native.template_bytes
    assert not native.enable(slot, a.fileno(), seq, consumed, 0, None, 5, True, b"", big, TAIL)
    assert not native.enable(slot, a.fileno(), seq, consumed, 0, None, 5, True, b"\xf0\x9f\x99\x82", HEAD, TAIL)
    assert native.take_back(slot) is None
