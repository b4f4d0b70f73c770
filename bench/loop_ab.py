"""A/B of two builds of the GPU-resident loop's graphs on one runner, alternated, with the bare replay between.

    python bench/loop_ab.py --env BLINK_LOOP_SIDE_ROOT=1 [--batches 1,64] [--rounds 4] [--out bench/results]

The whole-step comparison of `bench/gpu_host.py` moves by +-10-25 us between runs (clocks, context), more than
the changes it has to judge. Here the two variants ("a": the environment as it is, "b": with `--env` set, read
by `blink_loop_create`) run in turn on the same runner and shapes, `--rounds` times each, and each round
also replays the bare graph at the loop's context; the figure is each variant's median of (loop step - bare
replay of its round). Each round also replays the bare graph instantiated as the loop's bucket graphs are (a
child node, device-launchable, node priorities honoured; `over_bare_inst_us`), launched from the host: what
is left over that one is the loop's own work, not how its graphs are instantiated. Without --stamps, each
round also replays it with that instantiation's parts one at a time, and relaunched from the device without the
loop's work (`MECHANISMS`), and repeated by a conditional WHILE node (`WHILE_MODES`, the loop's other
mechanism): which part of the difference belongs to which. Prints a table, writes a JSON file.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from blink.bench.results import bench_out, commit, write_summary  # noqa: E402
from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig  # noqa: E402
from gpu_backend.models import load_model  # noqa: E402
from gpu_host import bare_replay_ms, decode_batch, mechanism_replay_ms, persistent_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, help="NAME=VALUE set for variant b only")
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stamps", action="store_true",
                    help="both variants and the instantiated bare replay with stamp kernels (BLINK_LOOP_STAMPS=1): "
                         "where in the step the loop's graph runs slower than the bare one")
    args = ap.parse_args()
    name, _, value = args.env.partition("=")
    cfg, model, _ = load_model(args.model, device="cuda")
    runner = GpuRunner(model, cfg, GpuRunnerConfig(max_num_batched_tokens=512, max_num_seqs=256, context_len=4096),
                       keep_graphs=True)
    if args.stamps:
        os.environ["BLINK_LOOP_STAMPS"] = "1"
    rows = []
    for bsz in map(int, args.batches.split(",")):
        bucket = min(b for b in runner.buckets if b >= bsz)  # a decode step of bsz sequences: bsz tokens
        runs: dict[str, list[dict]] = {"a": [], "b": []}
        for _ in range(args.rounds):
            for variant in ("a", "b"):
                if variant == "b":
                    os.environ[name] = value
                else:
                    os.environ.pop(name, None)
                stamps: dict[str, list[float]] = {}
                pers = persistent_engine(runner, cfg, bsz, args.prompt_len, args.decode_steps,
                                         window=(lambda on: _stamps(bucket, on, stamps, "loop")) if args.stamps else None)
                batch = decode_batch(runner, bsz, pers["ctx_len_mid"])
                bare = bare_replay_ms(runner, batch, 100)
                if args.stamps:
                    _stamps(bucket, True, stamps, "bare_inst")
                bare_inst = mechanism_replay_ms(runner, batch, 100, mode=1,  # instantiated as the loop's graphs
                                                stamp_bucket=bucket if args.stamps else -1)
                if args.stamps:
                    _stamps(bucket, False, stamps, "bare_inst")
                # the loop's instantiation in parts, and its relaunch from the device without the loop's work
                parts = {} if args.stamps else {key: mechanism_replay_ms(runner, batch, 100, mode=mode)
                                                for key, mode in MECHANISMS.items()}
                if not args.stamps:
                    parts.update({key: while_replay_ms(runner, batch, 100, mode) for key, mode in WHILE_MODES.items()})
                runs[variant].append({"step_ms": pers["step_ms_mean"], "bare_ms": bare, "bare_inst_ms": bare_inst,
                                      **{f"{key}_ms": ms for key, ms in parts.items()},
                                      **{f"{key}_over_bare_us": 1e3 * (ms - bare) for key, ms in parts.items()},
                                      "over_bare_us": 1e3 * (pers["step_ms_mean"] - bare),
                                      "over_bare_inst_us": 1e3 * (pers["step_ms_mean"] - bare_inst),
                                      "gap_us": pers["gap_us"],
                                      "take_us": pers["sched_us_per_step"], "spec_us": pers["spec_us_per_step"],
                                      "spec_hits": pers["spec_hits"], "stamps_us": stamps,
                                      "spec_misses": pers["spec_misses"]})
        os.environ.pop(name, None)
        row = {"batch": bsz, "runs": runs}
        for variant in ("a", "b"):
            row[f"{variant}_over_bare_us_median"] = statistics.median(r["over_bare_us"] for r in runs[variant])
            row[f"{variant}_over_bare_inst_us_median"] = statistics.median(r["over_bare_inst_us"] for r in runs[variant])
            row[f"{variant}_gap_us_median"] = statistics.median(r["gap_us"] for r in runs[variant])
            row[f"{variant}_spec_us_median"] = statistics.median(r["spec_us"] for r in runs[variant])
            for key in {**MECHANISMS, **WHILE_MODES} if not args.stamps else ():
                row[f"{variant}_{key}_over_bare_us_median"] = statistics.median(
                    r[f"{key}_over_bare_us"] for r in runs[variant])
        if args.stamps:  # per point: loop - instantiated bare, median over rounds, us
            for variant in ("a", "b"):
                for key in ("loop", "bare_inst"):
                    row[f"{variant}_{key}_sm_mhz"] = statistics.median(r["stamps_us"][f"{key}_sm_mhz"] for r in runs[variant])
                row[f"{variant}_stamp_excess_us"] = [
                    statistics.median(r["stamps_us"]["loop"][p] - r["stamps_us"]["bare_inst"][p] for r in runs[variant])
                    for p in range(1, len(runs[variant][0]["stamps_us"]["loop"]))]
        rows.append(row)
        each = {v: ", ".join("%+.1f" % r["over_bare_us"] for r in runs[v]) for v in runs}
        print(f"B={bsz:4d} a: over bare {row['a_over_bare_us_median']:+.1f} us ({each['a']}), gap "
              f"{row['a_gap_us_median']:.1f} us | b ({args.env}): over bare {row['b_over_bare_us_median']:+.1f} us "
              f"({each['b']}), gap {row['b_gap_us_median']:.1f} us | spec kernel "
              f"{row['a_spec_us_median']:.1f} / {row['b_spec_us_median']:.1f} us | over the bare replay instantiated "
              f"as the loop's graphs: a {row['a_over_bare_inst_us_median']:+.1f}, "
              f"b {row['b_over_bare_inst_us_median']:+.1f} us", flush=True)
        if not args.stamps:
            print("      the bare replay, instantiated or launched otherwise, minus the plain one (us, a's rounds / "
                  "b's): " + "; ".join(f"{key} {row[f'a_{key}_over_bare_us_median']:+.1f} / "
                                       f"{row[f'b_{key}_over_bare_us_median']:+.1f}" for key in {**MECHANISMS, **WHILE_MODES}),
                  flush=True)
        if args.stamps:
            for variant in ("a", "b"):
                print(f"      {variant}: loop - instantiated bare at points 1..7 (us from point 0): "
                      + ", ".join("%+.1f" % x for x in row[f"{variant}_stamp_excess_us"])
                      + f"; SM clock {row[f'{variant}_loop_sm_mhz']:.0f} MHz in the loop, "
                        f"{row[f'{variant}_bare_inst_sm_mhz']:.0f} MHz in the bare replay", flush=True)
    result = {"bench": "loop_ab", "commit": commit(short=True) or "unknown", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "model": args.model, "env_b": args.env, "rounds": args.rounds,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    path = write_summary(bench_out(args.out) / f"loop_ab-{name}-{result['commit']}.json", result)
    print(f"wrote {path}")


# `blink_loop_bench_mechanism` modes besides 1 (the bare replay instantiated as the loop's graphs), each the same
# bare replay: a child node in a plain graph (host launches); device-launchable only (host launches); relaunched
# from the device by a kernel after it (the loop's mechanism without its work), and that with node priorities.
MECHANISMS = {"child": 2, "devflag": 3, "device": 0, "device_prio": 4}


# bench/while_mechanism.cu's modes: the same bare replay repeated by a conditional WHILE node (host-launched
# once, nothing device-launchable), alone and with a SWITCH around the graph (the loop's shape before device
# graph launch).
WHILE_MODES = {"while": 0, "while_switch": 1, "while_plain": 2, "while_switch_plain": 3}


@functools.cache
def _while_lib() -> ctypes.CDLL:
    """bench/while_mechanism.cu, built once (without -rdc) and cached like the loop's library."""
    from kernels.persistent_loop import ARCH, nvcc
    from kernels.sched_host import cached_build

    source, include = ROOT / "bench" / "while_mechanism.cu", ROOT / "kernels" / "csrc" / "include"
    lib = ctypes.CDLL(str(cached_build("while_mechanism", (source, include / "blink_graph_measure.cuh"), [
        nvcc(), f"-arch={ARCH}", "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
        "-I", str(include), str(source)])))
    fn = lib.blink_bench_while
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_double)], ctypes.c_int
    return lib


def while_replay_ms(runner: GpuRunner, batch, reps: int, mode: int) -> float:
    from gpu_host import _graph_for

    graph = _graph_for(runner, batch)
    torch.cuda.synchronize()
    ns = ctypes.c_double()
    err = _while_lib().blink_bench_while(graph.raw_cuda_graph(), reps, mode, ctypes.byref(ns))
    if err:  # recorded as NaN: which graphs a conditional body refuses is a finding too
        print(f"bench/while_mechanism.cu mode {mode}: step {err // 1000} failed, CUDA error {err % 1000}", flush=True)
        return float("nan")
    return ns.value / 1e6


def _stamps(bucket: int, on: bool, into: dict, key: str) -> None:
    """Start counting the stamps of `bucket`'s graphs, or stop and keep the mean time from point 0 to each
    later point (us) in into[key] (its first entry: the steps counted) and the mean SM clock sampled at point 0
    (MHz) in into[key + "_sm_mhz"]."""
    from kernels import persistent_loop

    means = (ctypes.c_double * 9)()
    persistent_loop.check(persistent_loop.load(bench=True).blink_loop_stamps(bucket, int(on), means), "the stamps")
    if not on:
        into[key] = [means[0]] + [x / 1e3 for x in means[1:8]]
        into[f"{key}_sm_mhz"] = means[8]


if __name__ == "__main__":
    main()
