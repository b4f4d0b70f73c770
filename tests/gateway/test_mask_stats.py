"""BLINK_MASK_STATS_S's per-worker line: what the mask steps waited, computed and put, and how many took long."""
from __future__ import annotations

import logging

import pytest

from gateway.structured import mask_loop


def test_steps_are_summed_counted_over_the_limits_and_reset_by_take():
    stats = mask_loop.MaskStats(period_s=1.0)
    assert stats.on
    stats.record(0.0005, 0.0010, 0.0001)   # 1.6 ms: under both limits
    stats.record(0.0020, 0.0015, 0.0001)   # 3.6 ms: over 2 ms
    stats.record(0.0001, 0.0060, 0.0002)   # 6.3 ms: over both
    x = stats.take()
    assert x["steps"] == 3 and (x["over_2ms"], x["over_5ms"]) == (2, 1)
    assert x["queued_ms_max"] == pytest.approx(2.0) and x["computed_ms_max"] == pytest.approx(6.0)
    assert x["total_ms_max"] == pytest.approx(6.3)
    assert x["queued_ms_mean"] == pytest.approx((0.5 + 2.0 + 0.1) / 3)
    assert stats.take()["steps"] == 0  # taken: a fresh start


def test_the_line_is_logged_once_a_period_with_the_workers_pid(caplog, monkeypatch):
    stats = mask_loop.MaskStats(period_s=0.5)
    clock = [100.0]
    monkeypatch.setattr(mask_loop.time, "monotonic", lambda: clock[0])
    stats._next_log_s = 100.5
    stats.record(0.001, 0.004, 0.0)
    with caplog.at_level(logging.INFO, logger="blink.gateway.structured"):
        stats.maybe_log(", watching 3")
        assert not caplog.records  # not yet a period
        clock[0] = 100.6
        stats.maybe_log(", watching 3")
    [record] = caplog.records
    assert "mask stats (pid " in record.getMessage() and "1 steps" in record.getMessage()
    assert "over 2 ms 1, over 5 ms 0, watching 3" in record.getMessage()


def test_off_by_default_and_a_bad_value_leaves_it_off(monkeypatch, caplog):
    assert not mask_loop.MaskStats().on
    monkeypatch.setenv("BLINK_MASK_STATS_S", "soon")
    with caplog.at_level(logging.WARNING, logger="blink.gateway.structured"):
        assert mask_loop._stats_period() == 0.0
    assert "BLINK_MASK_STATS_S='soon'" in caplog.text
    monkeypatch.setenv("BLINK_MASK_STATS_S", "2")
    assert mask_loop._stats_period() == 2.0
