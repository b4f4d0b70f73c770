"""Result files and the table. A run writes a summary JSON (environment, workload, arrivals, every figure),
which is what `bench/results/` keeps in git, and its per-request records beside it in `<name>.records.json.gz`,
which `.gitignore` keeps out (they were 99.9% of the folder's bytes)."""
from __future__ import annotations

import gzip
import json
import math
import os
import platform
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit(short: bool = False) -> str | None:
    """BLINK_COMMIT (a tree copied to a GPU host travels without .git), else `git rev-parse HEAD`.
    Every benchmark stamps its results with this."""
    if os.environ.get("BLINK_COMMIT"):
        return os.environ["BLINK_COMMIT"]
    cmd = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
            return {"gpus": [n.decode() if isinstance(n, bytes) else n for n in names],
                    "driver": _str(pynvml.nvmlSystemGetDriverVersion())}
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no package, no driver or no GPU
        return {"gpus": [], "gpu_reason": f"not available: {type(exc).__name__}: {exc}"}


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def environment() -> dict:
    """Where and with what a run was measured (BENCH.md "Recording")."""
    return {"commit": commit(), "host": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "torch": _version("torch"),
            "aiohttp": _version("aiohttp"), **_gpus(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


RECORDS_SUFFIX = ".records.json.gz"


def records_path(summary: str | Path) -> Path:
    """Where the per-request records of the summary at `summary` (`NAME.json`) go: `NAME.records.json.gz`."""
    summary = Path(summary)
    return summary.with_name(summary.name.removesuffix(".json") + RECORDS_SUFFIX)


def bench_out(default: str | Path) -> Path:
    """The folder a benchmark writes into: $OUT when set (the device machine's folder that comes back), else
    `default` (its --out)."""
    return Path(os.environ.get("OUT") or default)


def write_summary(path: str | Path, doc: dict, records: dict | None = None) -> Path:
    """Write `doc` at `path` and, when given, `records` (per-request lists) gzipped beside it; the summary
    names the records file and says how many entries each list had, so a reader knows what is left out."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if records:
        side = records_path(path)
        with gzip.open(side, "wt") as f:
            json.dump(records, f, default=str)
        doc = {**doc, "records_file": side.name, "num_records": {k: len(v) for k, v in records.items()}}
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def read_records(summary: str | Path) -> dict:
    """The per-request records written beside a summary by `write_summary`."""
    with gzip.open(records_path(summary), "rt") as f:
        return json.load(f)


def write_run(out_dir: str | Path, doc: dict) -> Path:
    """Write one run's summary (the name says system, workload, rate and interference); its `requests`
    records go to the git-ignored file beside it."""
    interfered = doc.get("interference") or {}
    tag = f"i{interfered['threads']}" if interfered else "iso"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"{doc['label']}_{doc['workload']['name']}_r{doc['arrivals']['rate']}_{tag}_{stamp}_{os.getpid()}.json"
    summary = {k: v for k, v in doc.items() if k != "requests"}
    return write_summary(Path(out_dir) / name.replace("/", "-"), summary, {"requests": doc.get("requests", [])})


COLUMNS = [("rate", 6), ("ok/n", 8), ("dur s", 7), ("tok/s", 9), ("req/s", 7), ("good/s", 7),
           ("TTFT mean", 10), ("TTFT p99", 9), ("TPOT mean", 10), ("TPOT p99", 9), ("ITL p99", 8),
           ("E2EL p99", 9), ("queue p99", 10), ("cpu ms/tok", 11), ("mJ/tok", 8), ("GB/s", 8)]


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_row(doc: dict) -> list[str]:
    m, server = doc["metrics"], doc.get("server", {})
    cpu = server.get("cpu", {}).get("cpu_s_per_token")
    energy = server.get("nvml", {}).get("energy_mj_per_token")
    good = (m.get("goodput") or {}).get("goodput_req_s")
    gbps = server.get("roofline", {}).get("achieved_gbps")
    return [rate_name(float(doc["arrivals"]["rate"])), f"{m['completed']}/{m['num_requests']}", _fmt(m["duration_s"], 2),
            _fmt(m["output_throughput_tok_s"]), _fmt(m["request_throughput_req_s"], 2), _fmt(good, 2),
            _fmt(m["ttft_ms"]["mean"]), _fmt(m["ttft_ms"]["p99"]), _fmt(m["tpot_ms"]["mean"]),
            _fmt(m["tpot_ms"]["p99"]), _fmt(m["itl_ms"]["p99"]), _fmt(m["e2el_ms"]["p99"]),
            _fmt(m["queue_ms"]["p99"]), _fmt(cpu * 1000 if cpu is not None else None, 2), _fmt(energy, 1),
            _fmt(gbps, 1)]


def format_table(docs: list[dict]) -> str:
    """One row per run (rate); times in ms."""
    lines = ["  ".join(name.rjust(width) for name, width in COLUMNS)]
    for doc in docs:
        lines.append("  ".join(v.rjust(width) for v, (_, width) in zip(summary_row(doc), COLUMNS)))
    return "\n".join(lines)
