"""bench/structured_compare.py: constrained over plain, the mask's gateway CPU per token, streams per core."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import structured_compare  # noqa: E402
from blink.bench.results import write_summary  # noqa: E402


def _run(tmp_path, name, tpot_ms, tok_s, gateway_s_per_tok, reasons, response_format=None, threads=None):
    doc = {"label": name, "response_format": response_format, "arrivals": {"rate": "inf", "max_concurrency": 16},
           "metrics": {"completed": sum(r != "error" for r in reasons), "num_requests": len(reasons),
                       "total_output_tokens": 128 * len(reasons),
                       "output_throughput_tok_s": tok_s,
                       "tpot_ms": {"mean": tpot_ms, "median": tpot_ms, "p99": tpot_ms * 1.5}},
           "server": {"gateway_cpu": {"available": True, "cpu_s_per_token": gateway_s_per_tok,
                                      **({"per_thread_cpu_s": threads, "generated_tokens": 128 * len(reasons)}
                                         if threads is not None else {})},
                      "cpu": {"available": False, "reason": "not available: no --backend-pid"}},
           "environment": {"gpus": ["NVIDIA H100"], "commit": "abc"}}
    requests = [{"finish_reason": r} if r != "error" else {"finish_reason": None, "error": "HTTP 500"} for r in reasons]
    return write_summary(tmp_path / f"{name}.json", doc, {"requests": requests})


def test_ratios_mask_cpu_and_streams_per_core(tmp_path, capsys):
    plain = _run(tmp_path, "plain", 10.0, 1600.0, 20e-6, ["length"] * 4)
    con = _run(tmp_path, "json", 10.2, 1568.0, 70e-6, ["length", "length", "length", "stop"],
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})
    out = tmp_path / "cmp.json"
    assert structured_compare.main(["--pair", str(plain), str(con), "--out", str(out)]) == 0
    [pair] = json.loads(out.read_text())["pairs"]
    assert pair["constrained_over_plain"]["tpot_mean_ms"] == pytest.approx(1.02)
    assert pair["constrained_over_plain"]["output_tok_s"] == pytest.approx(0.98)
    assert pair["tpot_mean_within_target"] is True
    assert pair["mask_gateway_cpu_us_per_token"] == pytest.approx(50.0)
    # a stream makes a token every 10.2 ms and costs 70 us of gateway CPU for each: 145.7 streams fill a core
    assert pair["constrained_streams_per_gateway_core"] == pytest.approx(10.2e-3 / 70e-6)
    assert pair["constrained"]["finish_reasons"] == {"length": 3, "stop": 1} and pair["constrained"]["constrained"]
    assert not pair["plain"]["constrained"] and pair["plain"]["backend_cpu_s_per_token"] is None
    table = capsys.readouterr().out
    assert "TPOT mean 1.020x" in table and "length:3 stop:1" in table and "50.0 us/token" in table


def test_a_failed_request_fails_the_comparison_and_missing_figures_show_as_dashes(tmp_path, capsys):
    plain = _run(tmp_path, "plain", 10.0, 1600.0, None, ["length", "error"])
    con = _run(tmp_path, "json", 12.0, 1500.0, 60e-6, ["length", "length"])
    assert structured_compare.main(["--pair", str(plain), str(con)]) == 1
    line = [x for x in capsys.readouterr().out.splitlines() if "constrained/plain" in x][0]
    assert "TPOT mean 1.200x" in line and "mask work on the gateway - us/token" in line


def test_the_mask_work_is_the_grammar_threads_cpu_where_the_run_recorded_threads(tmp_path, capsys):
    """The constrained run's gateway spent less in all than the plain one (its poller did not spin for watched
    streams): the difference says -30 us, the grammar threads' own CPU says what the masks cost."""
    plain = _run(tmp_path, "plain", 10.0, 1600.0, 100e-6, ["length"] * 4)
    threads = {"python3": 0.030, "grammar-mask_0": 0.0128, "grammar-mask_1": 0.0064, "grammar-watch": 0.0064,
               "grammar-slow": 0.0}
    con = _run(tmp_path, "json", 10.4, 1500.0, 70e-6, ["length"] * 4,
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, threads)
    out = tmp_path / "cmp.json"
    assert structured_compare.main(["--pair", str(plain), str(con), "--out", str(out)]) == 0
    [pair] = json.loads(out.read_text())["pairs"]
    assert pair["mask_from_threads"] is True
    assert pair["mask_gateway_cpu_us_per_token"] == pytest.approx(0.0256 / 512 * 1e6)  # 50 us a token
    assert pair["mask_work_streams_per_core"] == pytest.approx(10.4e-3 / 50e-6)
    assert pair["constrained_streams_per_gateway_core"] == pytest.approx(10.4e-3 / 70e-6)
    assert "50.0 us/token (its grammar threads: grammar-mask_0 25.0, grammar-mask_1 12.5, grammar-watch 12.5)" \
        in capsys.readouterr().out


def test_the_gpu_loops_step_per_run_from_the_serve_log(tmp_path, capsys):
    """--serve-log/--windows: each run gets the loop-statistics lines logged inside its window (after its first
    second), weighted by their steps; the pair gets constrained over plain for the step."""
    import time

    plain = _run(tmp_path, "plain", 7.8, 8000.0, 20e-6, ["length"] * 4)
    con = _run(tmp_path, "json", 8.2, 7600.0, 70e-6, ["length"] * 4)
    t0 = 1_800_000_000.0

    def line(at, steps, tokens, step_us, kernel_us, taken, dropped):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f",{int(at * 1000) % 1000:03d}"
        return (f"{stamp} blink.persistent INFO loop stats: {steps} steps, {tokens} tokens, back-to-back step "
                f"{step_us} us ({steps} steps), loop kernel {kernel_us} us a step, speculation taken {taken} dropped "
                f"{dropped}")
    log = tmp_path / "serve.log"
    log.write_text("\n".join([
        line(t0 + 0.5, 10, 300, 9000.0, 5000.0, 0, 0),          # the plain run's first second: left out
        line(t0 + 2.0, 100, 6400, 7000.0, 20.0, 90, 10),
        line(t0 + 3.0, 300, 19200, 8000.0, 20.0, 280, 20),      # weighted: (100 x 7 + 300 x 8) / 400 = 7.75 ms
        "2026-01-01 00:00:00,000 blink.gateway INFO something else",
        line(t0 + 5.5, 200, 12400, 8525.0, 62.0, 0, 0),         # the constrained run
    ]) + "\n")
    windows = tmp_path / "windows.tsv"
    windows.write_text(f"{plain}\t{t0}\t{t0 + 4.0}\n{con}\t{t0 + 4.0}\t{t0 + 6.0}\n")
    out = tmp_path / "cmp.json"
    assert structured_compare.main(["--pair", str(plain), str(con), "--out", str(out), "--serve-log", str(log),
                                    "--windows", str(windows)]) == 0
    [pair] = json.loads(out.read_text())["pairs"]
    p, c = pair["plain"]["loop"], pair["constrained"]["loop"]
    assert p["periods"] == 2 and p["steps"] == 400 and p["step_ms"] == pytest.approx(7.75)
    assert p["tokens_per_step"] == pytest.approx(64.0) and (p["spec_taken"], p["spec_dropped"]) == (370, 30)
    assert c["step_ms"] == pytest.approx(8.525) and c["tokens_per_step"] == pytest.approx(62.0)
    assert pair["constrained_over_plain"]["loop_step_ms"] == pytest.approx(8.525 / 7.75)
    assert "GPU loop a step" in capsys.readouterr().out


def test_no_serve_log_leaves_the_loop_figures_out(tmp_path, capsys):
    plain = _run(tmp_path, "plain", 7.8, 8000.0, 20e-6, ["length"] * 2)
    con = _run(tmp_path, "json", 8.2, 7600.0, 70e-6, ["length"] * 2)
    out = tmp_path / "cmp.json"
    assert structured_compare.main(["--pair", str(plain), str(con), "--out", str(out),
                                    "--serve-log", str(tmp_path / "missing.log")]) == 0
    [pair] = json.loads(out.read_text())["pairs"]
    assert pair["plain"]["loop"] is None and pair["constrained_over_plain"]["loop_step_ms"] is None
    assert "GPU loop" not in capsys.readouterr().out


def test_the_parser_reads_what_the_backend_logs(caplog):
    """The loop-statistics line as gpu_backend/engine/persistent.py's LoopStatsLog writes it (counters in a host
    LoopCtl, no GPU) is the line structured_compare.py parses: the producer and the parser cannot drift apart."""
    import logging

    from gpu_backend.engine.persistent import LoopStatsLog
    from kernels.persistent_loop import LoopCtl

    ctl = LoopCtl()
    stats = LoopStatsLog(ctl, 1e-9)
    ctl.steps, ctl.tokens, ctl.busy_ns, ctl.busy_steps = 140, 8960, 140 * 7_500_000, 140
    ctl.sched_ns, ctl.spec_hits, ctl.spec_misses, ctl.mask_waits = 140 * 20_000, 110, 30, 7
    with caplog.at_level(logging.INFO, logger="blink.persistent"):
        stats.maybe_log()
    formatter = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    [line] = structured_compare.loop_lines("\n".join(formatter.format(r) for r in caplog.records))
    assert (line["steps"], line["tokens"], line["busy_steps"]) == (140, 8960, 140)
    assert line["step_us"] == pytest.approx(7500.0) and line["loop_kernel_us"] == pytest.approx(20.0)
    assert (line["spec_taken"], line["spec_dropped"], line["mask_waits"]) == (110, 30, 7)
    # a log from before the counter: the line still parses, with no figure for it
    older = formatter.format(caplog.records[0]).replace(", mask waits 7", "")
    [line] = structured_compare.loop_lines(older)
    assert line["mask_waits"] is None and line["spec_dropped"] == 30


def test_the_loop_kernel_counts_only_back_to_back_periods():
    """A period with idle time in it (the loop kernel polling an empty ring) would add its polling to the kernel's
    time a step: such periods (under 90% busy steps) are left out of the loop kernel's figure, not of the rest, and
    the figure is the median of the others (one busy period with waiting in it does not move it)."""
    def period(at, steps, busy, kernel_us):
        return {"at": at, "steps": steps, "tokens": 60 * steps, "step_us": 8000.0, "busy_steps": busy,
                "loop_kernel_us": kernel_us, "spec_taken": 0, "spec_dropped": 0}
    lines = [period(2.0, 24, 19, 157320.1), period(3.0, 93, 92, 2982.0), period(4.0, 125, 125, 60.0),
             period(5.0, 121, 120, 64.0)]
    loop = structured_compare.loop_over(lines, 0.0, 6.0)
    assert loop["steps"] == 363 and loop["periods"] == 4
    assert loop["loop_kernel_us"] == pytest.approx(64.0)


def test_the_mask_stats_lines_are_read_as_the_gateway_writes_them(caplog, monkeypatch):
    """Each gateway worker's BLINK_MASK_STATS_S line (gateway/structured/mask_loop.py) is what structured_compare.py
    parses; a run's lines add up across workers and the largest maxima are kept."""
    import logging

    from gateway.structured import mask_loop

    clock = [50.0]
    monkeypatch.setattr(mask_loop.time, "monotonic", lambda: clock[0])
    stats = mask_loop.MaskStats(period_s=1.0)
    with caplog.at_level(logging.INFO, logger="blink.gateway.structured"):
        for steps in ((0.001, 0.0005, 0.0001), (0.0001, 0.0065, 0.0001)):
            stats.record(*steps)
        clock[0] = 51.5
        stats.maybe_log(", watching 8, the engine's step as seen here 7.90 ms")
    formatter = logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    text = "\n".join(formatter.format(r) for r in caplog.records)
    [line] = structured_compare.mask_lines(text)
    assert line["steps"] == 2 and (line["over_2ms"], line["over_5ms"]) == (1, 1)  # 6.7 ms: over both
    assert line["computed_ms_max"] == pytest.approx(6.5) and line["total_ms_max"] == pytest.approx(6.7, abs=0.01)
    other = dict(line, pid=line["pid"] + 1, steps=6, over_5ms=3, queued_ms_mean=0.2, computed_ms_max=9.0)
    summary = structured_compare.masks_over([line, other], line["at"] - 2.0, line["at"] + 1.0)
    assert summary["workers"] == 2 and summary["steps"] == 8 and summary["over_5ms"] == 4
    assert summary["over_5ms_most_in_a_line"] == 3 and summary["computed_ms_max"] == 9.0
    assert summary["queued_ms_mean"] == pytest.approx((2 * line["queued_ms_mean"] + 6 * 0.2) / 8)
    assert structured_compare.masks_over([line], line["at"] + 5, line["at"] + 9) is None  # outside the run
