"""Which GEMM should `--quantization fp8-partial` run at each batch size? (issue 22, FP8 weights)

    python bench/fp8_gemm_probe.py [--m 1,8,16,32,64,128,256,512] [--out bench/results]

fp8-partial keeps the o and gate/up weights of Llama-3-8B in FP8 (one scale per row) with bf16 activations. At
batch 1 the FP8 GEMV wins (1.28x bf16 a step); at 256 the step is 17% slower than bf16 because
kernels/fp8_gemm.py's `_w8a16_kernel` loses to cuBLAS. This times, for o (N=4096, K=4096) and gate_up
(N=28672, K=4096) at each M:
  bf16        cuBLAS `F.linear` on the bf16 weight (the dequantized FP8 weight, so the outputs compare): the bar;
  today       `_w8a16_kernel` with its `config_for(m)` tiles (what gpu_ops.linear runs now);
  nk / swap   bench/fp8_gemm_kernels.py's weight-only kernel, FP8 tile loaded [BLOCK_N, BLOCK_K] as stored,
              activations (nk) or widened weight (swap) as the left tl.dot operand, split-K for few tokens:
              each row of `CANDIDATES` that applies to M;
  w8a8        per-token FP8 activations (kernels/fp8_quant.py) + `torch._scaled_mm` with row/column scales
              (what `--quantization fp8` runs): where weight-only cannot win;
  dequant     the bf16 weight written per call, then cuBLAS (models/fp8.py's fallback): the floor of doing
              nothing clever.
Each runs inside a CUDA graph (kernels/device_check.py's `time_us`), the weight copies rotated so that every
call reads bytes the 50 MB L2 does not hold. GB/s counts the weight bytes (FP8 + scales, or bf16) once;
TFLOP/s is 2 M N K / time. Each output is checked against float32 x @ the dequantized weight (w8a8: its
dequantized x) within bf16 rounding; the max error goes into the row; exit 1 when a variant misses.

The decision it feeds: per M, the path `gpu_ops.linear` takes for an fp8-partial weight: the fastest
weight-only kernel and its tiles where it beats bf16 cuBLAS, else dequantize-then-cuBLAS or (a scheme change)
W8A8. The `best` lines name the winner per (shape, M).

    python bench/fp8_gemm_probe.py --compile-check   # no GPU: every Triton variant compiled for sm_90
                                                     # (kernels/compile_check.py's stand-in driver):
                                                     # registers, spills, shared memory (limit 227 KB)
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from blink.bench.results import bench_out, commit, write_summary  # noqa: E402

SHAPES = {"o": (4096, 4096), "gate_up": (28672, 4096)}  # name -> (N, K), Llama-3-8B
M_VALUES = (1, 8, 16, 32, 64, 128, 256, 512)
L2_DEFEAT_BYTES = 256 << 20   # weight bytes in rotation per variant: ~5x the H100's 50 MB L2
SHARED_LIMIT_BYTES = 227 * 1024
# (tier, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K, SWAP)): M runs the smallest tier >= M
# (the largest beyond 512): a tile far taller than M spends the tensor cores on padding rows
CANDIDATES = (
    (16, (16, 64, 128, 4, 4, 1, False)), (16, (16, 32, 256, 4, 3, 1, False)), (16, (16, 64, 128, 4, 4, 4, False)),
    (16, (16, 64, 256, 4, 3, 1, True)), (16, (16, 128, 128, 4, 4, 1, True)), (16, (16, 64, 128, 4, 4, 4, True)),
    (64, (32, 64, 128, 4, 4, 1, False)), (64, (64, 64, 128, 4, 4, 1, False)), (64, (32, 128, 128, 4, 4, 1, True)),
    (64, (64, 64, 128, 4, 4, 2, True)), (64, (64, 128, 128, 4, 3, 1, True)),
    (512, (64, 128, 128, 4, 3, 1, False)), (512, (128, 128, 64, 8, 3, 1, False)),
    (512, (128, 128, 128, 8, 3, 1, False)), (512, (128, 256, 64, 8, 3, 1, False)),
    (512, (128, 128, 64, 8, 3, 1, True)), (512, (64, 128, 128, 4, 4, 1, True)),
    (512, (128, 256, 64, 8, 3, 1, True)),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)), help="token counts, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--compile-check", action="store_true", help="compile the Triton variants for sm_90 only")
    args = ap.parse_args(argv)
    try:
        args.m = [int(v) for v in args.m.split(",")]
    except ValueError:
        ap.error(f"--m must be comma-separated integers, got {args.m!r}")
    if any(m < 1 for m in args.m):
        ap.error(f"--m values must be >= 1, got {args.m}")
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    return args


def candidates_for(m: int) -> list[tuple]:
    """The CANDIDATES configs that run at m tokens."""
    tiers = sorted({tier for tier, _ in CANDIDATES})
    tier = next((t for t in tiers if m <= t), tiers[-1])
    return [cfg for t, cfg in CANDIDATES if t == tier]


def config_name(cfg: tuple) -> str:
    bm, bn, bk, warps, stages, split_k, _ = cfg
    return f"{bm}x{bn}x{bk} w{warps} s{stages}" + (f" k/{split_k}" if split_k > 1 else "")


def weight_bytes(variant: str, n: int, k: int) -> int:
    """Bytes of weight a call reads once: bf16 for cuBLAS bf16, FP8 values + float32 row scales otherwise."""
    return n * k * 2 if variant == "bf16" else n * k + n * 4


def copies_for(num_bytes: int) -> int:
    """Weight copies in rotation so that a graph's consecutive calls never find theirs in L2."""
    return max(2, math.ceil(L2_DEFEAT_BYTES / num_bytes))


def make_row(shape: str, m: int, variant: str, config: str, us: float, max_err: float, tol_ratio: float) -> dict:
    """One measurement with its rates: GB/s of weight bytes, TFLOP/s; ok when every element is within tolerance."""
    n, k = SHAPES[shape]
    return {"shape": shape, "m": m, "n": n, "k": k, "variant": variant, "config": config, "us": us,
            "weight_gbps": weight_bytes(variant, n, k) / us / 1e3, "tflops": 2 * m * n * k / us / 1e6,
            "max_abs_err": max_err, "err_over_tol": tol_ratio, "ok": tol_ratio <= 1.0, "error": None}


def error_row(shape: str, m: int, variant: str, config: str, error: str) -> dict:
    """A variant that could not run or be checked: kept in the table and the JSON with its error."""
    n, k = SHAPES[shape]
    return {"shape": shape, "m": m, "n": n, "k": k, "variant": variant, "config": config, "us": None,
            "weight_gbps": None, "tflops": None, "max_abs_err": None, "err_over_tol": None, "ok": False,
            "error": error}


def best_per_case(rows: list[dict]) -> list[dict]:
    """Per (shape, m): the fastest correct row of each family and the winner, with its speedup over bf16."""
    cases = {}
    for r in rows:
        cases.setdefault((r["shape"], r["m"]), []).append(r)
    out = []
    for (shape, m), group in cases.items():
        ok = [r for r in group if r["ok"]]
        fastest = lambda family: min((r for r in ok if r["variant"] in family), key=lambda r: r["us"], default=None)
        bf16, weight_only = fastest({"bf16"}), fastest({"today", "nk", "swap"})
        win = fastest({r["variant"] for r in ok})
        out.append({"shape": shape, "m": m, "winner": win and f"{win['variant']} {win['config']}".strip(),
                    "winner_us": win and win["us"], "bf16_us": bf16 and bf16["us"],
                    "weight_only": weight_only and f"{weight_only['variant']} {weight_only['config']}".strip(),
                    "weight_only_vs_bf16": bf16["us"] / weight_only["us"] if bf16 and weight_only else None})
    return out


def format_table(rows: list[dict], best: list[dict]) -> str:
    lines = [f"{'shape':<8} {'M':>4} {'variant':<7} {'config':<24} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8} "
             f"{'max err':>9}  ok"]
    for r in rows:
        head = f"{r['shape']:<8} {r['m']:>4} {r['variant']:<7} {r['config']:<24}"
        if r["us"] is None:
            lines.append(f"{head} {'-':>9} {'-':>7} {'-':>8} {'-':>9}  NO  {r['error']}")
            continue
        lines.append(f"{head} {r['us']:9.2f} {r['weight_gbps']:7.0f} {r['tflops']:8.1f} {r['max_abs_err']:9.2e}  "
                     f"{'yes' if r['ok'] else 'NO'}")
    for b in best:
        ratio = f"{b['weight_only_vs_bf16']:.2f}x bf16's speed" if b["weight_only_vs_bf16"] else "-"
        win = f"{b['winner']} ({b['winner_us']:.2f} us)" if b["winner"] else "none correct"
        lines.append(f"best {b['shape']:<8} M={b['m']:<4} {win}; fastest weight-only {b['weight_only']}: {ratio}")
    return "\n".join(lines)


def tolerance_ratio(out, ref) -> tuple[float, float]:
    """(max |out - ref|, max of |out - ref| / tol) with tol = 2^-7 (|ref| + rms(ref)): two bf16 roundings of
    the result and of the weight's per-row scale, plus float32 sums in another order."""
    err = (out.float() - ref).abs()
    tol = 2.0 ** -7 * (ref.abs() + ref.pow(2).mean().sqrt())
    return err.max().item(), (err / tol).max().item()


def _weights(n: int, k: int, seed: int):
    """(q [N, K] FP8, scale [N] float32, w [N, K] bf16 = the dequantized weight), gpu; values ~ N(0, 1/K)."""
    import torch

    from gpu_backend.models.fp8 import quantize_weight

    gen = torch.Generator("cuda").manual_seed(seed)
    fw = quantize_weight(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5, fp8_activations=False)
    return fw.q, fw.scale, fw.dequantize(torch.bfloat16)


def _variants(m: int) -> list[tuple[str, str, object]]:
    """(variant, config, fn(x, q, scale, w16) -> out [M, N] bf16) for every path timed at m tokens."""
    import torch
    import torch.nn.functional as F

    from fp8_gemm_kernels import w8_nk_mm
    from gpu_backend.models.fp8 import Fp8Weight, dequantize_rows
    from kernels.fp8_gemm import config_for, fp8_weight_only_mm
    from kernels.fp8_quant import quantize_tokens

    def w8a8(x, q, s, w):
        xq, xs = quantize_tokens(x)
        return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s[None, :], out_dtype=torch.bfloat16)

    bm, bn, bk, warps, stages = config_for(m)
    rows = [("bf16", "cuBLAS", lambda x, q, s, w: F.linear(x, w)),
            ("today", f"{bm}x{bn}x{bk} w{warps} s{stages}", lambda x, q, s, w: fp8_weight_only_mm(x, q, s)),
            ("w8a8", "quant+_scaled_mm", w8a8),
            ("dequant", "bf16 copy+cuBLAS", lambda x, q, s, w: F.linear(x, dequantize_rows(Fp8Weight(q, s), x.dtype)))]
    for cfg in candidates_for(m):
        rows.append(("swap" if cfg[6] else "nk", config_name(cfg), lambda x, q, s, w, c=cfg: w8_nk_mm(x, q, s, c)))
    return rows


def _reference(variant: str, x, w32):
    """float32 x @ w32^T (w32 = q * scale[:, None], float32); for w8a8, x as its per-token FP8 values times
    their scales."""
    from kernels.fp8_quant import quantize_tokens

    if variant == "w8a8":
        xq, xs = quantize_tokens(x)
        x = xq.float() * xs
    return x.float() @ w32.t()


def measure_shape(shape: str, ms: list[int]) -> list[dict]:
    """Every variant at every m for one shape: checked on copy 0, then timed over the rotated copies. A variant
    that raises (a shape _scaled_mm refuses, a launch error) is a row with the error, not the end of the run."""
    import torch

    n, k = SHAPES[shape]
    q, scale, w16 = _weights(n, k, seed=0)
    w32 = q.float() * scale[:, None]   # [N, K] float32, gpu: the reference weight
    fp8_copies = [(q, scale, None)] + [(q.clone(), scale.clone(), None) for _ in range(copies_for(n * k) - 1)]
    bf16_copies = [(None, None, w16)] + [(None, None, w16.clone()) for _ in range(copies_for(2 * n * k) - 1)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        for variant, config, fn in _variants(m):
            pool = itertools.cycle(bf16_copies if variant == "bf16" else fp8_copies)
            try:
                rows.append(_measure(shape, m, variant, config, fn, x, (q, scale, w16), w32, pool))
            except Exception as e:  # noqa: BLE001 (recorded in the row and the table)
                rows.append(error_row(shape, m, variant, config, f"{type(e).__name__}: {e}".splitlines()[0]))
            print(format_table(rows[-1:], []).splitlines()[-1], flush=True)
    return rows


def _measure(shape, m, variant, config, fn, x, weights, w32, pool) -> dict:
    from kernels.device_check import time_us

    if variant in ("bf16", "dequant"):  # these multiply the bf16-rounded weight: checked against it, so a
        w32 = weights[2].float()          # row flags a wrong product, not the weight's own rounding (H100 run)
    max_err, ratio = tolerance_ratio(fn(x, *weights), _reference(variant, x, w32))
    us = time_us(lambda: fn(x, *next(pool)))
    return make_row(shape, m, variant, config, us, max_err, ratio)


def _environment() -> dict:
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda_runtime": torch.version.cuda}


def compile_check(ms: list[int]) -> int:
    """Every Triton variant (today's kernel with config_for(m), each candidate, the split-K sum) compiled for
    sm_90 on CPU tensors; prints registers, spills and shared memory. Returns 1 when one spills or needs
    more than SHARED_LIMIT_BYTES."""
    import torch
    import triton
    from triton.compiler import ASTSource
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from fp8_gemm_kernels import w8_nk_mm
    from kernels import compile_check as cc
    from kernels.fp8_gemm import config_for, fp8_weight_only_mm

    bad, seen = [], set()

    def compile_only(self, key, signature, device, constexprs, options, attrs, warmup):
        shown = ",".join(f"{self.arg_names[i[0]]}={int(v)}" for i, v in constexprs.items()
                         if isinstance(v, (int, bool)) and self.arg_names[i[0]].isupper())
        ident = (self.__name__, shown, options.num_warps, options.num_stages)
        if ident in seen:
            return None
        seen.add(ident)
        compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=cc.TARGET,
                                  options=options.__dict__)
        regs, spills = cc._ptxas_usage(compiled.asm["ptx"])
        shared = compiled.metadata.shared
        ptx = compiled.asm["ptx"]
        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
        print(f"  {self.__name__:<18} w{options.num_warps} s{options.num_stages} {shown:<60} regs={regs:<4} "
              f"spill={spills:<4} shared={shared / 1024:6.1f} KB {mma}")
        if spills or shared > SHARED_LIMIT_BYTES:
            bad.append(ident)

    driver.set_active(cc._Sm90Driver())
    JITFunction._do_compile = compile_only
    k = 4096
    q, scale = torch.zeros(4096, k, dtype=torch.float8_e4m3fn), torch.zeros(4096)
    for m in ms:
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        print(f"M={m}: today {config_for(m)}")
        fp8_weight_only_mm(x, q, scale)
        for cfg in candidates_for(m):
            w8_nk_mm(x, q, scale, cfg)
    print(f"{len(seen)} kernels compiled; {len(bad)} spill or exceed {SHARED_LIMIT_BYTES // 1024} KB shared")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_check:
        return compile_check(args.m)
    rows = [r for shape in args.shapes for r in measure_shape(shape, args.m)]
    best = best_per_case(rows)
    print(format_table(rows, best), flush=True)
    result = {"bench": "fp8_gemm_probe", "commit": commit(short=True) or "unknown", **_environment(),
              "l2_defeat_bytes": L2_DEFEAT_BYTES, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "rows": rows, "best": best}
    path = write_summary(bench_out(args.out) / f"fp8_gemm_probe-{result['commit']}.json", result)
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
