"""BENCHMARK-ONLY: the gateway with a probe on its stream writes, for `bench/ring_traffic.py stream`.

    python bench/gateway_probe.py PROBE_JSON PROFILE_FILE GATEWAY_ARGS...

Every byte of a streamed body before its end goes to the transport of its `gateway.api.sse.SseBody` (from
the poller's sink or the stream's task; the probe wraps that transport's `write`), its end through
`_write_end` (`gateway.api.http._write` before those); the probe records when each write is handed to the
transport and, at exit, the token ids (`w123` words of the ring-traffic vocabulary) in the chunk texts of
that write: [[monotonic ns, token id], ...] in PROBE_JSON (empty: no probe). The chunks the native round
(`gateway/streaming/stream_round.py`) sends on its own are recorded by its tap, just after each send returns. PROFILE_FILE
(empty: none) gets a cProfile dump. For looking at a run's course, with BLINK_ROUNDS=FILE each poll round
(`Poller._poll_once`) is written there as [start monotonic ns, wall ns, thread CPU ns, updates, the thread's
CPU time at the start ns, ...], and with BLINK_GC_EVENTS=FILE each collection as [end monotonic ns, duration
ns, generation]. Kept apart from ring_traffic.py so that the gateway process imports what a gateway imports
and nothing more (torch's objects would make every full GC pass slower).
"""
from __future__ import annotations

import array
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import gateway.api.http as http  # noqa: E402
except ImportError:  # gateways before the rooms (api/, request/, streaming/, ...)
    import gateway.http as http  # noqa: E402
from gateway.main import main as gateway_main  # noqa: E402

TAP_CHUNKS, TAP_BYTES = 8 << 20, 2 << 30  # a native round's tap (zeroed memory: only what is written is touched)
TEXTS = re.compile(rb'"(?:text|content)":"([^"]*)"')
WORD = re.compile(rb"w(\d+)")


def probed_gateway(probe: str, profile: str, argv: list[str]) -> int:
    # Kept cheap (well under 1 us a write, no object the GC tracks): times and bytes now, ids parsed at exit.
    # The bytes are copied into one buffer rather than kept as objects: a run writes ~250k chunks, and keeping
    # each one alive would move the gateway's allocations onto fresh memory all the run (page faults, cold
    # cache) instead of reusing the freed chunks' memory, as an unprobed gateway does.
    times_ns, ends, written = array.array("q"), array.array("q"), bytearray()
    rounds_tapped = []  # the native rounds (gateway/streaming/stream_round.py), whose own taps record their chunks

    def record(data: bytes) -> None:  # a write's time and bytes, before it is handed on
        times_ns.append(time.monotonic_ns())
        written.extend(data)
        ends.append(len(written))

    class ProbedTransport:  # gateway.api.sse: a body's transport, through which every write before its end goes
        __slots__ = ("write", "is_closing", "get_write_buffer_size", "get_extra_info")

        def __init__(self, transport) -> None:
            transport_write = transport.write

            def write(data: bytes) -> None:
                record(data)
                transport_write(data)
            self.write = write
            self.is_closing, self.get_write_buffer_size = transport.is_closing, transport.get_write_buffer_size
            self.get_extra_info = transport.get_extra_info

    def probed_body_init(body, *args, **kwargs) -> None:
        body_init(body, *args, **kwargs)
        if body.transport is not None:
            body.transport = ProbedTransport(body.transport)

    async def probed_write_end(body, data: bytes) -> None:  # gateway.api.sse: a stream's last write
        record(data)
        await write_end(body, data)

    async def probed_http_write(resp, data: bytes, eof: bool = False) -> None:  # gateways before gateway.api.sse
        record(data)
        await http_write(resp, data, eof)

    gc_ns, gc_start, gc_events = [0, 0, 0], [0], []  # time in collections of each generation; each collection

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter_ns()
        else:
            gc_ns[info["generation"]] += time.perf_counter_ns() - gc_start[0]
            gc_events.append((time.monotonic_ns(), time.perf_counter_ns() - gc_start[0], info["generation"]))
    gc.callbacks.append(gc_timer)

    rounds = array.array("q")  # per poll round: start (monotonic ns), wall ns, CPU ns, updates, thread CPU ns at start
    if os.environ.get("BLINK_ROUNDS"):
        try:
            from gateway.streaming.poller import Poller
        except ImportError:  # gateways before the rooms: the backend polled its ring itself
            from gateway.backends import Backend as Poller
        poll_once = Poller._poll_once

        def timed_poll_once(poller) -> int:
            t0, c0 = time.monotonic_ns(), time.thread_time_ns()
            n = poll_once(poller)
            rounds.extend((t0, time.monotonic_ns() - t0, time.thread_time_ns() - c0, n, c0))
            return n
        Poller._poll_once = timed_poll_once
    if probe:
        try:
            import gateway.api.sse as sse
        except ImportError:
            sse = None
        if sse is None:
            try:  # gateways before the rooms
                import gateway.sse as sse
            except ImportError:
                sse = None
        if sse is None:
            http_write, http._write = http._write, probed_http_write
        else:
            body_init, sse.SseBody.__init__ = sse.SseBody.__init__, probed_body_init
            write_end, sse._write_end = sse._write_end, probed_write_end
        try:
            from gateway.streaming.stream_round import StreamRound
        except ImportError:
            StreamRound = None
        if StreamRound is None:
            try:  # gateways before the rooms; before the native round there is none
                from gateway.stream_round import StreamRound
            except ImportError:
                pass
        if StreamRound is not None:  # the chunks the native round sends itself: its tap records them (times and bytes, as above)
            round_init = StreamRound.__init__

            def tapped_round_init(native, *args, **kwargs) -> None:
                round_init(native, *args, **kwargs)
                native.set_tap(TAP_CHUNKS, TAP_BYTES)
                rounds_tapped.append(native)
            StreamRound.__init__ = tapped_round_init
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        return gateway_main(argv)
    finally:
        print(f"gateway GC: {gc_ns[0] / 1e6:.0f} / {gc_ns[1] / 1e6:.0f} / {gc_ns[2] / 1e6:.0f} ms in collections of "
              f"generation 0 / 1 / 2 ({', '.join(str(s['collections']) for s in gc.get_stats())} collections)",
              file=sys.stderr)
        if os.environ.get("BLINK_ROUNDS"):
            Path(os.environ["BLINK_ROUNDS"]).write_text(json.dumps(rounds.tolist()))
        if os.environ.get("BLINK_GC_EVENTS"):
            Path(os.environ["BLINK_GC_EVENTS"]).write_text(json.dumps(gc_events))
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        if probe:
            ids = _chunk_ids(times_ns, ends, written)
            for native in rounds_tapped:
                ids += _chunk_ids(*native.tapped())
            Path(probe).write_text(json.dumps(sorted(ids)))


def _chunk_ids(times_ns, ends, written: bytes) -> list[tuple[int, int]]:
    """(write time, token id) of every token in the chunk texts of the writes that end at `ends`."""
    starts = [0, *ends[:-1]]
    return [(int(t), int(m.group(1))) for t, start, end in zip(times_ns, starts, ends)
            for text in TEXTS.findall(written, int(start), int(end)) for m in WORD.finditer(text)]


if __name__ == "__main__":
    raise SystemExit(probed_gateway(sys.argv[1], sys.argv[2], sys.argv[3:]))
