"""Per-request records and the figures of `vllm bench serve` computed from them (see BENCH.md).

TTFT: request sent -> first chunk carrying a choice with content. E2EL: request sent -> last
token-bearing chunk. TPOT: (E2EL - TTFT) / (output_tokens - 1), output tokens from
usage.completion_tokens. ITL: gaps between token-bearing chunks, one value per token (a gap before a
chunk of k tokens counts as k gaps of gap/k). Queue time (waiting for the max-concurrency gate) is
reported apart and is in none of the above. Throughput counts over `duration_s`, first dispatch to
last completion.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What one request did; times in seconds, relative to the run's first dispatch where noted."""

    index: int
    prompt_len: int
    max_tokens: int
    scheduled_s: float = 0.0   # arrival time in the schedule, from the run start
    queue_s: float = 0.0       # arrival -> sent (the concurrency gate)
    sent_s: float = 0.0        # from the run start
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0     # usage.prompt_tokens_details.cached_tokens: prompt tokens the server's cache held
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        return {**asdict(self), "tpot_s": self.tpot_s}


def per_token_itl(chunk_times_s: list[float], tokens_per_chunk: list[int] | None, num_tokens: int) -> list[float]:
    """One ITL per token after the first, from the arrival times of token-bearing chunks.

    `tokens_per_chunk` is exact when the server reports it (usage in every chunk); otherwise the first
    chunk counts one token and the other `num_tokens - 1` are spread evenly over the later chunks.
    """
    gaps = [b - a for a, b in zip(chunk_times_s, chunk_times_s[1:])]
    counts = tokens_per_chunk[1:] if tokens_per_chunk else _spread(num_tokens - 1, len(gaps))
    itl = []
    for gap, k in zip(gaps, counts):
        itl += [gap / k] * k if k > 0 else [gap]
    return itl


def _spread(total: int, parts: int) -> list[int]:
    if parts <= 0:
        return []
    base, extra = divmod(max(total, parts), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so it matches vLLM's numbers."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values_s: list[float]) -> dict:
    """mean, median, P90, P99 in milliseconds (None where there are no values)."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms), "count": len(ms)}
    out.update({("median" if q == 50 else f"p{q}"): percentile(ms, q) for q in PERCENTILES})
    return out


def parse_slos(specs: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` -> {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out)."""
    slos = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        slos[name] = float(value) / 1000
    return slos


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2el_s}
    return r.ok and all(values[name] <= limit for name, limit in slos.items())


def prefix_cache_hits(records: list[RequestRecord]) -> dict:
    """Prompt tokens the server reported cached (usage) and their share of all prompt tokens."""
    prompt_tokens = sum(r.prompt_tokens for r in records)
    cached_tokens = sum(r.cached_tokens for r in records)
    return {"cached_tokens": cached_tokens, "prompt_tokens": prompt_tokens,
            "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0}


def summarize(records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """Every figure of one run (one request rate)."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.completion_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    out = {"num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
           "duration_s": duration_s, "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": output_tokens, "output_throughput_tok_s": output_tokens / duration_s,
           "request_throughput_req_s": len(ok) / duration_s,
           "ttft_ms": stats_ms([r.ttft_s for r in ok]), "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
           "itl_ms": stats_ms([x for r in ok for x in r.itl_s]), "e2el_ms": stats_ms([r.e2el_s for r in ok]),
           "queue_ms": stats_ms([r.queue_s for r in records]), "prefix_cache": prefix_cache_hits(ok)}
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        out["goodput"] = {"slos_ms": {k: v * 1000 for k, v in slos.items()}, "good_requests": good,
                          "goodput_req_s": good / duration_s}
    return out
