"""The MoE router in plain torch: the reference (see the package docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]); softmax in fp32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def route_and_gate(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H], weight [E + 1, H] (router rows, then the shared expert gate's) -> (weights [N, k],
    expert ids [N, k], sigmoid of the shared gate [N, 1])."""
    check_router_args(x, weight, top_k)
    router_logits, gate_logit = F.linear(x, weight).split([weight.shape[0] - 1, 1], dim=-1)
    weights, experts = route(router_logits, top_k, renormalize)
    return weights, experts, torch.sigmoid(gate_logit)


def check_router_args(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [N, H] and [E + 1, H]")
    if not 0 < top_k <= weight.shape[0] - 1:
        raise ValueError(f"router: top_k {top_k} must be in 1..{weight.shape[0] - 1} (the experts)")
    if x.dtype != weight.dtype:
        raise ValueError(f"router: x is {x.dtype} but the weight is {weight.dtype}")
