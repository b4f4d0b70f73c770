"""Gateway test fixtures: a small byte-level tokenizer, an in-process echo engine on a real shm ring,
and a gateway running on its own event-loop thread (so tests talk to it with blocking clients)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.backends.backend import Backend
from protocols.messages import BackendInfo
from gpu_backend.control_server import ControlServer
from protocols.messages import BackendDescription
from gateway.config import GatewayConfig
from gateway.server import GatewayServer, start_gateway
from protocols.ring import EngineState, ErrorCode, FinishReason, RingGeometry
from protocols.shm import attach_ring, create_ring
from protocols.shm_consumer import RingConsumer
from protocols.shm_producer import ShmProducer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# ASCII only: multi-byte characters stay split over single-byte tokens.
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "user assistant system",
          "stop here please END of the text"] * 20


def make_byte_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def byte_tokenizer() -> Tokenizer:
    return make_byte_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, byte_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    byte_tokenizer.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": None, "eos_token": {"content": "<|im_end|>"}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


ERROR_TOKEN = "<|endoftext|>"  # prompt [ERROR_TOKEN, n, ...]: the echo engine fails after n tokens


class EchoEngine:
    """The consumer end of a ring: each step, every running request gets the next prompt token again
    (the prompt, cycled). Stops on EOS (unless ignore_eos), a stop id, max_tokens or a cancel."""

    kv_blocks, kv_blocks_per_request = 64, 4  # what it reports in the ring header (the metrics test reads it)

    def __init__(self, ring, eos_id: int, error_id: int, step_s: float = 0.001):
        self.consumer = RingConsumer(ring)
        self.eos_id, self.error_id, self.step_s = eos_id, error_id, step_s
        self.running: dict[int, tuple] = {}  # slot -> (seq, spec, produced)
        self.num_cancelled = 0
        self.request_ids: list[int] = []  # the ring's request_id word of each request taken
        self.specs: list = []  # every RequestSpec taken, in order
        self.paused = False
        self.failure: BaseException | None = None  # a broken fake must fail tests, not hang them

    async def run(self) -> None:
        try:
            while True:
                if not self.paused:
                    self.step()
                await asyncio.sleep(self.step_s)
        except Exception as exc:
            self.failure = exc
            raise

    def step(self) -> None:
        self.consumer.beat()
        self.consumer.set_state(EngineState.SERVING)
        for taken in self.consumer.take_new():
            self.running[taken.slot] = (taken.seq, taken.spec, 0)
            self.request_ids.append(taken.spec.request_id)
            self.specs.append(taken.spec)
        for slot, (seq, spec, produced) in list(self.running.items()):
            self._advance(slot, seq, spec, produced)
        self.consumer.set_stats(self.kv_blocks - self.kv_blocks_per_request * len(self.running), self.kv_blocks,
                                len(self.running), 0)

    def _advance(self, slot: int, seq: int, spec, produced: int) -> None:
        if self.consumer.cancelled(slot, seq):
            self.num_cancelled += 1
            return self._finish(slot, FinishReason.CANCELLED)
        if spec.prompt_ids[0] == self.error_id and produced >= spec.prompt_ids[1]:
            return self._finish(slot, FinishReason.ERROR, ErrorCode.INTERNAL)
        if self.consumer.room(slot) == 0:
            return
        token = spec.prompt_ids[produced % len(spec.prompt_ids)]
        self.consumer.publish(slot, [token])
        self.running[slot] = (seq, spec, produced + 1)
        if token in spec.stop_ids or (token == self.eos_id and not spec.ignore_eos):
            self._finish(slot, FinishReason.STOP)
        elif produced + 1 >= spec.max_tokens:
            self._finish(slot, FinishReason.LENGTH)

    def _finish(self, slot: int, reason: FinishReason, code: ErrorCode = ErrorCode.NONE) -> None:
        self.consumer.finish(slot, reason, code)
        del self.running[slot]


@dataclass
class Harness:
    """A gateway on a background event loop, an echo engine, and the backend between them."""

    url: str
    grpc_addr: str
    api_key: str
    model: str
    context_len: int
    backend: Backend
    engine: EchoEngine
    server: GatewayServer
    tokenizer: Tokenizer
    loop: asyncio.AbstractEventLoop

    def call(self, fn, *args):
        """Run `fn(*args)` on the gateway's loop (the ring and the poller are not thread-safe)."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Until every ring slot is free again and the gateway tracks no request."""
        deadline = time.monotonic() + timeout_s
        idle = (0, GEOMETRY.num_slots)
        while time.monotonic() < deadline:
            if self.call(lambda: (self.backend.num_in_flight, self.backend.free_slots)) == idle:
                return
            time.sleep(0.02)
        raise AssertionError(f"slots not returned: in flight {self.backend.num_in_flight}, "
                             f"free {self.backend.free_slots}")

    def post(self, path: str, body, key: str | None = "default", raw: bool = False):
        """POST JSON (or raw bytes); returns (status, parsed JSON body)."""
        data = body if raw else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {self.api_key if key == 'default' else key}"
        return http_call(self.url + path, data, headers)

    def get(self, path: str, key: str | None = "default"):
        headers = {"Authorization": f"Bearer {self.api_key}"} if key == "default" else {}
        return http_call(self.url + path, None, headers)


def http_call(url: str, data: bytes | None, headers: dict):
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


MODEL = "tiny-echo"
CONTEXT_LEN = 256
GEOMETRY = RingGeometry(num_slots=4, max_prompt_len=256, max_output_len=16, max_stop_ids=4)


async def _start(model_dir: Path, tokenizer: Tokenizer, ring_name: str, config: GatewayConfig,
                 engine_mode: str = "echo", sampling_extensions: bool = True):
    ring = create_ring(ring_name, GEOMETRY, "fp-test")
    engine = EchoEngine(ring, tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id(ERROR_TOKEN))
    engine_task = asyncio.create_task(engine.run())
    info = BackendInfo(addr="in-process", model_name=MODEL, model_dir=str(model_dir), model_fingerprint="fp-test",
                       context_len=CONTEXT_LEN, vocab_size=tokenizer.get_vocab_size(),
                       eos_token_ids=(engine.eos_id,), engine_mode=engine_mode, ring_name=ring_name, geometry=GEOMETRY,
                       sampling_extensions=sampling_extensions)
    backend = Backend(info, ShmProducer(attach_ring(ring_name)), config)
    backend.start()
    server = await start_gateway(config, backends=[backend])
    return ring, engine, engine_task, backend, server


@pytest.fixture(scope="module")
def harness(start_harness, pick_free_port):
    api_key = "key-" + os.urandom(4).hex()
    config = GatewayConfig(host="127.0.0.1", port=0, grpc_port=pick_free_port(), api_keys=frozenset({api_key}),
                           slot_wait_s=2.0, max_body_bytes=64 * 1024)
    return start_harness(config, api_key)


@pytest.fixture(scope="module")
def start_harness(model_dir, byte_tokenizer):
    """A factory: `start_harness(config)` runs another gateway + echo engine (a test's own config; the engine
    mode its backend announces); all stop when the module's tests are done."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started = []

    def start(config: GatewayConfig, api_key: str = "", engine_mode: str = "echo",
              sampling_extensions: bool = True) -> Harness:
        ring_name = f"blink-gw-test-{os.getpid()}-{len(started)}"
        parts = asyncio.run_coroutine_threadsafe(_start(model_dir, byte_tokenizer, ring_name, config, engine_mode,
                                                         sampling_extensions),
                                                 loop)
        ring, engine, engine_task, backend, server = parts.result(timeout=30)
        started.append((ring, engine, engine_task, server))
        return Harness(server.url, f"127.0.0.1:{server.grpc_port}", api_key, MODEL, CONTEXT_LEN, backend, engine,
                       server, byte_tokenizer, loop)

    yield start

    async def stop():
        for ring, _, engine_task, server in started:
            await server.close()
            engine_task.cancel()
            ring.close()
    asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    for _, engine, _, _ in started:
        assert engine.failure is None, f"the echo engine failed: {engine.failure!r}"


WORKERS_GEOMETRY = RingGeometry(num_slots=8, max_prompt_len=256, max_output_len=16, max_stop_ids=4)


@pytest.fixture()
def echo_backend(model_dir, byte_tokenizer, pick_free_port):
    """An echo engine on a shm ring with a real control plane, in this process."""
    ring = create_ring(f"blink-workers-test-{os.getpid()}", WORKERS_GEOMETRY, "fp-workers")
    engine = EchoEngine(ring, byte_tokenizer.token_to_id("<|im_end|>"), byte_tokenizer.token_to_id(ERROR_TOKEN))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    async def spawn():
        return asyncio.create_task(engine.run())
    task = asyncio.run_coroutine_threadsafe(spawn(), loop).result(timeout=5)
    desc = BackendDescription(MODEL, str(model_dir), "fp-workers", CONTEXT_LEN, byte_tokenizer.get_vocab_size(),
                       (engine.eos_id,), "echo")
    control = f"127.0.0.1:{pick_free_port()}"
    server = ControlServer(control, desc, ring)
    server.start()
    yield control, engine, loop
    server.stop(0)
    async def stop():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    ring.close()
    assert engine.failure is None
