"""Metric definitions (BENCH.md): percentiles, per-token ITL, TPOT, throughput, goodput, rates."""
from __future__ import annotations

import math

import pytest

from blink.bench.cli import parse_cores, parse_rates
from blink.bench.loadgen import ArrivalConfig
from blink.bench.metrics import RequestRecord, parse_slos, per_token_itl, percentile, summarize


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0


def test_itl_is_one_value_per_token():
    times = [0.0, 0.1, 0.4]  # three chunks; the last carried 3 tokens (5 tokens in all)
    assert per_token_itl(times, [1, 1, 3], 5) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    est = per_token_itl(times, None, 5)  # counts unknown: 4 later tokens spread over 2 chunks
    assert len(est) == 4 and sum(est) == pytest.approx(0.4)
    assert per_token_itl(times, None, 3) == pytest.approx([0.1, 0.3])


def record(i, ttft, e2el, tokens, queue=0.0, error=None):
    return RequestRecord(i, 10, tokens, queue_s=queue, ttft_s=ttft, e2el_s=e2el, completion_tokens=tokens,
                         prompt_tokens=10, error=error)


def test_summary_figures():
    recs = [record(0, 0.1, 1.0, 10), record(1, 0.2, 2.0, 10, queue=0.5), record(2, None, None, 0, error="HTTP 400")]
    s = summarize(recs, duration_s=2.0, slos=parse_slos(["ttft:150", "tpot:150"]))
    assert recs[0].tpot_s == pytest.approx(0.1) and recs[1].tpot_s == pytest.approx(0.2)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_throughput_tok_s"] == pytest.approx(10.0)
    assert s["request_throughput_req_s"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0) and s["tpot_ms"]["p99"] == pytest.approx(199.0)
    assert s["queue_ms"]["p99"] > 0
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["goodput_req_s"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ttft"):
        parse_slos(["latency:5"])


def test_arrivals_are_seeded_gamma_or_all_at_once():
    a = ArrivalConfig(rate=10.0, seed=3).offsets_s(2000)
    assert a == ArrivalConfig(rate=10.0, seed=3).offsets_s(2000) != ArrivalConfig(rate=10.0, seed=4).offsets_s(2000)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.1, rel=0.1)  # mean interval 1/rate
    assert ArrivalConfig(rate=math.inf).offsets_s(3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        ArrivalConfig(rate=0.0)


def test_rates_and_cores_parsing():
    sweep = parse_rates(None, "1:64")
    assert len(sweep) == 13 and sweep[0] == 1 and sweep[-1] == pytest.approx(64)
    assert sweep[6] == pytest.approx(8, rel=1e-3)
    assert parse_rates("1,2.5,inf", None) == [1.0, 2.5, math.inf]
    assert parse_cores("0-2,5") == [0, 1, 2, 5]
