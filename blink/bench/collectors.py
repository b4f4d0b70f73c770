"""Server-side figures over a run's window: backend CPU per token, GPU energy per token, roofline.

Each collector has `start()` and `stop(generated_tokens) -> dict`; one that cannot measure says
`{"available": False, "reason": "not available: <why>"}` instead of failing.
- `CpuCollector`: user + system CPU seconds of a process and all its descendants, from
  /proc/PID/stat (utime, stime, and cutime/cstime for descendants that exited and were reaped in the
  window), per generated token; and where it goes, by thread name over the whole tree (`per_thread_cpu_s`, from
  each thread's /proc/PID/task/TID/schedstat run time in nanoseconds, so milliseconds show: which threads a
  backend's steady CPU comes from, or a gateway's workers' grammar threads).
- `NvmlCollector`: `nvmlDeviceGetTotalEnergyConsumption` delta (mJ) per generated token, summed over the
  GPUs, and GPU utilisation sampled every `interval_s` on a thread.
- `roofline`: achieved GB/s of a decode step against a copy bandwidth (BENCH.md "Roofline").
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat fields from field 3 (state) on: the name in parentheses may hold spaces."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def parent_map() -> dict[int, int]:
    """pid -> parent pid for every live process."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))):
            parents[int(entry.name)] = int(fields[1])
    return parents


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are not zombies (a zombie waits for its reaper only)."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))):
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def process_tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    parents = parent_map()
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def child_pids_matching(pid: int, needle: str) -> list[int]:
    """Descendants of `pid` whose command line contains `needle` (finds the backend of `blink serve`)."""
    found = []
    for p in process_tree(pid)[1:]:
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(p)
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of one process, in seconds (0 if it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / CLOCK_TICKS  # stat fields 14..17


def thread_run_ns(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (thread name, nanoseconds run on a CPU) for each live thread of `pid` (empty if it is gone)."""
    threads = {}
    try:
        tasks = os.scandir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for task in tasks:
        try:
            name = Path(task.path, "comm").read_text().strip()
            run_ns = int(Path(task.path, "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile, or no schedstat in this kernel
        threads[int(task.name)] = (name, run_ns)
    return threads


def threads_cpu_s(start: dict, end: dict) -> dict[str, float]:
    """CPU seconds per thread name between two snapshots of `thread_run_ns` (keyed by tid) or of a tree (keyed by
    (pid, tid)): threads of one name summed, a thread that ended in between not counted here; largest first."""
    by_name: dict[str, float] = {}
    for tid, (name, run_ns) in end.items():
        before = start.get(tid, (name, 0))[1]
        by_name[name] = by_name.get(name, 0.0) + (run_ns - before) / 1e9
    return dict(sorted(((n, round(v, 6)) for n, v in by_name.items()), key=lambda kv: -kv[1]))


class CpuCollector:
    """CPU seconds of a process tree over the window, per generated token; by thread name over the tree."""

    def __init__(self, pid: int):
        self.pid = pid
        self._start: dict[int, float] = {}
        self._threads: dict[int, tuple[str, int]] = {}

    def _snapshot(self) -> dict[int, float]:
        return {p: cpu_seconds(p) for p in process_tree(self.pid)}

    def _tree_threads(self) -> dict[tuple[int, int], tuple[str, int]]:
        """(pid, tid) -> (thread name, run ns) over the process tree: a gateway's workers are child processes."""
        return {(p, tid): v for p in process_tree(self.pid) for tid, v in thread_run_ns(p).items()}

    def start(self) -> None:
        self._start = self._snapshot()
        self._threads = self._tree_threads()

    def stop(self, generated_tokens: int) -> dict:
        if not Path(f"/proc/{self.pid}").exists():
            return {"available": False, "reason": f"not available: process {self.pid} is gone"}
        end, threads = self._snapshot(), self._tree_threads()
        per_pid = {p: end[p] - self._start.get(p, 0.0) for p in end}
        cpu_s = sum(per_pid.values())
        return {"available": True, "pid": self.pid, "num_processes": len(end), "cpu_s": cpu_s,
                "per_process_cpu_s": {str(p): round(v, 4) for p, v in per_pid.items()},
                "per_thread_cpu_s": threads_cpu_s(self._threads, threads),
                "generated_tokens": generated_tokens,
                "cpu_s_per_token": cpu_s / generated_tokens if generated_tokens else None}


class NvmlCollector:
    """GPU energy (NVML total energy counter) and utilisation samples over the window."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.reason: str | None = None
        self._nvml = None
        self._handles: list = []
        self._energy_mj: list[int] = []
        self._util: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if not self._handles:
                raise RuntimeError("NVML sees no GPU")
            self._nvml = pynvml
            self._energy_mj = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]
        except Exception as exc:  # no package, no driver, no GPU, or a GPU without the counter
            self.reason = f"not available: {type(exc).__name__}: {exc}"
            return
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._util += [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]

    def stop(self, generated_tokens: int) -> dict:
        if self._nvml is None:
            return {"available": False, "reason": self.reason or "not available: not started"}
        self._stop.set()
        self._thread.join()
        end = [self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]
        energy_mj = sum(e - s for s, e in zip(self._energy_mj, end))
        util = self._util
        self._nvml.nvmlShutdown()
        return {"available": True, "num_gpus": len(self._handles), "energy_mj": energy_mj,
                "generated_tokens": generated_tokens,
                "energy_mj_per_token": energy_mj / generated_tokens if generated_tokens else None,
                "gpu_util_pct": {"mean": sum(util) / len(util) if util else None,
                                 "max": max(util, default=None), "num_samples": len(util)}}


def roofline(weight_bytes: int | None, copy_gbps: float | None, step_s: float | None,
             batch_size: float = 1.0, kv_bytes_per_token: int = 0, mean_context_len: float = 0.0) -> dict:
    """Achieved GB/s of one decode step and the step-time floor at `copy_gbps`.

    A decode step reads the weights once plus each running sequence's KV cache:
    bytes = weight_bytes + batch_size * mean_context_len * kv_bytes_per_token. `step_s` is the measured
    time per step (median TPOT: every running sequence advances one token per step).
    """
    if not weight_bytes or not copy_gbps:
        return {"available": False, "reason": "not available: needs --weight-bytes and --copy-gbps"}
    if not step_s:
        return {"available": False, "reason": "not available: no decode step time (TPOT) was measured"}
    step_bytes = weight_bytes + batch_size * mean_context_len * kv_bytes_per_token
    floor_s = step_bytes / (copy_gbps * 1e9)
    return {"available": True, "step_bytes": step_bytes, "step_s": step_s, "batch_size": batch_size,
            "achieved_gbps": step_bytes / step_s / 1e9, "copy_gbps": copy_gbps, "floor_step_s": floor_s,
            "fraction_of_roofline": floor_s / step_s,
            "kv_counted": bool(kv_bytes_per_token)}
