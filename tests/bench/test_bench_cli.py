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
