"""bench/pdl_probe.py's chain: small kernels shaped like a batch-1 decode step's, with and without programmatic
dependent launch (PDL). Needs Triton (>= 3.4: `launch_pdl`, `tl.extra.cuda.gdc_*`).

One hidden state h ([4096] bf16, gpu) goes through `num_links` kernels, alternating a row RMSNorm (h -> xn) and
a GEMV of a [1024, 4096] weight of its own (xn -> one quarter of h, the quarters in turn), so each kernel reads
the previous one's output and every GEMV streams 8 MiB that no other link reads (no L2 reuse, as in a step).
The variants launch the same arithmetic four ways:
  plain       ordinary launches;
  wait        `launch_pdl=True` and `gdc_wait()` before the kernel's first load;
  wait_early  that, and `gdc_launch_dependents()` after the kernel's loads (the next kernel may start early);
  prefetch    wait_early with each kernel's first weight tile loaded before its `gdc_wait()` (weights are
              never written, so only the activations need the predecessor): whether a GEMV's weight stream
              can start under the previous kernel's tail.
Every variant runs the same instructions in the same order apart from the gdc ones and where that first load
sits, so their outputs must agree bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

VARIANTS = ("plain", "wait", "wait_early", "prefetch")
# variant -> (launch_pdl, WAIT, EARLY, PREFETCH)
_LAUNCH = {"plain": (False, False, False, False), "wait": (True, True, False, False),
           "wait_early": (True, True, True, False), "prefetch": (True, True, True, True)}
HIDDEN, GEMV_ROWS = 4096, 1024
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 8, 512, 4  # kernels/gemv.py's DEFAULT_CONFIG
NORM_WARPS = 8


@triton.jit
def _norm_kernel(h_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, WAIT: tl.constexpr, EARLY: tl.constexpr,
                 PREFETCH: tl.constexpr):
    cols = tl.arange(0, N)
    if WAIT and not PREFETCH:
        gdc_wait()
    w = tl.load(w_ptr + cols).to(tl.float32)
    if WAIT and PREFETCH:
        gdc_wait()
    x = tl.load(h_ptr + cols).to(tl.float32)
    if EARLY:
        gdc_launch_dependents()
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(out_ptr + cols, (x * r * w).to(out_ptr.dtype.element_ty))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WAIT: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptr = w_ptr + rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_K)
    if WAIT and not PREFETCH:
        gdc_wait()
    w = tl.load(row_ptr + cols[None, :])  # the first tile, peeled in every variant: the same sums in each
    if WAIT and PREFETCH:
        gdc_wait()
    x = tl.load(x_ptr + cols)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(row_ptr + cols[None, :])
        x = tl.load(x_ptr + cols)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if EARLY:
        gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


def norm(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, variant: str, eps: float = 1e-5) -> None:
    """out = rmsnorm(h) * weight; all [HIDDEN] bf16, contiguous."""
    pdl, wait, early, prefetch = _LAUNCH[variant]
    _norm_kernel[(1,)](h, weight, out, eps, N=h.numel(), WAIT=wait, EARLY=early, PREFETCH=prefetch,
                       num_warps=NORM_WARPS, launch_pdl=pdl)


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, variant: str) -> None:
    """out = weight @ x; x [K], weight [N, K], out [N], bf16, contiguous (N a multiple of GEMV_BLOCK_N)."""
    pdl, wait, early, prefetch = _LAUNCH[variant]
    n, k = weight.shape
    _gemv_kernel[(n // GEMV_BLOCK_N,)](x, weight, out, K=k, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K,
                                       WAIT=wait, EARLY=early, PREFETCH=prefetch, num_warps=GEMV_WARPS,
                                       launch_pdl=pdl)


class Chain:
    """The kernels and their tensors: h, xn [HIDDEN] bf16; one norm weight [HIDDEN] per norm link and one GEMV
    weight [GEMV_ROWS, HIDDEN] per GEMV link (8 MiB each), all on `device`."""

    def __init__(self, num_links: int, device: str = "cuda", seed: int = 0):
        gen = torch.Generator(device).manual_seed(seed)
        bf = dict(device=device, dtype=torch.bfloat16)
        self.num_links = num_links
        self.h0 = torch.randn(HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        self.h, self.xn = self.h0.clone(), torch.empty(HIDDEN, **bf)
        self.norm_w = (0.5 + torch.rand((num_links + 1) // 2, HIDDEN, generator=gen, device=device)).to(torch.bfloat16)
        self.gemv_w = torch.empty(num_links // 2, GEMV_ROWS, HIDDEN, **bf)
        for w in self.gemv_w:  # one at a time: no float32 copy of every weight at once
            w.copy_(torch.randn(GEMV_ROWS, HIDDEN, generator=gen, device=device) * HIDDEN ** -0.5)

    def reset(self) -> None:
        self.h.copy_(self.h0)

    def run(self, variant: str) -> None:
        """Launch the chain once on the current stream (capturable)."""
        quarters = HIDDEN // GEMV_ROWS
        for i in range(self.num_links):
            if i % 2 == 0:
                norm(self.h, self.norm_w[i // 2], self.xn, variant)
            else:
                q = (i // 2) % quarters
                gemv(self.xn, self.gemv_w[i // 2], self.h[q * GEMV_ROWS:(q + 1) * GEMV_ROWS], variant)

    def reference(self) -> torch.Tensor:
        """h after the first two links, in float32 torch (checks the kernels' arithmetic, not PDL)."""
        x = self.h0.float()
        xn = (x * torch.rsqrt(x.pow(2).mean() + 1e-5) * self.norm_w[0].float()).to(torch.bfloat16)
        h = x.clone()
        h[:GEMV_ROWS] = self.gemv_w[0].float() @ xn.float()
        return h
