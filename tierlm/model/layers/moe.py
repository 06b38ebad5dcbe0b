"""Sparse MoE block: softmax router (fp32), top-k, optional renormalisation, SwiGLU experts, and a
shared expert behind a sigmoid gate.

Experts are held stacked (`gate_up_proj` [E, 2I, H] = gate rows then up rows, `down_proj` [E, H, I]);
the loader fills them from the per-expert checkpoint tensors. The forward here is the plain torch
reference: one pass per hit expert over the tokens routed to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token_idx, slot_idx = torch.where(experts == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot_idx, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.gate = Router(h, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(h, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        weights, experts = self.gate(x)
        routed = self.experts(x, weights, experts)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared
