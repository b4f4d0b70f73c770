"""Compile every kernel for an H100 (sm_90) on a machine with no GPU, and report registers and spills.

    python -m kernels.compile_check            # from the repo root; needs triton (its ptxas) and no
                                               # TRITON_INTERPRET
The wrappers are called on CPU tensors of Llama-3-8B shapes, so they pick the same launch parameters
(constexprs) as on the GPU; a stand-in Triton driver reports an sm_90 target, and every launch is
compiled to a cubin instead of run. This catches what the CPU interpreter cannot: Triton type and
lowering errors, and register pressure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_check: unset TRITON_INTERPRET (kernels must be JIT functions, not interpreted)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
RESULTS: list[tuple[str, str, int, int]] = []   # kernel, constexprs, registers, spill bytes
LABEL = [""]


class _Sm90Driver:
    """The parts of Triton's driver that a launch touches before compiling."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return TARGET


def _compile_only(self, key, signature, device, constexprs, options, attrs, warmup):
    compiled = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    regs, spills = _ptxas_usage(compiled.asm["ptx"])
    named = {self.arg_names[k[0]]: v for k, v in constexprs.items() if isinstance(v, (int, bool)) and k[0] < 40}
    shown = ",".join(f"{k}={int(v)}" for k, v in named.items() if k.isupper())
    RESULTS.append((f"{self.__name__} [{LABEL[0]}]", f"warps={options.num_warps} {shown}", regs, spills))
    return None   # nothing to launch


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0


def _llama_calls():
    from kernels.paged_attention import paged_attention
    from kernels.rmsnorm import add_rmsnorm, rmsnorm
    from kernels.rope_kv import rope_and_cache_kv
    from kernels.sampling import sample
    from kernels.swiglu import swiglu
    bf = dict(dtype=torch.bfloat16)
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32)
    hidden, heads, kv_heads, dim = 4096, 32, 8, 128
    x = torch.zeros(512, hidden, **bf)
    yield "T=512", lambda: add_rmsnorm(x, x.clone(), torch.zeros(hidden, **bf), 1e-5)
    yield "T=512", lambda: rmsnorm(x, torch.zeros(hidden, **bf), 1e-5)
    yield "T=512", lambda: swiglu(torch.zeros(512, 2 * 14336, **bf))
    qkv = torch.zeros(512, heads + 2 * kv_heads, dim, **bf)
    cache = torch.zeros(2, 64, 16, kv_heads, dim, **bf)
    yield "T=512", lambda: rope_and_cache_kv(qkv[:, :heads], qkv[:, heads:40], qkv[:, 40:], i32(512),
                                             torch.zeros(8192, dim), torch.zeros(8192, dim),
                                             torch.zeros(512, dtype=torch.int64), cache)
    for tokens, seqs in ((1, 1), (8, 8), (64, 64), (512, 256), (2048, 4)):
        q = torch.zeros(tokens, heads, dim, **bf)
        yield f"T={tokens} S={seqs}", lambda q=q, s=seqs: paged_attention(
            q, cache, i32(q.shape[0]), i32(s + 1), i32(s), i32(s, 256), i32(1), dim ** -0.5)
    one = qkv[:1]
    rope = dict(k=one[:, heads:40], v=one[:, 40:], positions=i32(1), cos=torch.zeros(8192, dim // 2),
                sin=torch.zeros(8192, dim // 2), slot_mapping=torch.zeros(1, dtype=torch.int64))
    yield "T=1 rope", lambda: paged_attention(one[:, :heads], cache, i32(1), i32(2), i32(1), i32(1, 256), i32(1),
                                              dim ** -0.5, split_keys=64, rope=rope)
    rows = 4
    params = dict(temperature=torch.ones(rows), top_k=i32(rows), top_p=torch.ones(rows), min_p=torch.zeros(rows),
                  seeds=torch.zeros(rows, dtype=torch.int64), positions=torch.zeros(rows, dtype=torch.int64))
    yield "V=128256", lambda: sample(torch.zeros(rows, 128256), **params)
    from kernels.sampling import uniforms
    yield "N=4", lambda: uniforms(params["seeds"], params["positions"])


def _qwen3_calls():
    """Qwen3-30B-A3B's attention (32 heads, 4 KV heads of 128): per-head q/k RMSNorm fused into RoPE + KV write."""
    from kernels.rope_kv import rope_and_cache_kv
    bf = dict(dtype=torch.bfloat16)
    heads, kv_heads, dim = 32, 4, 128
    cache = torch.zeros(2, 64, 16, kv_heads, dim, **bf)
    norm = torch.zeros(dim, **bf)
    for tokens in (1, 512):
        qkv = torch.zeros(tokens, heads + 2 * kv_heads, dim, **bf)
        yield f"qk-norm T={tokens}", lambda qkv=qkv, t=tokens: rope_and_cache_kv(
            qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], torch.zeros(t, dtype=torch.int32),
            torch.zeros(8192, dim // 2), torch.zeros(8192, dim // 2), torch.zeros(t, dtype=torch.int64), cache,
            q_norm=norm, k_norm=norm, eps=1e-6)
    from kernels.paged_attention import paged_attention
    one = torch.zeros(1, heads + 2 * kv_heads, dim, **bf)
    i32 = lambda *s: torch.zeros(s, dtype=torch.int32)
    rope = dict(k=one[:, heads:heads + kv_heads], v=one[:, heads + kv_heads:], positions=i32(1),
                cos=torch.zeros(8192, dim // 2), sin=torch.zeros(8192, dim // 2),
                slot_mapping=torch.zeros(1, dtype=torch.int64), q_norm=norm, k_norm=norm, eps=1e-6)
    yield "qk-norm in attention T=1", lambda: paged_attention(one[:, :heads], cache, i32(1), i32(2), i32(1),
                                                              i32(1, 256), i32(1), dim ** -0.5, split_keys=64,
                                                              rope=rope)


def _moe_calls():
    """Qwen3-30B-A3B's experts (128 of hidden 2048, width 768, 8 per token) at decode and prefill sizes."""
    from kernels.moe import fused_moe, max_row_blocks, moe_one_token, moe_route_decode
    bf = dict(dtype=torch.bfloat16)
    experts, hidden, inter = 128, 2048, 768
    gate_up, down = torch.zeros(experts, 2 * inter, hidden, **bf), torch.zeros(experts, hidden, inter, **bf)
    for tokens in (1, 16, 256, 512):                      # 1: routing in one launch (_route_decode_kernel)
        x, logits = torch.zeros(tokens, hidden, **bf), torch.zeros(tokens, experts, **bf)
        yield f"MoE T={tokens}", lambda x=x, logits=logits: fused_moe(x, logits, gate_up, down, 8, True)
    # the one-launch routing at its widest (16 x 8 pairs; fused_moe stops using it at 32): registers, spills
    logits = torch.zeros(16, experts, **bf)
    yield "MoE routing T=16", lambda: moe_route_decode(logits, 8, True, 16, max_row_blocks(16, 8, experts, 16))
    # one token: router + routing, gate_up, down in three launches; then with the add + RMSNorm in the router's
    x, router = torch.zeros(1, hidden, **bf), torch.zeros(experts, hidden, **bf)
    yield "MoE one token", lambda: moe_one_token(x, router, gate_up, down, 8, True)
    nw, res_out = torch.zeros(hidden, **bf), torch.zeros(1, hidden, **bf)
    yield "MoE one token, norm", lambda: moe_one_token(x, router, gate_up, down, 8, True, norm=(x.clone(), nw, 1e-6),
                                                       residual_out=res_out)


def _gemv_calls():
    """The batch-1 GEMV as the one-token step runs it: plain (Llama-3-8B's qkv), with the add + RMSNorm fused over
    2,048 columns (Qwen3-30B-A3B's qkv), the SwiGLU variant (off by default, kept compiling)."""
    from kernels.gemv import gemv
    bf = dict(dtype=torch.bfloat16)
    x, w = torch.zeros(1, 4096, **bf), torch.zeros(6144, 4096, **bf)
    yield "GEMV qkv", lambda: gemv(x, w)
    x2, nw, res_out = torch.zeros(1, 2048, **bf), torch.zeros(2048, **bf), torch.zeros(1, 2048, **bf)
    w2 = torch.zeros(5120, 2048, **bf)
    yield "GEMV qkv, norm", lambda: gemv(x2, w2, norm=(x2.clone(), nw, 1e-6), residual_out=res_out)
    yield "GEMV gate_up, SwiGLU", lambda: gemv(x, torch.zeros(2 * 14336, 4096, **bf), swiglu=True)


def _prefetch_calls():
    """The L2 prefetch of a projection's weights (Qwen3-30B-A3B's o, 2,048 x 4,096 bf16)."""
    from kernels.prefetch import l2_prefetch
    yield "L2 prefetch o", lambda: l2_prefetch(torch.zeros(2048, 4096, dtype=torch.bfloat16))


def main() -> int:
    driver.set_active(_Sm90Driver())
    JITFunction._do_compile = _compile_only
    for label, call in (*_llama_calls(), *_qwen3_calls(), *_moe_calls(), *_gemv_calls(), *_prefetch_calls()):
        LABEL[0] = label
        call()
    print(f"{'kernel [shape]':<44} {'regs':>5} {'spill B':>8}  launch")
    for name, shown, regs, spills in RESULTS:
        print(f"{name:<44} {regs:>5} {spills:>8}  {shown}")
    return 1 if any(spills for *_, spills in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
