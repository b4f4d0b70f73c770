"""BENCHMARK-ONLY: the Python cost of one streamed update on the poller's direct path, in one process.

    PYTHONPATH=. .venv/bin/python bench/gateway_hot_path.py [--streams 512] [--rounds 1000]

A real ring with `--streams` requests, the fake engine (`bench/traffic_engine.py`) publishing the tokens due
each 0.5 ms step (due times spread over 20 ms, as at 50 tok/s per stream), and `Poller._poll_once` with a
real `SseBody` sink per stream writing to a null transport: ready_slots, poll, take (detokenization through
the cached pieces), the chunk from its template, framing. No kernel write, no cross-core traffic: what the
streamed path costs in Python per update. Prints the minimum and median over 7 repeats.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.backends.backend import Backend  # noqa: E402
from protocols.messages import BackendInfo  # noqa: E402
from gateway.request.choices import Choices  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.request.detokenize import TextStream  # noqa: E402
from gateway.api.formats import CompletionFormat  # noqa: E402
from gateway.request.generate import Generation  # noqa: E402
from gateway.api.sse import SseBody  # noqa: E402
from gateway.request.tokenize import TokenizerService  # noqa: E402
from protocols.ring import RequestSpec  # noqa: E402
from protocols.shm import attach_ring  # noqa: E402
from protocols.shm_producer import ShmProducer  # noqa: E402
from traffic_engine import TOKENIZER_CFG, TrafficEngine, default_cache_dir, ensure_random_tokenizer  # noqa: E402

PROMPT = [5, 6, 7, 8]


class NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False


async def streams(backend: Backend, tokenizer: TokenizerService, num_streams: int) -> None:
    """`num_streams` requests whose updates go to SseBody sinks (after the first piece, as in the gateway)."""
    writer = SimpleNamespace(transport=NullTransport(), chunked=True, output_size=0)
    for i in range(num_streams):
        handle = await backend.submit(RequestSpec(i, PROMPT, 1_000_000, temperature=0.0))
        stream = TextStream(tokenizer.tokenizer, (), PROMPT, tokenizer.single_texts, tokenizer.token_pieces)
        fmt = CompletionFormat("cmpl-0", "ring-traffic")
        fmt.chunk_json(0, "first")  # the first piece went out: plain chunks come from the template
        SseBody(None, writer, Choices([Generation(handle, stream, len(PROMPT))], None), fmt)._attach()


async def main(num_streams: int, num_rounds: int) -> None:
    name = f"blink-hot-path-{os.getpid()}"
    engine = TrafficEngine(name, "127.0.0.1:1", 50.0)  # its control plane is never started
    tokenizer = TokenizerService(ensure_random_tokenizer(TOKENIZER_CFG, default_cache_dir()))
    info = BackendInfo("hot-path", "ring-traffic", "", "", 4096, TOKENIZER_CFG.vocab_size, (), "traffic", name,
                       engine.ring.geometry)
    backend = Backend(info, ShmProducer(attach_ring(name)), GatewayConfig())
    await streams(backend, tokenizer, num_streams)
    clock = time.monotonic()
    engine.step(clock)
    engine.due_s[:num_streams] = clock + np.arange(num_streams) * (0.02 / num_streams)
    gc.collect()
    gc.freeze()
    per_update_us, num_updates = [], 0
    for _ in range(7):
        poll_s, num_updates = 0.0, 0
        for _ in range(num_rounds):
            clock += 0.0005
            engine.step(clock)
            t0 = time.perf_counter()
            num_updates += backend.poller._poll_once()
            poll_s += time.perf_counter() - t0
        per_update_us.append(1e6 * poll_s / num_updates)
    engine.ring.close()
    print(f"{num_streams} streams, {num_updates / num_rounds:.1f} updates a round: {min(per_update_us):.2f} us per "
          f"update (min of 7), median {statistics.median(per_update_us):.2f} us")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1000)
    args = ap.parse_args()
    asyncio.run(main(args.streams, args.rounds))
