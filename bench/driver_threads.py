"""Which threads of a CUDA process use the CPU while the GPU is busy and the host does nothing (issue 26).

The persistent loop's backend keeps a steady ~1.2-1.5 ms of CPU a second per GPU with none of our code running
in the window (bench/gpu_host.py's `cpu_s_by_thread` names `cuda-EvtHandlr`). This probe separates the CUDA
driver's own threads from ours: it opens a CUDA context on each visible GPU (or --gpus N), then for each phase
reads every thread's run time, voluntary/involuntary context switches and wait channel from /proc over
--window-s seconds:
  idle     contexts open, no work queued;
  kernel   one long kernel (torch.cuda._sleep) running on each GPU, the host thread asleep;
  pinned   the same with a cudaHostRegister'ed buffer mapped into the device (as the ring is).
  python bench/driver_threads.py [--gpus N] [--window-s 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def snapshot() -> dict[int, dict]:
    out = {}
    for task in os.scandir("/proc/self/task"):
        p = Path(task.path)
        try:
            name = (p / "comm").read_text().strip()
            run_ns = int((p / "schedstat").read_text().split()[0])
            status = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
            wchan = (p / "wchan").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[int(task.name)] = {"name": name, "run_ns": run_ns, "wchan": wchan,
                               "vol": int(status["voluntary_ctxt_switches"]),
                               "invol": int(status["nonvoluntary_ctxt_switches"])}
    return out


def window(seconds: float) -> list[dict]:
    a = snapshot()
    time.sleep(seconds)
    b = snapshot()
    rows = []
    for tid, t in b.items():
        s = a.get(tid, {"run_ns": 0, "vol": 0, "invol": 0})
        rows.append({"tid": tid, "name": t["name"], "wchan": t["wchan"],
                     "cpu_ms_per_s": (t["run_ns"] - s["run_ns"]) / 1e6 / seconds,
                     "wakes_per_s": (t["vol"] - s["vol"]) / seconds,
                     "preempted_per_s": (t["invol"] - s["invol"]) / seconds})
    return sorted(rows, key=lambda r: -r["cpu_ms_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to open a context on (default: all visible)")
    ap.add_argument("--window-s", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    gpus = list(range(args.gpus if args.gpus is not None else torch.cuda.device_count()))
    for g in gpus:
        torch.ones(1, device=f"cuda:{g}")
        torch.cuda.synchronize(g)
    result = {"gpus": len(gpus), "torch": torch.__version__, "phases": {}}

    def busy(seconds: float) -> None:  # one kernel per GPU that spins for about `seconds`
        for g in gpus:
            with torch.cuda.device(g):
                torch.cuda._sleep(int(seconds * 1.98e9))  # cycles at Hopper's boost clock: about `seconds`

    result["phases"]["idle"] = window(args.window_s)
    busy(args.window_s * 3)
    time.sleep(0.2)
    result["phases"]["kernel"] = window(args.window_s)
    for g in gpus:
        torch.cuda.synchronize(g)
    pinned = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory() if gpus else None
    busy(args.window_s * 3)
    time.sleep(0.2)
    result["phases"]["pinned"] = window(args.window_s)
    for g in gpus:
        torch.cuda.synchronize(g)
    del pinned
    for phase, rows in result["phases"].items():
        total = sum(r["cpu_ms_per_s"] for r in rows)
        print(f"{phase}: {total:.3f} ms of CPU a second over {len(rows)} threads")
        for r in rows:
            if r["cpu_ms_per_s"] >= 0.01 or r["wakes_per_s"] >= 1:
                print(f"  {r['name']:<18} tid {r['tid']:<8} {r['cpu_ms_per_s']:7.3f} ms/s  {r['wakes_per_s']:8.1f} wakes/s "
                      f"{r['preempted_per_s']:6.1f} preempted/s  wchan {r['wchan']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
