"""Does programmatic dependent launch (PDL) shorten a graph of small kernels, the way our bucket graphs run them?
(issue 22, "batch 1 at the floor")

    python bench/pdl_probe.py [--links 300] [--reps 100] [--rounds 3] [--out bench/results]

A chain of `--links` kernels shaped like a batch-1 decode step's (bench/pdl_kernels.py: RMSNorm over 4096 bf16
and a GEMV of [1024, 4096], alternating, each reading the previous one's output) in four variants: plain
launches, `launch_pdl=True` with `gdc_wait()` first, that plus `gdc_launch_dependents()` after the loads, and
that with each kernel's first weight tile loaded before its wait. They must give the same output bit for bit
(checked after one replay of each graph from the same state).
Each variant is captured into a torch CUDA graph and timed (CUDA events, GPU time per chain) four ways:
  torch           `CUDAGraph.replay()` from the host (what host mode does);
  child           the graph as a child node of a plainly instantiated graph, host-launched (bench/pdl_probe.cu);
  devlaunch       the same instantiated with cudaGraphInstantiateFlagDeviceLaunch (as the persistent loop's
                  bucket graphs are), host-launched;
  relaunch        that plus a one-thread kernel after the child that tail-launches the graph again from the
                  device, `--reps` times (the persistent loop's mechanism without its work).
The PDL variants are also run with their programmatic edges made plain (`plain_edges`, column `flat`): whether
device launch accepts the edges, and what the kernels' gdc instructions cost without them. A refused
instantiation is a row with its CUDA error, not a crash. The figure is us per kernel (chain time / links), the
median over `--rounds` rounds (the variants alternate within a round), beside the difference from the plain
chain run the same way. Prints a table, writes a JSON file (commit, GPU, rows); exits 1 when the outputs differ
or the kernels miss the float32 reference.

    python bench/pdl_probe.py --compile-check    # no GPU: each kernel of each variant compiled for sm_90
                                                 # (kernels/compile_check.py's stand-in driver), with its
                                                 # registers, spills and where the gdc instructions sit
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from blink.bench.results import bench_out, commit, write_summary  # noqa: E402

# bench/pdl_kernels.py's, repeated here: importing that needs Triton (a test checks that they agree)
VARIANTS = ("plain", "wait", "wait_early", "prefetch")
MECHANISMS = {"torch": None, "child": 0, "devlaunch": 1, "relaunch": 2}  # name -> blink_pdl_time's mode
REFERENCE_TOLERANCE = 0.1  # |h| ~ 1-4 in bf16 (2^-8 relative): a wrong kernel is off by far more
STEPS = {3: "building the graph", 4: "instantiate/upload/launch", 5: "device relaunch stopped short"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=300, help="kernels in the chain (even: norm and GEMV pairs)")
    ap.add_argument("--reps", type=int, default=100, help="chains timed per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="measurements per row (median reported)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--compile-check", action="store_true", help="compile the kernels for sm_90 only (no GPU)")
    args = ap.parse_args(argv)
    if args.links < 2 or args.links % 2:
        ap.error(f"--links must be an even number >= 2, got {args.links}")
    if args.reps < 1 or args.rounds < 1:
        ap.error("--reps and --rounds must be >= 1")
    return args


def row_keys() -> list[tuple[str, str, bool]]:
    """(variant, mechanism, plain_edges) of every row, in table order; the plain chain has no edges to flatten
    and torch's replay cannot flatten them."""
    return [(v, m, pe) for v in VARIANTS for m in MECHANISMS for pe in (False, True)
            if not pe or (v != "plain" and m != "torch")]


def describe_error(code: int, name: str) -> str:
    """blink_pdl_time's code (1000 * step + CUDA error) in words."""
    step, err = divmod(code, 1000)
    return f"step {step} ({STEPS.get(step, '?')}): {name} ({err})" if err else f"step {step} ({STEPS.get(step, '?')})"


def summarize(samples: dict[tuple[str, str, bool], list[float | str]], num_links: int) -> list[dict]:
    """Rows from the measurements: per key, chain times in ns over the rounds or an error string. us_per_kernel
    is the median / num_links; vs_plain_us the difference from the plain chain run by the same mechanism."""
    rows = []
    for variant, mech, plain_edges in samples:
        values = samples[(variant, mech, plain_edges)]
        errors = [v for v in values if isinstance(v, str)]
        times = [v for v in values if not isinstance(v, str)]
        us = statistics.median(times) / 1e3 / num_links if times and not errors else None
        rows.append({"variant": variant, "mechanism": mech, "plain_edges": plain_edges, "us_per_kernel": us,
                     "chain_us": [t / 1e3 for t in times], "error": errors[0] if errors else None})
    base = {r["mechanism"]: r["us_per_kernel"] for r in rows if r["variant"] == "plain"}
    for r in rows:
        b = base.get(r["mechanism"])
        r["vs_plain_us"] = r["us_per_kernel"] - b if r["us_per_kernel"] is not None and b is not None else None
    return rows


def format_table(rows: list[dict], edges: dict[str, tuple[int, int]]) -> str:
    """The rows as a text table; `edges`: variant -> (plain, programmatic) edges in its captured graph."""
    lines = [f"{'variant':<11} {'edges pl/prog':>13} {'mechanism':<10} {'flat':<5} {'us/kernel':>9} "
             f"{'vs plain':>9}  error"]
    for r in rows:
        pl, prog = edges.get(r["variant"], (-1, -1))
        us = f"{r['us_per_kernel']:9.3f}" if r["us_per_kernel"] is not None else f"{'-':>9}"
        dv = f"{r['vs_plain_us']:+9.3f}" if r["vs_plain_us"] is not None else f"{'-':>9}"
        lines.append(f"{r['variant']:<11} {f'{pl}/{prog}':>13} {r['mechanism']:<10} "
                     f"{'yes' if r['plain_edges'] else 'no':<5} {us} {dv}  {r['error'] or ''}")
    return "\n".join(lines)


@functools.cache
def _lib() -> ctypes.CDLL:
    """bench/pdl_probe.cu, built with -rdc (device graph launch) and cached like the loop's library."""
    from kernels.persistent_loop import library_argv
    from kernels.sched_host import cached_build

    source = ROOT / "bench" / "pdl_probe.cu"
    header = ROOT / "kernels" / "csrc" / "include" / "blink_graph_measure.cuh"
    lib = ctypes.CDLL(str(cached_build("pdl_probe", (source, header), library_argv(source, "bench/pdl_probe.py"))))
    u32, p = ctypes.c_uint32, ctypes.c_void_p
    lib.blink_pdl_time.argtypes = [p, u32, u32, u32, ctypes.POINTER(ctypes.c_double)]
    lib.blink_pdl_time.restype = ctypes.c_int
    lib.blink_pdl_edges.argtypes, lib.blink_pdl_edges.restype = [p, p, p], ctypes.c_int
    lib.blink_pdl_versions.argtypes, lib.blink_pdl_versions.restype = [p, p], ctypes.c_int
    lib.blink_pdl_error_name.argtypes, lib.blink_pdl_error_name.restype = [ctypes.c_int], ctypes.c_char_p
    return lib


def _capture(chain, variant: str) -> torch.cuda.CUDAGraph:
    chain.run(variant)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        chain.run(variant)
    graph.instantiate()
    return graph


def _edges(graph: torch.cuda.CUDAGraph) -> tuple[int, int]:
    plain, prog = ctypes.c_uint64(), ctypes.c_uint64()
    err = _lib().blink_pdl_edges(graph.raw_cuda_graph(), ctypes.byref(plain), ctypes.byref(prog))
    if err:
        raise RuntimeError(f"cudaGraphGetEdges failed: {_lib().blink_pdl_error_name(err).decode()} ({err})")
    return plain.value, prog.value


def _replay_ns(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    from kernels.device_check import replay_ms

    return 1e6 * replay_ms(graph, reps)


def _versions() -> dict[str, int]:
    driver, runtime = ctypes.c_int(), ctypes.c_int()
    code = _lib().blink_pdl_versions(ctypes.byref(driver), ctypes.byref(runtime))
    return {"cuda_driver": driver.value, "cuda_runtime_probe": runtime.value} if code == 0 else {}


def measurement_order(keys: list[tuple[str, str, bool]], rounds: int) -> list[tuple[str, str, bool]]:
    """Every key `rounds` times: mechanism by mechanism (a device launch that breaks the context then loses
    only the rows after it), the variants alternating within each round (clock drift spreads over all)."""
    return [k for mech in MECHANISMS for _ in range(rounds) for k in keys if k[1] == mech]


def _measure(graph: torch.cuda.CUDAGraph, mech: str, plain_edges: bool, reps: int) -> float | str:
    """Chain time in ns, or the error in words."""
    try:
        if MECHANISMS[mech] is None:
            return _replay_ns(graph, reps)
        torch.cuda.synchronize()
    except RuntimeError as e:  # a context broken by an earlier row: recorded, the rows so far kept
        return f"torch: {e}".splitlines()[0]
    ns = ctypes.c_double()
    code = _lib().blink_pdl_time(graph.raw_cuda_graph(), reps, MECHANISMS[mech], int(plain_edges), ctypes.byref(ns))
    return describe_error(code, _lib().blink_pdl_error_name(code).decode()) if code else ns.value


def _same_output(chain, graphs: dict) -> tuple[bool, float]:
    """Whether every variant's graph, replayed once from the same state, leaves h and xn bit for bit equal; and
    the largest error of the first two links (eager, plain) against float32 torch."""
    outs = {}
    for variant, graph in graphs.items():
        chain.reset()
        graph.replay()
        torch.cuda.synchronize()
        outs[variant] = torch.cat([chain.h, chain.xn]).clone()
    first = outs[VARIANTS[0]]
    same = all(torch.equal(first, o) for o in outs.values())
    short = type(chain)(2, seed=1)
    short.run("plain")
    err = (short.h.float() - short.reference()).abs().max().item()
    return same, err


def _chain(num_links: int):
    from pdl_kernels import Chain  # needs Triton

    return Chain(num_links)


def _environment() -> dict:
    """What the figures depend on: GPU, torch, Triton, CUDA driver and runtimes."""
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda_runtime": torch.version.cuda, **_versions()}


def compile_check() -> int:
    """Each variant's kernels compiled for sm_90 with no GPU; prints registers, spills and the order of the gdc
    instructions among the global loads and stores (PTX). Returns 1 when a kernel spills."""
    import re

    import triton
    from triton.compiler import ASTSource
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kernels import compile_check as cc
    from pdl_kernels import Chain

    spilled = []

    def compile_only(self, key, signature, device, constexprs, options, attrs, warmup):
        compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=cc.TARGET,
                                  options=options.__dict__)
        regs, spills = cc._ptxas_usage(compiled.asm["ptx"])
        ops = re.findall(r"griddepcontrol\.\w+|ld\.global|st\.global", compiled.asm["ptx"])
        order = [op for i, op in enumerate(ops) if i == 0 or op != ops[i - 1]]
        print(f"  {self.__name__:<13} launch_pdl={int(compiled.metadata.launch_pdl)} regs={regs:<4} "
              f"spill={spills:<3} {' > '.join(order)}")
        spilled.append(spills)

    driver.set_active(cc._Sm90Driver())
    JITFunction._do_compile = compile_only
    chain = Chain(2, device="cpu")
    for variant in VARIANTS:
        print(variant)
        chain.run(variant)
    return 1 if any(spilled) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_check:
        return compile_check()
    chain = _chain(args.links)
    graphs = {v: _capture(chain, v) for v in VARIANTS}
    edges = {v: _edges(g) for v, g in graphs.items()}
    same, ref_err = _same_output(chain, graphs)
    print(f"outputs bit for bit equal across variants: {same}; first two links vs float32 torch: max |err| "
          f"{ref_err:.3g}; edges (plain/programmatic): {edges}", flush=True)
    keys = row_keys()
    samples: dict[tuple[str, str, bool], list[float | str]] = {k: [] for k in keys}
    for key in measurement_order(keys, args.rounds):
        samples[key].append(_measure(graphs[key[0]], key[1], key[2], args.reps))
    rows = summarize(samples, args.links)
    print(format_table(rows, edges), flush=True)
    result = {"bench": "pdl_probe", "commit": commit(short=True) or "unknown", **_environment(),
              "links": args.links, "reps": args.reps, "rounds": args.rounds, "same_output": same,
              "reference_max_abs_err": ref_err,
              "edges": {v: {"plain": p, "programmatic": q} for v, (p, q) in edges.items()},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    path = write_summary(bench_out(args.out) / f"pdl_probe-{result['commit']}.json", result)
    print(f"wrote {path}")
    return 0 if same and ref_err < REFERENCE_TOLERANCE else 1

if __name__ == "__main__":
    sys.exit(main())
