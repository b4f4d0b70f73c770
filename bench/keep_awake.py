"""BENCHMARK-ONLY: keeps cores of this VM from halting while a benchmark runs, as `idle=poll` would.

This machine is a KVM guest whose idle cores halt (`haltpoll.guest_halt_poll_ns=0`): a halted vCPU gives
its host core back, and the timer that should wake a sleeping process there waits until the host runs the
vCPU again, which on a busy host is milliseconds at times. The fake engine (`bench/traffic_engine.py`)
sleeps 0.5 ms between steps on a core whose other user, the client, sleeps too, so that core is idle
about half the time: each late wake-up then shows as a burst of overdue tokens, which the gateway
measured downstream has to write all at once. The engine stands in for a GPU, which no host scheduler
delays; a busy loop at SCHED_IDLE on that core keeps it awake and runs only when nothing else wants the
core (the engine at SCHED_FIFO and the client preempt it at once).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal


def _spin(core: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.sched_setaffinity(0, {core})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


@contextlib.contextmanager
def keep_awake(cores: set[int]):
    """A SCHED_IDLE busy loop pinned to each of `cores` while the block runs; yields their pids."""
    spinners = [mp.get_context("fork").Process(target=_spin, args=(core,), daemon=True) for core in sorted(cores)]
    for spinner in spinners:
        spinner.start()
    try:
        yield [spinner.pid for spinner in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join(timeout=10)
