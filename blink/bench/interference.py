"""CPU interference like the Blink paper's: compression, a parallel C build, and memory churn.

`Interference(threads=N, seconds=S, cores=..., gateway_cores=...)` starts N worker threads in total,
each worker a process in its own session (process group), pinned with `os.sched_setaffinity` to the
core set (the given cores, or every core of this process minus `gateway_cores`):
- `bz2`: one process per thread compressing a 1 MB buffer at level 9 in a loop;
- `build`: one `make -j K -B` over generated C sources in a temp dir, repeated (K threads);
- `churn`: one process (one thread of the N) whose two threads mmap 32 MB, touch every page and
  munmap in a loop: the unmaps of memory touched on other cores cause TLB shootdowns.
With all three kinds, churn takes 1 thread (when N >= 3), build half the rest, bz2 the remainder.
Bounded twice: each worker exits at its deadline (and when its parent dies), and `stop()` (also run
by `with`, so on exceptions and Ctrl-C) kills every process group and removes the temp dir.
"""
from __future__ import annotations

import argparse
import bz2
import ctypes
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from .collectors import live_group_members

KINDS = ("bz2", "build", "churn")
PR_SET_PDEATHSIG = 1


@dataclass
class Worker:
    kind: str
    jobs: int  # threads of the N this worker accounts for
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid


def plan(threads: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[str, int]]:
    """(kind, jobs) per worker process; jobs add up to `threads`."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds or threads < 1:
        raise ValueError(f"interference: need threads >= 1 and kinds among {KINDS}, got {threads}, {kinds}")
    out, rest = [], threads
    if "churn" in kinds and (threads >= 3 or kinds == ("churn",)):
        out.append(("churn", 1))
        rest -= 1
        if kinds == ("churn",):
            out += [("churn", 1)] * rest
            return out
    compute = [k for k in kinds if k != "churn"] or ["bz2"]
    build = rest // 2 if len(compute) == 2 else (rest if compute == ["build"] else 0)
    if build:
        out.append(("build", build))
    out += [("bz2", 1)] * (rest - build)
    return out


def resolve_cores(cores: list[int] | None, gateway_cores: list[int] | None) -> list[int]:
    chosen = set(cores) if cores else set(os.sched_getaffinity(0))
    chosen -= set(gateway_cores or ())
    if not chosen:
        raise ValueError("interference: no core left after removing the gateway's cores")
    return sorted(chosen)


class Interference:
    """N interfering threads on a core set for at most `seconds`; use as a context manager."""

    def __init__(self, threads: int, seconds: float, cores: list[int] | None = None,
                 gateway_cores: list[int] | None = None, kinds: tuple[str, ...] = KINDS):
        self.threads, self.seconds, self.kinds = threads, seconds, tuple(kinds)
        self.cores = resolve_cores(cores, gateway_cores)
        self.plan = plan(threads, self.kinds)
        self.workers: list[Worker] = []
        self.tmp_dir: str | None = None

    def describe(self) -> dict:
        return {"threads": self.threads, "seconds": self.seconds, "cores": self.cores,
                "workers": [{"kind": k, "jobs": j} for k, j in self.plan]}

    def num_running(self) -> int:
        """Workers still running (a run longer than `seconds` outlives its interference)."""
        return sum(w.proc.poll() is None for w in self.workers)

    def start(self) -> "Interference":
        self.tmp_dir = tempfile.mkdtemp(prefix="blink-interfere-")
        cores = ",".join(map(str, self.cores))
        # Ctrl-C or SIGTERM is held while workers are spawned: one landing inside Popen would leave a forked
        # worker untracked; held, it lands once every worker is in self.workers, and stop() gets them all
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for kind, jobs in self.plan:
                cmd = [sys.executable, "-m", "blink.bench.interference", kind, "--jobs", str(jobs),
                       "--seconds", str(self.seconds), "--cores", cores, "--tmp", self.tmp_dir]
                proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, cwd=_project_root())
                self.workers.append(Worker(kind, jobs, proc))
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        for w in self.workers:
            _killpg(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(w.pid, signal.SIGKILL)  # also make's compilers left in the group
            w.proc.wait()
        for w in self.workers:
            _wait_group_gone(w.pid, deadline + grace_s)
        if self.tmp_dir:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "Interference":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, deadline: float) -> None:
    """Until no process of the killed group runs (zombies left to init's reaping do not run)."""
    while live_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- the workers (separate processes)

def _alive(deadline: float, parent: int) -> bool:
    return time.monotonic() < deadline and os.getppid() == parent


def run_bz2(deadline: float, parent: int, **_) -> None:
    rng = random.Random(0)
    words = [bytes(rng.getrandbits(8) for _ in range(8)) for _ in range(512)]
    data = b"".join(rng.choice(words) for _ in range(1 << 17))  # 1 MB, compressible like text
    while _alive(deadline, parent):
        bz2.compress(data, 9)


C_SOURCE = """\
double f{i}_{j}(double x) {{ double s = 0; for (int k = 1; k < 100; k++) s += x / k + {j}; return s; }}
"""


def _write_sources(root: str, num_files: int) -> None:
    objs = " ".join(f"u{i}.o" for i in range(num_files))
    for i in range(num_files):
        with open(os.path.join(root, f"u{i}.c"), "w") as f:
            f.write("".join(C_SOURCE.format(i=i, j=j) for j in range(150)))
    with open(os.path.join(root, "Makefile"), "w") as f:
        f.write(f"all: {objs}\n%.o: %.c\n\t$(CC) -O2 -c $< -o $@\n")


def run_build(deadline: float, parent: int, jobs: int, tmp: str, **_) -> None:
    root = tempfile.mkdtemp(prefix="build-", dir=tmp)
    _write_sources(root, 4 * jobs)
    while _alive(deadline, parent):
        left = deadline - time.monotonic()
        try:
            subprocess.run(["make", "-s", "-B", f"-j{jobs}", "-C", root], timeout=max(left, 0.1),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            break


def run_churn(deadline: float, parent: int, **_) -> None:
    size = 32 << 20

    def loop():
        while _alive(deadline, parent):
            m = mmap.mmap(-1, size)
            for off in range(0, size, mmap.PAGESIZE):
                m[off] = 1
            m.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


RUNNERS = {"bz2": run_bz2, "build": run_build, "churn": run_churn}


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one interference worker (started by Interference)")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--cores", required=True)
    p.add_argument("--tmp", required=True)
    args = p.parse_args(argv)
    try:  # die with the controller even if it is killed without a chance to stop us
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})
    deadline = time.monotonic() + args.seconds
    RUNNERS[args.kind](deadline, os.getppid(), jobs=args.jobs, tmp=args.tmp)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
