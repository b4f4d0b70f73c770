"""Prometheus metrics, named as vLLM names them (`vllm:` becomes `blink:`) so existing dashboards work.

Per request, `request_finished` and `rejected` do a few counter increments and histogram observations;
nothing is recorded per token. Backend gauges (running/waiting sequences, KV usage, health) are read
from each ring's header when Prometheus scrapes, not polled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .errors import Overloaded

if TYPE_CHECKING:
    from .backends.backend import Backend
    from .errors import ApiError

disable_created_metrics()  # no `*_created` series: a third of every scrape, unused by dashboards (vLLM too)

MODEL = ["model_name"]
BACKEND = ["model_name", "backend"]
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                  20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                  1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                 240.0, 480.0, 960.0)
# ApiError statuses whose error object carries no code, as a `reason` label.
_STATUS_REASONS = {400: "invalid_request", 401: "unauthenticated", 404: "not_found",
                   413: "request_too_large", 429: "rate_limited", 500: "internal_error",
                   503: "service_unavailable"}


class Metrics:
    """The gateway's metrics in their own registry (several gateways may share a process in tests)."""

    def __init__(self, backends: Callable[[], Iterable[Backend]] = tuple):
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("blink:prompt_tokens", "Prompt tokens of finished requests.", MODEL,
                                     registry=r)
        self.generation_tokens = Counter("blink:generation_tokens", "Generated tokens of finished requests.",
                                         MODEL, registry=r)
        self.request_success = Counter("blink:request_success", "Finished requests by finish reason "
                                       "(stop, length, abort: the client went away).",
                                       MODEL + ["finished_reason"], registry=r)
        self.rejected_requests = Counter("blink:request_rejected", "Requests answered with an error, by "
                                         "reason (the OpenAI error code).", ["reason"], registry=r)
        self.shed = Counter("blink:num_requests_shed", "Requests answered 503 with Retry-After because every "
                            "ring slot stayed busy for slot_wait_s (also in blink:request_rejected_total as "
                            "service_unavailable).", registry=r)
        self.retries = Counter("blink:request_retries", "Requests submitted again to another backend by "
                               "failover, by reason (submit_refused: the backend refused it, e.g. draining, "
                               "dead or out of slots; failed_before_first_token).", MODEL + ["reason"],
                               registry=r)
        self.prefix_queries = Counter("blink:prefix_cache_queries", "Prompt tokens of finished requests on "
                                      "backends with a prefix cache (vLLM's prefix_cache_queries).", MODEL, registry=r)
        self.prefix_hits = Counter("blink:prefix_cache_hits", "Of those, tokens whose KV the engine reused "
                                   "(usage.prompt_tokens_details.cached_tokens).", MODEL, registry=r)
        self.ttft = Histogram("blink:time_to_first_token_seconds", "Arrival to first token.", MODEL,
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.tpot = Histogram("blink:time_per_output_token_seconds", "Mean time between output tokens, "
                              "one observation per request.", MODEL, buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("blink:e2e_request_latency_seconds", "Arrival to last token.", MODEL,
                             buckets=E2E_BUCKETS_S, registry=r)
        r.register(BackendCollector(backends))
        # Each request's series, looked up once per model (and finish reason): `labels()` checks and hashes
        # its values on every call, and a request's end makes six of them.
        self._by_model: dict[str, tuple] = {}
        self._success: dict[tuple[str, str], Counter] = {}

    def request_finished(self, model: str, prompt_len: int, completion_len: int, finish_reason: str,
                         arrival_s: float, first_token_s: float | None, last_token_s: float | None,
                         end_s: float) -> None:
        """One request left the gateway (finished, or aborted by its client); times in perf_counter s."""
        series = self._by_model.get(model)
        if series is None:
            series = self._by_model[model] = tuple(m.labels(model) for m in (
                self.prompt_tokens, self.generation_tokens, self.e2e, self.ttft, self.tpot))
        prompt_tokens, generation_tokens, e2e, ttft, tpot = series
        success = self._success.get((model, finish_reason))
        if success is None:
            success = self._success[model, finish_reason] = self.request_success.labels(model, finish_reason)
        prompt_tokens.inc(prompt_len)
        generation_tokens.inc(completion_len)
        success.inc()
        e2e.observe(end_s - arrival_s)
        if first_token_s is not None:
            ttft.observe(first_token_s - arrival_s)
            if completion_len > 1 and last_token_s is not None:
                tpot.observe((last_token_s - first_token_s) / (completion_len - 1))

    def prefix_cache_used(self, model: str, prompt_len: int, cached_len: int) -> None:
        """A prefilled request on a backend with a prefix cache: `cached_len` of its `prompt_len` tokens were reused."""
        self.prefix_queries.labels(model).inc(prompt_len)
        self.prefix_hits.labels(model).inc(cached_len)

    def retried(self, model: str, reason: str) -> None:
        self.retries.labels(model, reason).inc()

    def rejected(self, err: ApiError) -> None:
        self.rejected_requests.labels(reason_of(err)).inc()
        if isinstance(err, Overloaded):
            self.shed.inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def reason_of(err: ApiError) -> str:
    return err.detail.code or _STATUS_REASONS.get(err.status, f"http_{err.status}")


class BackendCollector(Collector):
    """Per-backend gauges, read from the ring header at scrape time."""

    def __init__(self, backends: Callable[[], Iterable[Backend]]):
        self._backends = backends

    def collect(self):
        running = GaugeMetricFamily("blink:num_requests_running", "Sequences in the engine's running batch.",
                                    labels=BACKEND)
        waiting = GaugeMetricFamily("blink:num_requests_waiting", "Requests waiting: admitted by the engine "
                                    "but not running, or queued in the gateway for a ring slot.", labels=BACKEND)
        kv = GaugeMetricFamily("blink:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                               labels=BACKEND)
        slots = GaugeMetricFamily("blink:ring_slots_in_use", "Request-ring slots holding a request.",
                                  labels=BACKEND)
        healthy = GaugeMetricFamily("blink:backend_healthy", "1 while the engine serves and its heartbeat "
                                    "moves, else 0.", labels=BACKEND)
        native = GaugeMetricFamily("blink:native_streams", "Streams the poller's round in C delivers now "
                                   "(gateway/streaming/stream_round.py).", labels=BACKEND)
        cached = GaugeMetricFamily("blink:kv_cache_cached_blocks", "KV blocks the engine's prefix cache holds "
                                   "(referenced or kept for reuse), on backends that report it.", labels=BACKEND)
        for b in self._backends():
            labels = [b.info.model_name, b.info.addr]
            try:
                stats = b.engine_stats()
                serving = b.serving
            except (TypeError, ValueError):  # the ring was unmapped: the gateway is shutting down
                continue
            total = stats["total_kv_blocks"]
            running.add_metric(labels, stats["running"])
            waiting.add_metric(labels, stats["waiting"] + b.num_waiting)
            kv.add_metric(labels, (total - stats["free_kv_blocks"]) / total if total else 0.0)
            slots.add_metric(labels, b.info.geometry.num_slots - b.free_slots)
            healthy.add_metric(labels, 1.0 if serving else 0.0)
            native.add_metric(labels, getattr(b, "num_native_streams", 0))
            if "cached_kv_blocks" in stats:
                cached.add_metric(labels, stats["cached_kv_blocks"])
        return [running, waiting, kv, slots, healthy, native, cached]
