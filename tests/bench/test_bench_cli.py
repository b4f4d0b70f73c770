"""`blink bench` is wired into the `blink` command."""
from __future__ import annotations

from blink.cli import build_parser


def test_blink_bench_parses_runs_and_interfere():
    args = build_parser().parse_args(["bench", "--sweep", "1:8", "--max-concurrency", "4", "--workload", "batch1"])
    assert (args.command, args.bench_command, args.sweep, args.max_concurrency) == ("bench", None, "1:8", 4)
    args = build_parser().parse_args(["bench", "interfere", "--threads", "12", "--seconds", "30",
                                      "--gateway-cores", "14,15"])
    assert (args.bench_command, args.threads, args.seconds, args.gateway_cores) == ("interfere", 12, 30.0, "14,15")


def test_num_requests_beyond_the_default_size_builds_that_many():
    """--num-requests 2000 on the 1,000-request ShareGPT workload used to cut silently to 1,000."""
    from blink.bench.cli import build_workload

    args = build_parser().parse_args(["bench", "--workload", "sharegpt", "--num-requests", "1500"])
    assert len(build_workload(args).requests) == 1500
    args = build_parser().parse_args(["bench", "--workload", "sharegpt", "--num-requests", "10"])
    assert len(build_workload(args).requests) == 10


def test_main_called_in_process_gives_the_callers_signal_handlers_back():
    """A SIGTERM that raises KeyboardInterrupt must not outlive `blink bench` in a caller's process (a test run):
    a process the caller forks later would inherit it (pyroute2 forks per network namespace)."""
    import signal

    import pytest

    from blink.bench.cli import main

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit, match="cannot list models"):
        main(["--url", "http://127.0.0.1:9/v1", "--workload", "batch1"])
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
