"""BENCHMARK-ONLY ring traffic generator: a fake engine with no model, and the gateway's added TTFT.

    .venv/bin/python bench/ring_traffic.py ttft [--samples 300] [--out bench/results]

`TrafficEngine` plays a backend: it creates a ring, serves the control plane (Describe/Health) with a
WordLevel tokenizer, and answers every request with tokens at `--tok-s` per stream (the first one as
soon as it sees the request), honouring cancels and backpressure. It never runs a model: it exists so
that the gateway's own cost can be measured without an engine's cost on top. Never serve clients with it.

`ttft`: the engine runs in its own process, spinning, so it answers a request within microseconds.
1. direct: a RingProducer in this process submits a 1-token request and polls for the token; the median
   is the ring round trip (IPC + the fake engine's poll);
2. HTTP: the gateway is started in front of the same ring; a raw aiohttp client (no SDK overhead) sends
   streaming `max_tokens=1` completions one after another; TTFT = request sent -> first chunk with a
   choice, as BENCH.md defines it; the official `openai` client is measured too.
The gateway's added TTFT = median(HTTP) - median(direct). Writes JSON (commit, machine) and prints a row.

    .venv/bin/python bench/ring_traffic.py stream [--streams 512] [--tokens 200] [--tok-s 50] [--no-probe]
                                                  [--poll-spin-s 0] [--idle-wait-s 900]

`stream`: the gateway on the last core, engine and client on the others; N concurrent streams. Per-token
latency from the publish time each token id encodes: to the client's receipt, and (unless --no-probe) to
the gateway's hand-off of the chunk to its socket (`bench/gateway_probe.py` wraps the gateway's stream writes);
percentiles over all tokens and over the steady state (published after every stream started); CPU use
per process, and the gateway's CPU per token after every stream started. The gateway spin-polls while
tokens flow, so its CPU use is its whole core whatever its work: `--poll-spin-s 0` measures the work.
It first waits for the cores to be idle (other developers' runs share this machine).
"""
from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink.bench.results import commit  # noqa: E402
from gpu_backend.control_server import ControlServer, Description  # noqa: E402
from gpu_backend.models import preset_config  # noqa: E402
from gpu_backend.models.demo import default_cache_dir  # noqa: E402
from gpu_backend.models.random_tokenizer import ensure_random_tokenizer  # noqa: E402
import protocols.ring as R  # noqa: E402
from protocols.ring import EngineState, FinishReason, RequestSpec, RingGeometry  # noqa: E402
from protocols.shm import RingConsumer, RingProducer, attach_ring, create_ring  # noqa: E402
from tests.conftest import _wait_health, free_port  # noqa: E402

MODEL_NAME = "ring-traffic"
TOKENIZER_CFG = preset_config("smollm2-135m")  # only its vocabulary size: the tokenizer is WordLevel w0..wN


TIME_UNIT_NS = 10_000  # streamed token ids encode their publish time in these units, modulo the vocabulary


def token_for(now_ns: int) -> int:
    return 1 + (now_ns // TIME_UNIT_NS) % (TOKENIZER_CFG.vocab_size - 1)


def lag_us(token: int, recv_ns: int) -> float:
    """Publish-to-receipt time of a token made by `token_for` (unambiguous below ~0.49 s)."""
    span = TOKENIZER_CFG.vocab_size - 1
    return ((recv_ns // TIME_UNIT_NS) % span - (token - 1)) % span * TIME_UNIT_NS / 1e3


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
        desc = Description(MODEL_NAME, str(ensure_random_tokenizer(TOKENIZER_CFG, default_cache_dir())),
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
        self.step_gaps_us = array.array("d")  # time between steps that published something
        self._last_publish_s = 0.0
        self.sched = "normal"  # the loop thread's scheduling (`_raise_priority`)

    def run(self, stop: mp.Event, stats_path: str | None = None) -> None:
        # Before the control plane's threads start, so that they have it too: one of them holding the GIL
        # while the client has the core would hold this loop up.
        self.sched = _raise_priority()
        self.control.start()
        self.consumer.set_state(EngineState.SERVING)
        try:
            while not stop.is_set():
                self.step(time.monotonic())
                if self.idle_s:
                    time.sleep(self.idle_s)
        finally:
            self.control.stop()
            self.ring.close()
            if stats_path:
                Path(stats_path).write_text(json.dumps(self.stats()))

    def stats(self) -> dict:
        """How evenly tokens went out: lateness against their due times, gaps between publishing steps."""
        out = {"engine_sched": self.sched}
        for name, values in (("engine_late_us", self.late_us), ("engine_step_gap_us", self.step_gaps_us)):
            v = np.sort(np.frombuffer(values, dtype=np.float64)) if len(values) else np.zeros(1)
            out.update({f"{name}_p50": v[len(v) // 2], f"{name}_p99": v[int(0.99 * (len(v) - 1))], f"{name}_max": v[-1]})
        return out

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
        self.late_us.extend(((now - self.due_s[ok]) * 1e6).tolist())
        if len(ok):
            if self._last_publish_s:
                self.step_gaps_us.append((now - self._last_publish_s) * 1e6)
            self._last_publish_s = now
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


def direct_ttft_ms(ring_name: str, samples: int) -> list[float]:
    prod, out = RingProducer(attach_ring(ring_name)), []
    for i in range(samples):
        t0 = time.perf_counter()
        slot = prod.submit(RequestSpec(i, [5, 6, 7, 8], 1, temperature=0.0))
        while not prod.poll(slot).tokens:
            pass
        out.append(1e3 * (time.perf_counter() - t0))
        while prod.poll(slot).finish is FinishReason.NONE:
            pass
        prod.release(slot)
    return out


async def http_ttft_ms(url: str, key: str, samples: int) -> list[float]:
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 1, "stream": True}
    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        for _ in range(samples + 5):
            t0 = time.perf_counter()
            async with session.post(f"{url}/completions", json=body) as resp:
                ttft = None
                async for line in resp.content:
                    if ttft is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                        ttft = 1e3 * (time.perf_counter() - t0)
            out.append(ttft)
    return out[5:]  # the first few open the connection and warm the gateway


def openai_ttft_ms(url: str, key: str, samples: int) -> list[float]:
    from openai import OpenAI

    client, out = OpenAI(base_url=url, api_key=key, max_retries=0), []
    for _ in range(samples + 5):
        t0 = time.perf_counter()
        ttft = None
        for chunk in client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=1, stream=True):
            if ttft is None and chunk.choices:
                ttft = 1e3 * (time.perf_counter() - t0)
        out.append(ttft)
    return out[5:]


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


@contextlib.contextmanager
def gateway_in_front(control: str, cores: set[int] | None = None, probe: str | None = None,
                     profile: str | None = None, poll_spin_s: float | None = None):
    """`blink gateway` on that backend (gRPC off, key traffic-key); yields its /v1 URL. With `probe`, the
    gateway runs under `bench/gateway_probe.py` and writes its emit times and token ids there; with `profile`, a cProfile dump."""
    port = free_port()
    env = {**os.environ, "BLINK_API_KEY": "traffic-key", "BLINK_LOG_LEVEL": "WARNING"}
    args = ["--port", str(port), "--grpc-port", "0", "--backend", control, "--log-level", "WARNING"]
    if poll_spin_s is not None:  # 0: no back-to-back polls, so its CPU time is its work, not its spinning
        config = Path(f"/tmp/blink-traffic-gateway-{os.getpid()}.yaml")
        config.write_text(f"poll_spin_s: {poll_spin_s}\n")
        args += ["--config", str(config)]
    if probe or profile:
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "gateway_probe.py"), probe or "", profile or "", *args]
    else:
        cmd = [sys.executable, "-m", "blink.cli", "gateway", *args]
    gateway = subprocess.Popen(cmd, cwd=ROOT, env=env,
                               preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    try:
        _wait_health(f"http://127.0.0.1:{port}/health", gateway, 60)
        yield f"http://127.0.0.1:{port}/v1", gateway.pid
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)


def record(result: dict, out: str, name: str) -> None:
    """Stamp commit and machine, write the JSON under `out`."""
    result.update(commit=commit(short=True) or "unknown", machine=f"{platform.machine()}, {os.cpu_count()} cores")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"{name}-{result['commit']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def ttft(args: argparse.Namespace) -> None:
    with traffic_engine(0.0) as (ring, control, _):
        direct = direct_ttft_ms(ring, args.samples)  # before the gateway: a ring has one producer
        with gateway_in_front(control) as (url, _):
            http = asyncio.run(http_ttft_ms(url, "traffic-key", args.samples))
            sdk = openai_ttft_ms(url, "traffic-key", args.samples)
    med = {k: statistics.median(v) for k, v in (("direct", direct), ("http", http), ("openai", sdk))}
    result = {"bench": "gateway_ttft", "samples": args.samples, "direct_ms_median": med["direct"], "http_ms_median": med["http"],
              "openai_ms_median": med["openai"], "gateway_added_ttft_ms_median": med["http"] - med["direct"],
              "http_ms_p99": statistics.quantiles(http, n=100)[98], "direct_ms": direct, "http_ms": http,
              "openai_ms": sdk}
    record(result, args.out, "gateway_ttft")
    print(f"TTFT median: ring round trip {med['direct']:.3f} ms, over HTTP (aiohttp) {med['http']:.3f} ms "
          f"(P99 {result['http_ms_p99']:.3f}), openai client {med['openai']:.3f} ms; "
          f"gateway adds {result['gateway_added_ttft_ms_median']:.3f} ms at the median")


def stream_clients(url: str, key: str, streams: int, max_tokens: int, gateway_pid: int | None = None,
                   tick_s: float = 0.0) -> dict:
    """`streams` concurrent streaming completions (`bench/stream_client.py`); per-token publish-to-receipt
    latency from the ids. With `gateway_pid`: the gateway's CPU per token received after every stream
    started (steady state)."""
    from stream_client import run_streams

    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    marks = {}  # the gateway's CPU seconds and the tokens received when the last stream started, the first ended

    def mark(name: str):
        return (lambda stats: marks.update({name: (cpu_s(gateway_pid), len(stats.tokens))})) if gateway_pid else None
    gc.collect()
    gc.freeze()  # the client's collections must not walk torch's objects (imported with the engine's code)
    counters, stats, wall = run_streams(url, key, body, streams, tick_s, mark("started"), mark("first_end"))
    samples = list(zip(stats.times_ns, (lag_us(t, r) for t, r in zip(stats.tokens, stats.times_ns))))
    windows = {"steady_ns": max(stats.first_ns),  # every stream has started: the ramp of request set-ups is over
               "first_end_ns": min(stats.end_ns)}  # until here, every stream was open (no stream ends yet)
    cpu = {}
    if gateway_pid and "started" in marks:
        end = marks.get("first_end", (cpu_s(gateway_pid), len(samples)))
        for name, (cpu1, tokens1) in (("steady", (cpu_s(gateway_pid), len(samples))), ("all_open", end)):
            cpu0, tokens0 = marks["started"]
            if tokens1 > tokens0:
                cpu[f"gateway_cpu_us_per_token_{name}"] = 1e6 * (cpu1 - cpu0) / (tokens1 - tokens0)
    counts = [c.num_tokens for c in counters]
    return {"streams": streams, "max_tokens": max_tokens, "client_tick_s": tick_s, "wall_s": wall,
            "tokens": sum(counts), "complete_streams": sum(c.ok and c.num_tokens == max_tokens for c in counters),
            "tok_s": sum(counts) / wall, **windows, "ramp_s": (windows["steady_ns"] - stats.t0_ns) / 1e9,
            "all_open_s": (windows["first_end_ns"] - windows["steady_ns"]) / 1e9,
            "samples": samples, **cpu, **lag_stats("lag_us", samples, windows)}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lag_stats(name: str, samples: list[tuple[int, float]], windows: dict) -> dict:
    """Percentiles of (receipt ns, lag us) samples by publish time: all of them; `_steady`: published after
    every stream started; `_all_open`: and before the first stream ended (all streams open, no ends)."""
    out = {}
    steady_ns, first_end_ns = windows["steady_ns"], windows["first_end_ns"]
    for part, lags in (("", [lag for _, lag in samples]),
                       ("_steady", [lag for t, lag in samples if t - lag * 1e3 >= steady_ns]),
                       ("_all_open", [lag for t, lag in samples if steady_ns <= t - lag * 1e3 < first_end_ns])):
        lags.sort()
        if not lags:
            continue
        q = lambda f: lags[min(len(lags) - 1, int(f * len(lags)))]  # noqa: E731
        out.update({f"{name}{part}_p50": q(0.5), f"{name}{part}_p90": q(0.9), f"{name}{part}_p99": q(0.99),
                    f"{name}{part}_max": lags[-1], f"{name}{part}_samples": len(lags)})
    return out


def _cpu_s() -> tuple[float, float]:
    """CPU seconds the whole machine has spent so far busy (not idle, iowait or stolen), and stolen by the
    hypervisor (cycles this VM's cores did not get) (/proc/stat, all cores)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - fields[3] - fields[4] - fields[7]) / tick, fields[7] / tick


def _cpu_idle_fraction(window_s: float) -> float:
    """Share of the machine's CPU time that was idle over `window_s`."""
    (busy0, steal0), t0 = _cpu_s(), time.monotonic()
    time.sleep(window_s)
    busy1, steal1 = _cpu_s()
    return 1 - (busy1 - busy0 + steal1 - steal0) / ((time.monotonic() - t0) * os.cpu_count())


def wait_for_idle(min_idle: float = 0.9, window_s: float = 2.0, timeout_s: float = 900.0) -> float:
    """Block until the cores were at least `min_idle` idle over one `window_s` (other developers' test runs
    share this machine); returns the seconds waited. Gives up (and says so) after `timeout_s`."""
    t0 = time.monotonic()
    while (idle := _cpu_idle_fraction(window_s)) < min_idle:
        if time.monotonic() - t0 > timeout_s:
            print(f"machine still busy ({idle:.0%} idle) after {timeout_s:g} s: measuring anyway")
            break
    return time.monotonic() - t0


def stream(args: argparse.Namespace) -> None:
    """The gateway on its own core(s), the fake engine and the clients on the others."""
    if args.idle_wait_s > 0:
        print(f"waited {wait_for_idle(timeout_s=args.idle_wait_s):.0f} s for idle cores")
    cores = sorted(os.sched_getaffinity(0))
    gw_cores, other = set(cores[-args.gateway_cores:]), set(cores[:-args.gateway_cores]) or set(cores)
    probe = None if args.no_probe else f"/tmp/blink-emit-lags-{os.getpid()}.json"
    engine_stats = Path(f"/tmp/blink-engine-stats-{os.getpid()}.json")
    with traffic_engine(args.tok_s, idle_s=0.0005, cores=other, stats_path=str(engine_stats)) as (_, control, engine_pid):
        with gateway_in_front(control, gw_cores, probe=probe, profile=args.profile,
                              poll_spin_s=args.poll_spin_s) as (url, gateway_pid):
            os.sched_setaffinity(0, other)
            pids = {"gateway": gateway_pid, "engine": engine_pid, "client": os.getpid()}
            cpu0, (busy0, steal0), overflows0 = {name: cpu_s(pid) for name, pid in pids.items()}, _cpu_s(), listen_overflows()
            result = stream_clients(url, "traffic-key", args.streams, args.tokens, gateway_pid,
                                    args.client_tick_ms / 1e3)
            result.update({f"{name}_cpu_util": (cpu_s(pid) - cpu0[name]) / result["wall_s"]
                           for name, pid in pids.items()})
            # Cores' worth of CPU that others used meanwhile: other processes (other developers' runs share
            # this machine) and interrupts, and what the hypervisor did not give this VM (steal).
            busy1, steal1 = _cpu_s()
            ours = sum(result[f"{name}_cpu_util"] for name in pids)
            result["foreign_cpu_util"] = (busy1 - busy0) / result["wall_s"] - ours
            result["steal_cpu_util"] = (steal1 - steal0) / result["wall_s"]
            result["listen_overflows"] = listen_overflows() - overflows0
            result["gateway_cpu_us_per_token"] = 1e6 * result["gateway_cpu_util"] * result["wall_s"] / max(result["tokens"], 1)
    result.update(json.loads(engine_stats.read_text()))
    engine_stats.unlink()
    emit = []
    if probe:
        emit = [(t, lag_us(token, t)) for t, token in json.loads(Path(probe).read_text())]
        os.unlink(probe)
    if args.samples_out:  # every token's (time ns, lag us), for looking at a run's course
        np.savez_compressed(args.samples_out, emit=np.array(emit).reshape(-1, 2),
                            client=np.array(result.pop("samples")).reshape(-1, 2))
    result.pop("samples", None)
    result = {"bench": "gateway_stream", "gateway_cores": sorted(gw_cores), "other_cores": sorted(other),
              "gateway_poll_spin_s": args.poll_spin_s,
              "engine_tok_s_per_stream": args.tok_s, **result, **(lag_stats("emit_lag_us", emit, result) if emit else {})}
    record(result, args.out, f"gateway_stream_{args.streams}" + ("_noprobe" if args.no_probe else "")
           + ("" if args.poll_spin_s is None else f"_spin{args.poll_spin_s:g}"))
    print(summary(result))


def summary(r: dict) -> str:
    """A run's figures in a few lines (ms for latencies)."""
    def lags(name: str) -> str:
        return ", ".join(f"{part or 'all'} P50 {r[f'{name}{part}_p50'] / 1e3:.2f} / P99 {r[f'{name}{part}_p99'] / 1e3:.2f}"
                         for part in ("", "_steady", "_all_open") if f"{name}{part}_p50" in r)
    lines = [f"{r['streams']} streams x {r['max_tokens']} tokens at {r['engine_tok_s_per_stream']:g} tok/s each: "
             f"{r['tok_s']:.0f} tok/s delivered, {r['complete_streams']} complete; all started after {r['ramp_s']:.2f} s, "
             f"all open for {r['all_open_s']:.2f} s",
             f"  publish -> client (ms): {lags('lag_us')}"]
    if "emit_lag_us_p50" in r:
        lines.append(f"  publish -> gateway emit (ms): {lags('emit_lag_us')}")
    lines += [f"  CPU: gateway {r['gateway_cpu_util']:.0%} ({r['gateway_cpu_us_per_token']:.1f} us/token; steady "
              f"{r.get('gateway_cpu_us_per_token_steady', float('nan')):.1f}, all open "
              f"{r.get('gateway_cpu_us_per_token_all_open', float('nan')):.1f}), engine {r['engine_cpu_util']:.0%} "
              f"({r['engine_sched']}), client {r['client_cpu_util']:.0%}; others {r['foreign_cpu_util']:.0%}, "
              f"stolen {r['steal_cpu_util']:.0%}; listen overflows {r['listen_overflows']}",
              f"  engine publish lateness P50 {r['engine_late_us_p50'] / 1e3:.2f} ms, P99 {r['engine_late_us_p99'] / 1e3:.2f} ms, "
              f"max {r['engine_late_us_max'] / 1e3:.2f} ms"]
    return "\n".join(lines)


def listen_overflows() -> int:
    """Connections the kernel dropped so far because a listen backlog was full (each waits a retransmit)."""
    head, values = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()
                    if line.startswith("TcpExt:")][:2]
    return int(values[head.index("ListenOverflows")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("ttft", help="the gateway's added time to first token")
    t.add_argument("--samples", type=int, default=300)
    t.add_argument("--out", default=str(ROOT / "bench" / "results"))
    st = sub.add_parser("stream", help="streamed tokens/s and per-token latency through the gateway")
    st.add_argument("--streams", type=int, default=512)
    st.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    st.add_argument("--tok-s", type=float, default=50.0, help="fake engine tokens/s per stream")
    st.add_argument("--gateway-cores", type=int, default=1, help="the last N cores are the gateway's")
    st.add_argument("--profile", help="write a cProfile dump of the gateway here")
    st.add_argument("--no-probe", action="store_true", help="leave out the gateway's emit-time probe (its own cost)")
    st.add_argument("--poll-spin-s", type=float, help="the gateway's poll_spin_s (0: its CPU use is its work per "
                    "token; by default it polls back to back while tokens flow, using its whole core)")
    st.add_argument("--idle-wait-s", type=float, default=900.0,
                    help="first wait up to this long for the cores to be 90%% idle over 2 s (0: don't)")
    st.add_argument("--client-tick-ms", type=float, default=0.0,
                    help="the client reads every this many ms instead of being woken by each write (0)")
    st.add_argument("--samples-out", help="also write every token's emit and client (time, lag) here (.npz)")
    st.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    (ttft if args.cmd == "ttft" else stream)(args)


if __name__ == "__main__":
    main()
