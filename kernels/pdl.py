"""Programmatic dependent launch inside the decode kernels (on when `_common.pdl_on()`; each kernel takes a `PDL`
constexpr and its launch `**_common.pdl_launch()`). One place for the pattern every such kernel follows: wait for
the predecessor's writes before touching memory (`pdl_wait`), then let the successor launch (`pdl_release`);
`pdl_enter` does both at a kernel's top. With PDL false they compile to nothing."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_release(PDL)
