"""BENCHMARK-ONLY: what the gateway's poller did while every stream was open, from a probed stream run.

    BLINK_ROUNDS=ROUNDS_JSON PYTHONPATH=. .venv/bin/python bench/ring_traffic.py stream --streams 512 --tag r1
    PYTHONPATH=. .venv/bin/python bench/stream_rounds.py RUN_JSON ROUNDS_JSON

RUN_JSON is the run's result (`bench/results/gateway_stream_512_r1-COMMIT.json`: it gives the all-open window),
ROUNDS_JSON what `bench/gateway_probe.py` wrote (per poll round: start monotonic ns, wall ns, thread CPU ns,
updates, the thread's CPU time at the round's start). Prints, for the all-open window: the rounds and their
updates; **sleeps**, gaps of over 0.9 ms between an empty round and the next (the poller slept on a timer, or
lost its core right then); **off-CPU rounds**, rounds whose wall time exceeds their CPU time by over 1 ms (the
thread was preempted or the VM stalled); the largest round (a burst of updates found at once, each written
before the next); and the gaps between rounds: those in which the gateway's own work held the event loop, and
those in which its thread did not run.
"""
from __future__ import annotations

import json
import sys

import numpy as np


def rounds_summary(run: dict, rounds: list[int]) -> dict:
    """The all-open window's rounds. Between two rounds (a gap) the event loop ran other work (request set-ups
    and ends, other callbacks) or the thread did not run at all; the 5-field records tell which: the thread's
    CPU time over a gap against its wall time. `gap_busy_*`: gaps over 300 us in which the thread ran over
    90% of the time (the gateway's own work held the poller); `gap_stalled_*`: gaps over 1 ms in which it ran
    under half of the time (preempted, or its vCPU not run by the host)."""
    r = np.array(rounds, dtype=np.int64).reshape(-1, 5)  # [start ns, wall ns, cpu ns, updates, cpu at start ns]
    r = r[(r[:, 0] > run["steady_ns"]) & (r[:, 0] < run["first_end_ns"])]
    gaps = np.diff(r[:, 0]) - r[:-1, 1]  # from one round's end to the next one's start
    out = {"rounds": len(r), "updates_per_round": float(r[:, 3].mean()),
           "sleeps_over_0_9_ms": int(((gaps > 900_000) & (r[:-1, 3] == 0)).sum()),
           "off_cpu_rounds_over_1_ms": int(((r[:, 1] - r[:, 2]) > 1_000_000).sum()),
           "largest_round_updates": int(r[:, 3].max()),
           "cpu_us_per_update_in_rounds": float(r[:, 2].sum() / max(r[:, 3].sum(), 1) / 1e3),
           "gaps_over_300_us": int((gaps > 300_000).sum()), "gaps_over_1_ms": int((gaps > 1_000_000).sum()),
           "largest_gap_ms": float(gaps.max() / 1e6) if len(gaps) else 0.0}
    gap_cpu = r[1:, 4] - (r[:-1, 4] + r[:-1, 2])  # the thread's CPU time from one round's end to the next start
    busy, stalled = (gaps > 300_000) & (gap_cpu > 0.9 * gaps), (gaps > 1_000_000) & (gap_cpu < 0.5 * gaps)
    out.update(gap_busy_over_300_us=int(busy.sum()), gap_busy_ms=float(gaps[busy].sum() / 1e6),
               gap_stalled_over_1_ms=int(stalled.sum()),
               gap_stalled_lost_ms=float((gaps[stalled] - gap_cpu[stalled]).sum() / 1e6))
    return out


if __name__ == "__main__":
    run = json.loads(open(sys.argv[1]).read())
    print(json.dumps(rounds_summary(run, json.loads(open(sys.argv[2]).read())), indent=1))
