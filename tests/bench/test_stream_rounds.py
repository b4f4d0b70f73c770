"""bench/stream_rounds.py: the all-open window's poll rounds, and what filled the gaps between them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from stream_rounds import rounds_summary  # noqa: E402

MS = 1_000_000


def test_gaps_are_told_apart_by_the_threads_cpu_time_in_them():
    """Round records [start, wall, cpu, updates, cpu at start]: a gap the thread spent working counts as
    busy, one in which it hardly ran as stalled (and its lost time is the gap less that CPU time)."""
    rounds, t, cpu = [], 10 * MS, 0
    for wall, updates, gap, gap_cpu in [(100_000, 3, 50_000, 50_000),   # short gap: neither
                                        (100_000, 3, 500_000, 480_000),  # 0.5 ms of the loop's own work
                                        (100_000, 0, 5 * MS, 1 * MS),    # 5 ms, the thread ran 1 ms of it
                                        (100_000, 2, 50_000, 50_000)]:
        rounds += [t, wall, wall, updates, cpu]
        t, cpu = t + wall + gap, cpu + wall + gap_cpu
    rounds += [t, 100_000, 100_000, 1, cpu]
    s = rounds_summary({"steady_ns": 0, "first_end_ns": t + MS}, rounds)
    assert s["rounds"] == 5 and s["gaps_over_300_us"] == 2 and s["gaps_over_1_ms"] == 1
    assert s["gap_busy_over_300_us"] == 1 and abs(s["gap_busy_ms"] - 0.5) < 1e-9
    assert s["gap_stalled_over_1_ms"] == 1 and abs(s["gap_stalled_lost_ms"] - 4.0) < 1e-9
    assert s["largest_gap_ms"] == 5.0 and s["cpu_us_per_update_in_rounds"] == 500 / 9
