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
    # up to this many (token, expert) pairs, gather the experts' weights and run one batched product:
    # a decode step's handful of pairs then costs a few ops instead of a dozen per expert
    GATHER_MAX_PAIRS = 16

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if experts.numel() <= self.GATHER_MAX_PAIRS:
            return self._gathered(x, weights, experts)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token_idx, slot_idx = torch.where(experts == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            # a token routes to an expert at most once, so the indices are unique (index_add_ is slow on CPU)
            out[token_idx] += (y * weights[token_idx, slot_idx, None]).to(out.dtype)
        return out

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        flat = experts.flatten()
        inputs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [n*k, H, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat], inputs).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [n*k, H]
        return (y.view(n, k, -1) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


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
