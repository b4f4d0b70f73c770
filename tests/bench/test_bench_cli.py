"""`blink bench` is wired into the `blink` command."""
from __future__ import annotations

from blink.cli import build_parser


def test_blink_bench_parses_runs_and_interfere():
    args = build_parser().parse_args(["bench", "--sweep", "1:8", "--max-concurrency", "4", "--workload", "batch1"])
    assert (args.command, args.bench_command, args.sweep, args.max_concurrency) == ("bench", None, "1:8", 4)
    args = build_parser().parse_args(["bench", "interfere", "--threads", "12", "--seconds", "30",
                                      "--gateway-cores", "14,15"])
    assert (args.bench_command, args.threads, args.seconds, args.gateway_cores) == ("interfere", 12, 30.0, "14,15")
