"""Constrained against plain decoding from `blink bench` result files (issue 24's measurements;
bench/device_structured.sh).

    python bench/structured_compare.py --pair PLAIN.json CONSTRAINED.json [--pair ...] [--out summary.json]
                                       [--serve-log SERVE.log --windows WINDOWS.tsv]

Each pair is one workload and concurrency run twice: plain, then with every request under a `response_format`.
For each run: TPOT mean/P50/P99, output tok/s, tokens per request, how requests ended (a constrained one ends
with `stop` when its JSON is complete, else `length`), the gateway's and the backend's CPU per token. Per pair:
constrained over plain for TPOT and throughput (the issue's target: TPOT at most 1.03x), the mask work per
constrained token (the CPU of the gateway's grammar threads, `grammar-*`, in every worker: `blink bench` records
the gateway tree's CPU by thread; older files without it: constrained minus plain gateway CPU, which the
poller's spinning for plain streams alone can drive below zero), and how many constrained streams one gateway
core sustains at the measured TPOT, with all their gateway work (which includes its idle polling, so it
understates at low token rates) and with their mask work alone.

With `--serve-log` (a persistent backend run with BLINK_LOOP_STATS_S, whose log has the GPU loop's counters every
few seconds) and `--windows` (lines `RESULT_FILE<TAB>start<TAB>end`, epoch seconds, written by
device_structured.sh around each run), each run also gets the GPU's own figures over its window: the mean time of
back-to-back steps, tokens per step, the loop kernel's time a step, speculations taken and dropped; the pair gets
constrained over plain for the step.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blink.bench.results import read_records  # noqa: E402

TPOT_TARGET_X = 1.03


def _cpu_per_token(doc: dict, name: str) -> float | None:
    figures = doc.get("server", {}).get(name) or {}
    return figures.get("cpu_s_per_token") if figures.get("available") else None


MASK_THREADS = "grammar-"  # the gateway's grammar threads: gateway/structured (mask pools, the mask watcher)


def _mask_threads_per_token(doc: dict) -> dict[str, float] | None:
    """CPU seconds per generated token of each of the gateway's grammar threads (every worker's): the mask pools
    (`grammar-mask`, `grammar-slow`: mask steps only) and the mask watcher (`grammar-watch`: its looks at the
    ring, which cost the more per token the slower tokens come, and the steps it runs inline). Apart from the
    poller's and the HTTP work, which the plain run has too. None where the run recorded no threads."""
    figures = doc.get("server", {}).get("gateway_cpu") or {}
    threads, tokens = figures.get("per_thread_cpu_s"), figures.get("generated_tokens")
    if not figures.get("available") or threads is None or not tokens:
        return None
    return {name: v / tokens for name, v in threads.items() if name.startswith(MASK_THREADS)}


def finish_reasons(path: Path) -> dict:
    """How the run's requests ended, from the records beside the summary (empty where they are gone)."""
    try:
        requests = read_records(path)["requests"]
    except (OSError, KeyError, ValueError):
        return {}
    return dict(collections.Counter(_ended(r) for r in requests))


def _ended(record: dict) -> str:
    return record.get("finish_reason") or ("error" if record.get("error") else "none")


def figures(path: Path) -> dict:
    """The figures of one run."""
    doc = json.loads(Path(path).read_text())
    m, mask_threads = doc["metrics"], _mask_threads_per_token(doc)
    return {"label": doc["label"], "file": Path(path).name, "constrained": bool(doc.get("response_format")),
            "concurrency": doc["arrivals"].get("max_concurrency"), "completed": m["completed"],
            "num_requests": m["num_requests"], "tokens_per_request": m["total_output_tokens"] / max(m["completed"], 1),
            "tpot_mean_ms": m["tpot_ms"]["mean"], "tpot_p50_ms": m["tpot_ms"]["median"],
            "tpot_p99_ms": m["tpot_ms"]["p99"], "output_tok_s": m["output_throughput_tok_s"],
            "gateway_cpu_s_per_token": _cpu_per_token(doc, "gateway_cpu"),
            "mask_threads_cpu_s_per_token": sum(mask_threads.values()) if mask_threads is not None else None,
            "mask_threads_by_name_s_per_token": mask_threads,
            "backend_cpu_s_per_token": _cpu_per_token(doc, "cpu"), "finish_reasons": finish_reasons(Path(path)),
            "gpus": doc.get("environment", {}).get("gpus"), "commit": doc.get("environment", {}).get("commit")}


# gpu_backend/engine/persistent.py, LoopStatsLog: the line each period, after the log's "%(asctime)s" (local time)
LOOP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*loop stats: (\d+) steps, (\d+) tokens, "
                       r"back-to-back step ([\d.]+) us \((\d+) steps\), loop kernel ([\d.]+) us a step, "
                       r"speculation taken (\d+) dropped (\d+)(?:, mask waits (\d+))?")


def _stamped(log_text: str, pattern: re.Pattern):
    """(time logged, match) of each line of a serve log that `pattern` matches (its groups 1 and 2: the log's
    "%(asctime)s", read as local time like the log's, to epoch seconds)."""
    for line in log_text.splitlines():
        if m := pattern.match(line):
            yield datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(m[2]) / 1e3, m


def loop_lines(log_text: str) -> list[dict]:
    """The loop-statistics lines of a serve log: the time each was logged (epoch seconds) and its figures."""
    return [{"at": at, "steps": int(m[3]), "tokens": int(m[4]), "step_us": float(m[5]), "busy_steps": int(m[6]),
             "loop_kernel_us": float(m[7]), "spec_taken": int(m[8]), "spec_dropped": int(m[9]),
             "mask_waits": int(m[10]) if m[10] else None} for at, m in _stamped(log_text, LOOP_LINE)]


# gateway/structured/mask_loop.py, MaskStats.maybe_log: each gateway worker's line (BLINK_MASK_STATS_S)
MASK_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*mask stats \(pid (\d+)\): (\d+) steps, queued "
                       r"mean ([\d.]+) max ([\d.]+) ms, computed mean ([\d.]+) max ([\d.]+) ms, put mean ([\d.]+) ms, "
                       r"longest ([\d.]+) ms, over 2 ms (\d+), over 5 ms (\d+)")


def mask_lines(log_text: str) -> list[dict]:
    """The gateway workers' mask-statistics lines of a serve log, timed as `loop_lines`."""
    return [{"at": at, "pid": int(m[3]), "steps": int(m[4]), "queued_ms_mean": float(m[5]),
             "queued_ms_max": float(m[6]), "computed_ms_mean": float(m[7]), "computed_ms_max": float(m[8]),
             "put_ms_mean": float(m[9]), "total_ms_max": float(m[10]), "over_2ms": int(m[11]),
             "over_5ms": int(m[12])} for at, m in _stamped(log_text, MASK_LINE)]


def masks_over(lines: list[dict], start_s: float, end_s: float) -> dict | None:
    """The workers' mask steps over a run (lines logged after its first second up to its end): steps, means
    weighted by steps, the largest maxima, the counts over 2 and 5 ms, and the most over 5 ms in one worker's
    line (a stall in one worker, or spread over all?). None without any line."""
    inside = [x for x in lines if start_s + 1.0 < x["at"] <= end_s and x["steps"]]
    steps = sum(x["steps"] for x in inside)
    if not steps:
        return None
    return {"lines": len(inside), "workers": len({x["pid"] for x in inside}), "steps": steps,
            **{k: sum(x[k] * x["steps"] for x in inside) / steps for k in ("queued_ms_mean", "computed_ms_mean")},
            **{k: max(x[k] for x in inside) for k in ("queued_ms_max", "computed_ms_max", "total_ms_max")},
            "over_2ms": sum(x["over_2ms"] for x in inside), "over_5ms": sum(x["over_5ms"] for x in inside),
            "over_5ms_most_in_a_line": max(x["over_5ms"] for x in inside)}


def loop_over(lines: list[dict], start_s: float, end_s: float) -> dict | None:
    """The loop's figures over a run: lines logged after its first second (each covers the period before it) up to
    its end, weighted by their steps; None without any. The loop kernel's time is the median over the periods whose
    steps ran back to back (at least 90% busy): its counter includes the kernel's polling of an empty ring or of
    rows waiting for input, so one period with waiting in it (seen: 157 ms and 3 ms a step in a run's first,
    mostly idle, seconds) would outweigh a run's steady steps."""
    inside = [x for x in lines if start_s + 1.0 < x["at"] <= end_s and x["steps"]]
    steps, busy = sum(x["steps"] for x in inside), sum(x["busy_steps"] for x in inside)
    if not steps or not busy:
        return None
    full = [x for x in inside if x["busy_steps"] >= 0.9 * x["steps"]] or inside
    return {"periods": len(inside), "steps": steps, "tokens_per_step": sum(x["tokens"] for x in inside) / steps,
            "step_ms": sum(x["step_us"] * x["busy_steps"] for x in inside) / busy / 1e3,
            "loop_kernel_us": statistics.median(x["loop_kernel_us"] for x in full),
            "spec_taken": sum(x["spec_taken"] for x in inside), "spec_dropped": sum(x["spec_dropped"] for x in inside),
            # rows that sampled nothing for a late mask, a share of the rows the steps computed (older logs: None)
            "mask_waits": None if any(x.get("mask_waits") is None for x in inside)
            else sum(x["mask_waits"] for x in inside)}


def read_windows(path: Path) -> dict[str, tuple[float, float]]:
    """RESULT_FILE<TAB>start<TAB>end lines -> {result file name: (start, end)}."""
    windows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            name, start, end = line.split("\t")
            windows[Path(name).name] = (float(start), float(end))
    return windows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(plain: dict, constrained: dict) -> dict:
    """Constrained over plain, the mask's gateway CPU per token, and streams per gateway core."""
    gw_plain, gw_con = plain["gateway_cpu_s_per_token"], constrained["gateway_cpu_s_per_token"]
    # the grammar threads' own CPU per token where the run recorded threads; else constrained minus plain (which
    # the poller's spinning for plain streams, not for constrained ones, can drive below zero)
    mask_s = constrained.get("mask_threads_cpu_s_per_token")
    if mask_s is None and gw_plain is not None and gw_con is not None:
        mask_s = gw_con - gw_plain
    mask_cpu_us = mask_s * 1e6 if mask_s is not None else None
    tpot_s = (constrained["tpot_mean_ms"] or 0) / 1000
    # one stream costs gw_con / tpot_s core-seconds a second, everything counted (the HTTP and polling work too);
    # its mask work alone mask_s / tpot_s
    streams = tpot_s / gw_con if gw_con and tpot_s else None
    mask_streams = tpot_s / mask_s if mask_s and mask_s > 0 and tpot_s else None
    keys = ("tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "output_tok_s")
    ratios = {k: _ratio(constrained[k], plain[k]) for k in keys}
    loops = plain.get("loop"), constrained.get("loop")
    ratios["loop_step_ms"] = _ratio(loops[1]["step_ms"], loops[0]["step_ms"]) if all(loops) else None
    return {"concurrency": plain["concurrency"], "plain": plain, "constrained": constrained,
            "constrained_over_plain": ratios, "tpot_mean_within_target": ratios["tpot_mean_ms"] is not None
            and ratios["tpot_mean_ms"] <= TPOT_TARGET_X, "mask_gateway_cpu_us_per_token": mask_cpu_us,
            "mask_from_threads": constrained.get("mask_threads_cpu_s_per_token") is not None,
            "constrained_streams_per_gateway_core": streams, "mask_work_streams_per_core": mask_streams}


COLUMNS = [("label", 28), ("conc", 5), ("ok/n", 8), ("tok/req", 8), ("TPOT mean", 10), ("TPOT p50", 9),
           ("TPOT p99", 9), ("tok/s", 9), ("gw us/tok", 10), ("be us/tok", 10), ("ended", 20)]


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _us(seconds: float | None) -> str:
    return _fmt(seconds * 1e6 if seconds is not None else None)


def row(f: dict) -> list[str]:
    ended = " ".join(f"{k}:{v}" for k, v in sorted(f["finish_reasons"].items())) or "-"
    return [f["label"], str(f["concurrency"] or "-"), f"{f['completed']}/{f['num_requests']}",
            _fmt(f["tokens_per_request"]), _fmt(f["tpot_mean_ms"], 2), _fmt(f["tpot_p50_ms"], 2),
            _fmt(f["tpot_p99_ms"], 2), _fmt(f["output_tok_s"]), _us(f["gateway_cpu_s_per_token"]),
            _us(f["backend_cpu_s_per_token"]), ended]


def ratio_line(pair: dict) -> str:
    r = pair["constrained_over_plain"]
    return (f"  constrained/plain at concurrency {pair['concurrency']}: TPOT mean {_fmt(r['tpot_mean_ms'], 3)}x "
            f"(target <= {TPOT_TARGET_X}x), P50 {_fmt(r['tpot_p50_ms'], 3)}x, P99 {_fmt(r['tpot_p99_ms'], 3)}x, "
            f"tok/s {_fmt(r['output_tok_s'], 3)}x; mask work on the gateway "
            f"{_fmt(pair['mask_gateway_cpu_us_per_token'])} us/token "
            f"({_mask_source(pair)}); "
            f"{_fmt(pair['constrained_streams_per_gateway_core'], 0)} constrained streams per gateway core at this "
            f"TPOT with all their gateway work, {_fmt(pair['mask_work_streams_per_core'], 0)} with their mask work")


def loop_line(pair: dict) -> str | None:
    """The GPU loop's own figures of both runs, where the serve log had them."""
    plain, con = pair["plain"].get("loop"), pair["constrained"].get("loop")
    if not plain or not con:
        return None

    def one(x: dict) -> str:
        spec = x["spec_taken"] + x["spec_dropped"]
        waits = "" if x.get("mask_waits") is None else (
            f", rows waiting for a mask {x['mask_waits']} ({100 * x['mask_waits'] / max(x['steps'] * x['tokens_per_step'] + x['mask_waits'], 1):.2f}% of the rows)")
        return (f"{x['step_ms']:.3f} ms at {x['tokens_per_step']:.1f} tokens, loop kernel {x['loop_kernel_us']:.1f} us, "
                f"speculation taken {x['spec_taken']}/{spec}{waits}")
    return (f"  GPU loop a step (BLINK_LOOP_STATS_S): plain {one(plain)}; constrained {one(con)}; constrained/plain "
            f"{_fmt(pair['constrained_over_plain']['loop_step_ms'], 3)}x")


def _mask_source(pair: dict) -> str:
    by_name = pair["constrained"].get("mask_threads_by_name_s_per_token")
    if not pair["mask_from_threads"] or by_name is None:
        return "constrained minus plain"
    return "its grammar threads: " + ", ".join(f"{n} {v * 1e6:.1f}" for n, v in sorted(by_name.items()) if v) or "-"


def table(pairs: list[dict]) -> str:
    lines = ["  ".join(name.rjust(width) for name, width in COLUMNS)]
    for pair in pairs:
        for f in (pair["plain"], pair["constrained"]):
            lines.append("  ".join(v.rjust(width) for v, (_, width) in zip(row(f), COLUMNS)))
        lines.append(ratio_line(pair))
        if (loop := loop_line(pair)) is not None:
            lines.append(loop)
        if (m := pair["constrained"].get("mask_steps")) is not None:
            lines.append(f"  gateway mask steps (BLINK_MASK_STATS_S, {m['workers']} workers): {m['steps']}, queued mean "
                         f"{m['queued_ms_mean']:.2f} max {m['queued_ms_max']:.2f} ms, computed mean "
                         f"{m['computed_ms_mean']:.2f} max {m['computed_ms_max']:.2f} ms, longest "
                         f"{m['total_ms_max']:.2f} ms; over 2 ms {m['over_2ms']}, over 5 ms {m['over_5ms']} (most in "
                         f"one worker's second: {m['over_5ms_most_in_a_line']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", nargs=2, action="append", required=True, metavar=("PLAIN", "CONSTRAINED"),
                   help="result files of one workload, plain and constrained")
    p.add_argument("--out", default=None, help="write the comparison as JSON here")
    p.add_argument("--serve-log", default=None, help="the backend's log with BLINK_LOOP_STATS_S lines")
    p.add_argument("--windows", default=None, help="RESULT_FILE<TAB>start<TAB>end lines (epoch seconds)")
    args = p.parse_args(argv)
    log_text = Path(args.serve_log).read_text() if args.serve_log and Path(args.serve_log).exists() else ""
    lines, masks = loop_lines(log_text), mask_lines(log_text)
    windows = read_windows(Path(args.windows)) if args.windows and Path(args.windows).exists() else {}

    def run(path: str) -> dict:
        f = figures(Path(path))
        window = windows.get(Path(path).name)
        f["loop"] = loop_over(lines, *window) if window and lines else None
        f["mask_steps"] = masks_over(masks, *window) if window and masks else None
        return f
    pairs = [compare(run(a), run(b)) for a, b in args.pair]
    print(table(pairs), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"pairs": pairs, "tpot_target_x": TPOT_TARGET_X}, indent=1))
    failed = any(p[k]["completed"] < p[k]["num_requests"] for p in pairs for k in ("plain", "constrained"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
