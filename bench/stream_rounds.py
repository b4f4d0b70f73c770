"""BENCHMARK-ONLY: what the gateway's poller did while every stream was open, from a probed stream run.

    BLINK_ROUNDS=ROUNDS_JSON PYTHONPATH=. .venv/bin/python bench/ring_traffic.py stream --streams 512 --tag r1
    PYTHONPATH=. .venv/bin/python bench/stream_rounds.py RUN_JSON ROUNDS_JSON

RUN_JSON is the run's result (`bench/results/gateway_stream_512_r1-COMMIT.json`: it gives the all-open window),
ROUNDS_JSON what `bench/gateway_probe.py` wrote (per poll round: start monotonic ns, wall ns, thread CPU ns,
updates). Prints, for the all-open window: the rounds and their updates; **sleeps**, gaps of over 0.9 ms
between an empty round and the next (the poller slept on a timer, or lost its core right then); **off-CPU
rounds**, rounds whose wall time exceeds their CPU time by over 1 ms (the thread was preempted or the VM
stalled); and the largest round (a burst of updates found at once, each written before the next).
"""
from __future__ import annotations

import json
import sys

import numpy as np


def rounds_summary(run: dict, rounds: list[int]) -> dict:
    r = np.array(rounds, dtype=np.int64).reshape(-1, 4)  # [start ns, wall ns, cpu ns, updates]
    r = r[(r[:, 0] > run["steady_ns"]) & (r[:, 0] < run["first_end_ns"])]
    gaps = np.diff(r[:, 0]) - r[:-1, 1]  # from one round's end to the next one's start
    return {"rounds": len(r), "updates_per_round": float(r[:, 3].mean()),
            "sleeps_over_0_9_ms": int(((gaps > 900_000) & (r[:-1, 3] == 0)).sum()),
            "off_cpu_rounds_over_1_ms": int(((r[:, 1] - r[:, 2]) > 1_000_000).sum()),
            "largest_round_updates": int(r[:, 3].max()),
            "cpu_us_per_update_in_rounds": float(r[:, 2].sum() / max(r[:, 3].sum(), 1) / 1e3)}


if __name__ == "__main__":
    run = json.loads(open(sys.argv[1]).read())
    print(json.dumps(rounds_summary(run, json.loads(open(sys.argv[2]).read())), indent=1))
