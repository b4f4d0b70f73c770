"""`DecoderOps` on the GPU: the Triton kernels (kernels/), bound to one step buffer's device views.

Everything a kernel reads about the step (positions, KV slots, sequence ids, query offsets, context
lengths, block tables) comes from `StepBuffers.d`, so the same ops captured in a CUDA graph serve every
batch of the bucket. Built by `GpuRunner` per bucket (eagerly, or while capturing that bucket's graph).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_backend import env
from gpu_backend.models.fp8 import Fp8Weight, fp8_linear
from gpu_backend.models.llama_forward import NormFused

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def l2_prefetch_mode() -> int:
    """`BLINK_L2_PREFETCH`: 0 off (the default), 1 o's weights during the attention, 2 also an MoE layer's next qkv
    during its routing (TritonOps.prefetch)."""
    value = (env.get("L2_PREFETCH") or "0").strip()
    if value not in ("0", "1", "2"):
        raise ValueError(f"BLINK_L2_PREFETCH={value!r}: use 0, 1 or 2")
    return int(value)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream a device for the L2 prefetches (captured as a branch of the step's graph)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class TritonOps(NormFused):
    # One-token steps (kernels/gemv.py, measured on an H100: bench/NOTES.md): the norm runs inside the MoE router
    # (128 programs: -0.12 ms a Qwen3-30B-A3B step with the next two) and inside GEMVs over rows of at most
    # `fuse_norm_max_k` (every program normalises the row: over Llama-3-8B's 4,096 that cost more than the launch
    # it saves, +41 us a step); the SwiGLU inside the gate_up GEMV lost 90 us on Llama-3-8B: off.
    fuse_norm = True
    fuse_norm_max_k = 2048
    fuse_swiglu = False

    def __init__(self, kernels: dict, step: dict[str, torch.Tensor], num_tokens: int, num_seqs: int,
                 rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, attn_out: torch.Tensor,
                 scale: float, gemv: dict[str, tuple[int, int, int]], tp=None):
        # step: StepBuffers.d (device views); rope: cos, sin [context_len, D/2] float32; attn_out: [t, H, D]
        self.k, self.d, self.t, self.s = kernels, step, num_tokens, num_seqs
        self.cos, self.sin = rope
        self.kv_cache, self.attn_out, self.scale, self.gemv = kv_cache, attn_out, scale, gemv
        # few query tiles: split the keys finer so more programs share the KV reads (a batch-1 step
        # has one tile per KV head); many tiles fill the GPU on their own
        self.split_keys = 64 if num_tokens <= 32 else 256
        self.tp = tp  # kernels/tp_comm.RankComm under tensor parallelism, else None
        self._rope = None  # rope_kv's arguments, for the attention launch that follows it
        self.l2_prefetch = l2_prefetch_mode() if num_tokens == 1 else 0
        self._prefetched: list = []  # (weight, side stream) between `prefetch` and the GEMV that reads it

    def linear(self, name: str, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._gemv(name, x, weight, bias)
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, bias, quantize=self.k["fp8_quant"], weight_only_mm=self.k["fp8_w8a16"])
        return F.linear(x, weight, bias)

    def _gemv(self, name: str, x: torch.Tensor, weight, bias: torch.Tensor | None, **fused) -> torch.Tensor:
        """A one-token projection: a read of the weights (kernels/gemv.py), the tile by shape or overridden; an
        FP8 weight weight-only, its tile twice as wide in K (the same bytes a program). `fused`: gemv's norm,
        residual_out and swiglu."""
        if isinstance(weight, Fp8Weight):
            n, k, warps = self.gemv.get(name) or self.k["gemv_config"](*weight.q.shape)
            y = self.k["gemv"](x, weight.q, bias, config=(n, 2 * k, warps), scale=weight.scale, **fused)
        else:
            y = self.k["gemv"](x, weight, bias, config=self.gemv.get(name), **fused)
        self._join(weight)
        return y

    def prefetch(self, weight, during: str) -> None:
        # BLINK_L2_PREFETCH, one-token steps: the weight's lines into L2 on a side stream that forks after the kernels
        # launched so far (the GEMV before: HBM is free again) and joins after the GEMV that reads it, so no kernel
        # of the main chain waits for it (kernels/prefetch.py). 1: o's during the attention; 2: also an MoE layer's
        # next qkv during its routing, the experts' weights loaded evict-first so that those lines stay in L2
        w = weight.q if isinstance(weight, Fp8Weight) else weight
        if self.l2_prefetch < (1 if during == "attention" else 2) or not w.is_cuda:
            return
        main = torch.cuda.current_stream(w.device)
        side = _side_stream(w.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.k["l2_prefetch"](w)
        self._prefetched.append((weight, side))

    def _join(self, weight) -> None:
        for i, (pending, side) in enumerate(self._prefetched):
            if pending is weight:
                torch.cuda.current_stream(side.device).wait_stream(side)
                del self._prefetched[i]
                return

    def norm_linear(self, name: str, x: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, weight, bias: torch.Tensor | None = None,
                    swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # one token: the norm (and the SwiGLU) inside the GEMV, kernels/gemv.py: two launches fewer a layer
        src = residual if x is None else x
        if (not self.fuse_norm or residual.shape[0] != 1 or residual.shape[1] > self.fuse_norm_max_k
                or not (src.is_contiguous() and residual.is_contiguous())):
            return super().norm_linear(name, x, residual, norm_weight, eps, weight, bias, swiglu)
        if swiglu and not self.fuse_swiglu:
            y, residual = self.norm_linear(name, x, residual, norm_weight, eps, weight, bias)
            return self.swiglu(y), residual
        res_out = None if x is None else torch.empty_like(residual)
        y = self._gemv(name, src, weight, bias, norm=(None if x is None else residual, norm_weight, eps),
                       residual_out=res_out, swiglu=swiglu)
        return y, (residual if x is None else res_out)

    def norm_moe(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 router: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fuse_norm or x.shape[0] != 1:
            return super().norm_moe(x, residual, norm_weight, eps, router, experts_gate_up, experts_down, top_k,
                                    renormalize)
        res_out = torch.empty_like(residual)  # the norm in the router's launch (kernels/moe.py, moe_one_token)
        y = self.k["moe_one_token"](x, router, experts_gate_up, experts_down, top_k, renormalize,
                                    norm=(residual, norm_weight, eps), residual_out=res_out,
                                    evict_first=self.l2_prefetch >= 2)
        return y, res_out

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k["rmsnorm"](x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k["add_rmsnorm"](x, residual, weight, eps)

    def rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
        # handed to the attention's launch (kernels/paged_attention.py, `rope`): at one token its tile kernel
        # rotates q and writes K/V itself (one launch a layer less); otherwise kernels/rope_kv.py runs first, with
        # Qwen3's q/k norms inside it (one launch instead of three)
        d, t = self.d, self.t
        self._rope = dict(k=k, v=v, positions=d["positions"][:t], cos=self.cos, sin=self.sin,
                          slot_mapping=d["slot_mapping"][:t])
        if q_norm is not None:
            self._rope.update(q_norm=q_norm, k_norm=k_norm, eps=eps)
        return q  # rotated by the attention's launch; the rotated k lives in the cache only

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        d, t, s = self.d, self.t, self.s
        rope, self._rope = self._rope, None
        self.k["attn"](q, self.kv_cache[layer], d["seq_ids"][:t], d["q_start"][:s + 1], d["ctx_lens"][:s],
                       d["block_tables"][:s], d["num_seqs"], self.scale, out=self.attn_out, split_keys=self.split_keys,
                       rope=rope)
        return self.attn_out

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k["swiglu"](gate_up)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return x
        x = x.contiguous()
        self.tp.all_reduce_(x, torch.cuda.current_stream(x.device).cuda_stream)  # in place, over peer memory
        return x

    def moe(self, x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor,
            top_k: int, renormalize: bool) -> torch.Tensor:
        # the routing stays on the GPU: kernels/moe.py groups the pairs by expert with fixed grids; one token
        # needs no grouping: its router, routing and k experts' GEMVs take three launches (moe_one_token)
        if x.shape[0] == 1:
            return self.k["moe_one_token"](x, router, experts_gate_up, experts_down, top_k, renormalize)
        logits = self.linear("router", x, router)                             # [T, E]
        return self.k["moe"](x, logits, experts_gate_up, experts_down, top_k, renormalize)
