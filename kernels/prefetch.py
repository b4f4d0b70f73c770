"""Weights into L2 ahead of the kernel that reads them (Triton): `l2_prefetch`.

A one-token step is a chain of short kernels, and between the weight-streaming GEMVs it runs kernels that read
almost nothing (the attention over a short context, ~0.8 MB a layer): HBM idles there for several microseconds a
layer. `l2_prefetch(w)` issues `prefetch.global.L2` for every 128-byte line of w and returns at once (a prefetch
holds no register and nothing waits for it), so launched on a side stream beside the attention it pulls the next
projection's weights into L2 while HBM would idle, and that GEMV then reads them from L2. The kernel writes nothing;
results do not depend on it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import check

LINE = 128            # bytes a prefetch brings (an L2 line)
LINES = 1024          # lines a program prefetches: 128 KB, 8 a thread at 4 warps


@triton.jit
def _l2_prefetch_kernel(ptr, num_lines, LINE: tl.constexpr, LINES: tl.constexpr):
    """Program i: lines [i * LINES, (i + 1) * LINES) of the byte buffer at ptr (lines past the end: line 0)."""
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    addr = ptr + tl.where(line < num_lines, line, 0).to(tl.int64) * LINE
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


def l2_prefetch(w: torch.Tensor) -> None:
    """Ask L2 for every line of the contiguous CUDA tensor w (any dtype). Graph-capturable: the grid comes from w's
    size; nothing is read back. A hint: lines may be evicted before they are used, and a caller must not rely on it
    for anything but time."""
    check("w", w, device=w.device)
    if not w.is_contiguous():
        raise ValueError("l2_prefetch: w must be contiguous")
    if w.numel() == 0 or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return  # the interpreter runs no inline PTX; a hint skipped changes nothing but time
    num_lines = triton.cdiv(w.numel() * w.element_size(), LINE)
    _l2_prefetch_kernel[(triton.cdiv(num_lines, LINES),)](w.view(torch.uint8).view(-1), num_lines, LINE=LINE,
                                                          LINES=LINES, num_warps=4)
