"""The load generator: streamed OpenAI requests at scheduled arrivals, behind a max-concurrency gate.

aiohttp and the standard library only (no `openai` package: it must run where only aiohttp exists).
Each request streams (`stream: true`, `stream_options: {include_usage: true}`) with `max_tokens` and
`ignore_eos: true`. On `/v1/completions` the prompt is sent as token ids (exact lengths with any
tokenizer); on `/v1/chat/completions` as the words `w<id>`, exact for the WordLevel `w0..wN`
vocabularies of random-weight models and approximate elsewhere (usage.prompt_tokens is recorded).
Arrivals: gamma intervals with shape `burstiness` and mean 1/rate (burstiness 1 is Poisson), seeded;
rate inf sends everything at once. A request with `after` (a conversation's later turn) has no arrival of its
own: it arrives when that request has finished. The clock for TTFT starts when the request is sent, after the gate.
Prefix caching: each record keeps usage.prompt_tokens_details.cached_tokens (0 where the server reports none).
Structured outputs: with a `response_format`, every request carries it (chat) or its vLLM `structured_outputs`
twin (completions), and no `ignore_eos`: a server refuses the pair (a finished grammar allows only EOS), so a
constrained request may end before `max_tokens`; count its tokens, not its JSON.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from .metrics import RequestRecord, per_token_itl
from .workloads import BenchRequest, Workload


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ClientConfig:
    base_url: str                  # ".../v1"
    model: str
    api_key: str | None = None
    endpoint: str = "completions"  # or "chat"
    temperature: float | None = None  # None: the workload's
    request_timeout_s: float = 600.0  # longest silence while reading a stream
    continuous_usage: bool = False  # ask for usage in every chunk (vLLM extension): exact per-chunk counts
    # send the `ignore_eos` extension; off for servers that reject unknown fields (transformers serve):
    # there, a generation config without EOS does the same
    ignore_eos: bool = True
    response_format: dict | None = None  # OpenAI's object, sent with every request (see the module docstring)

    def __post_init__(self):
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint {self.endpoint!r}: expected 'completions' or 'chat'")
        if self.response_format is not None and self.response_format.get("type") not in RESPONSE_FORMAT_TYPES:
            raise ValueError(f"response_format type {self.response_format.get('type')!r}: expected one of "
                             f"{', '.join(RESPONSE_FORMAT_TYPES)}")
        if (self.response_format or {}).get("type") == "json_schema" and \
                "schema" not in (self.response_format.get("json_schema") or {}):
            raise ValueError("response_format json_schema: needs json_schema.schema")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ArrivalConfig:
    rate: float = math.inf         # requests per second; inf: all at once
    burstiness: float = 1.0        # gamma shape; 1 = Poisson
    seed: int = 0
    max_concurrency: int | None = None

    def __post_init__(self):
        if not self.rate > 0 or not self.burstiness > 0:
            raise ValueError(f"arrivals: rate ({self.rate}) and burstiness ({self.burstiness}) must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"arrivals: max_concurrency ({self.max_concurrency}) must be >= 1")

    def offsets_s(self, num_requests: int) -> list[float]:
        """Arrival times from the run start; the first request arrives at 0."""
        if math.isinf(self.rate):
            return [0.0] * num_requests
        rng = random.Random(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        t, out = 0.0, []
        for _ in range(num_requests):
            out.append(t)
            t += rng.gammavariate(self.burstiness, scale)
        return out

    def describe(self) -> dict:
        return {"rate": "inf" if math.isinf(self.rate) else self.rate, "burstiness": self.burstiness,
                "distribution": "all at once" if math.isinf(self.rate) else "gamma", "seed": self.seed,
                "max_concurrency": self.max_concurrency}


def build_payload(cfg: ClientConfig, req: BenchRequest, temperature: float) -> dict:
    body = {"model": cfg.model, "max_tokens": req.output_len, "stream": True,
            "temperature": temperature,
            "stream_options": {"include_usage": True, **({"continuous_usage_stats": True} if cfg.continuous_usage else {})}}
    constraint = constraint_fields(cfg)
    if cfg.ignore_eos and not constraint:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = chat_messages(req)
    else:
        body["prompt"] = list(req.prompt_ids)
    return {**body, **constraint}


def constraint_fields(cfg: ClientConfig) -> dict:
    """The request fields carrying `cfg.response_format`: itself on chat; on completions (which has no
    `response_format`) vLLM's `structured_outputs` with the same constraint."""
    fmt = cfg.response_format
    if fmt is None or fmt["type"] == "text":
        return {}
    if cfg.endpoint == "chat":
        return {"response_format": fmt}
    if fmt["type"] == "json_object":
        return {"structured_outputs": {"json_object": True}}
    return {"structured_outputs": {"json": fmt["json_schema"]["schema"]}}


def chat_messages(req: BenchRequest) -> list[dict]:
    """The prompt as chat messages of `w<id>` words: one user message, or the roles the request lists."""
    out, start = [], 0
    for role, num_ids in req.messages or (("user", req.prompt_len),):
        out.append({"role": role, "content": " ".join(f"w{i}" for i in req.prompt_ids[start:start + num_ids])})
        start += num_ids
    return out


def _content(msg: dict) -> bool:
    for choice in msg.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


class _StreamReader:
    """Accumulates one SSE stream into a RequestRecord."""

    def __init__(self, rec: RequestRecord, sent: float):
        self.rec, self.sent = rec, sent
        self.chunk_times: list[float] = []
        self.chunk_tokens: list[int] | None = []
        self.seen_tokens = 0

    def event(self, msg: dict, now: float) -> None:
        if "error" in msg:
            err = msg["error"]
            self.rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        usage = msg.get("usage") or {}
        if _content(msg):
            self.chunk_times.append(now)
            self._count(usage)
        for choice in msg.get("choices") or ():
            self.rec.finish_reason = choice.get("finish_reason") or self.rec.finish_reason
        if usage:
            self.rec.completion_tokens = usage.get("completion_tokens", 0)
            self.rec.prompt_tokens = usage.get("prompt_tokens", 0)
            self.rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def _count(self, usage: dict) -> None:
        if self.chunk_tokens is None or "completion_tokens" not in usage:
            self.chunk_tokens = None  # not reported for every chunk: estimate in per_token_itl
            return
        self.chunk_tokens.append(usage["completion_tokens"] - self.seen_tokens)
        self.seen_tokens = usage["completion_tokens"]

    def finish(self) -> None:
        rec = self.rec
        rec.num_chunks = len(self.chunk_times)
        if not self.chunk_times:
            rec.error = rec.error or "no token-bearing chunk in the stream"
            return
        rec.ttft_s = self.chunk_times[0] - self.sent
        rec.e2el_s = self.chunk_times[-1] - self.sent
        rec.itl_s = per_token_itl(self.chunk_times, self.chunk_tokens or None, rec.completion_tokens)


async def send_one(session: aiohttp.ClientSession, cfg: ClientConfig, payload: dict, rec: RequestRecord) -> None:
    """POST one streamed request and fill `rec`; errors become `rec.error`, never exceptions."""
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    sent = time.perf_counter()
    reader = _StreamReader(rec, sent)
    try:
        async with session.post(cfg.base_url + path, json=payload, headers=cfg.headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return
            async for line in resp.content:
                now = time.perf_counter()
                data = line.strip()
                if not data.startswith(b"data:"):
                    continue
                data = data[5:].strip()
                if data == b"[DONE]":
                    break
                reader.event(json.loads(data), now)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    reader.finish()


async def run_requests(cfg: ClientConfig, workload: Workload, arrivals: ArrivalConfig,
                       progress: bool = False) -> tuple[list[RequestRecord], float]:
    """Send every request of `workload` on `arrivals`' schedule; (records, duration_s).

    Duration runs from the first request sent to the last one completed.
    """
    limit = workload.max_concurrency or arrivals.max_concurrency
    gate = asyncio.Semaphore(limit) if limit else None
    temperature = workload.temperature if cfg.temperature is None else cfg.temperature
    offsets = _offsets(workload, arrivals)
    finished = [asyncio.Event() for _ in workload.requests]  # what a later turn waits for
    bar = _progress_bar(len(offsets), progress)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def one(i: int, req: BenchRequest, offset_s: float | None) -> tuple[RequestRecord, float]:
            rec = RequestRecord(i, req.prompt_len, req.output_len)
            try:
                if offset_s is None:  # a later turn: it arrives when the turn before has finished
                    await finished[req.after].wait()
                    offset_s = time.perf_counter() - start
                rec.scheduled_s = offset_s
                await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
                arrived = time.perf_counter()
                async with gate or _no_gate():
                    rec.sent_s = time.perf_counter() - start
                    rec.queue_s = time.perf_counter() - arrived
                    await send_one(session, cfg, build_payload(cfg, req, temperature), rec)
            finally:
                finished[i].set()
            bar.update(1)
            return rec, time.perf_counter() - start

        try:
            done = await asyncio.gather(*(one(i, r, o) for i, (r, o) in enumerate(zip(workload.requests, offsets))))
        finally:
            bar.close()
    records = [rec for rec, _ in done]
    first_sent = min((r.sent_s for r in records), default=0.0)
    last_done = max((end for _, end in done), default=0.0)
    return records, last_done - first_sent


def _offsets(workload: Workload, arrivals: ArrivalConfig) -> list[float | None]:
    """Arrival offsets of the requests that arrive on the schedule; None for those that wait on another."""
    scheduled = iter(arrivals.offsets_s(sum(r.after is None for r in workload.requests)))
    return [next(scheduled) if r.after is None else None for r in workload.requests]


class _no_gate:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="req", leave=False)


async def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model `/v1/models` lists (for runs that do not name one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(base_url + "/models", headers=headers) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
