"""Mixture-of-experts routing and the plain-torch expert MLPs (the CPU's `moe` op, the GPU kernel's reference).

Routing as Qwen3-MoE and Mixtral do it in transformers: router logits [T, E] -> softmax over all experts in
float32 -> each token's top_k -> (renormalised so the k weights sum to 1). For Mixtral this equals the
softmax over the top-k logits. Each token's output is sum_j weight_j * down_e(silu(gate_e x) * up_e x) over
its experts e = ids_j, accumulated in float32 and rounded once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], router [E, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k] int64), best
    first. No host sync (graph-capturable on the GPU)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)             # [T, E] float32
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP: x [n, hidden], gate_up [2 I, hidden], down [hidden, I] -> [n, hidden]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def moe_reference(x: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor,
                  experts_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The `moe` op written plainly: a loop over the experts that got tokens (reads the routing on the
    host, so not for CUDA graphs). x [T, hidden] -> [T, hidden] in x's dtype."""
    weights, ids = route(x, router, top_k, renormalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        y = expert_mlp(x[token], experts_gate_up[expert], experts_down[expert])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)
