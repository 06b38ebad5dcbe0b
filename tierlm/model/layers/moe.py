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

from tierlm.model.layers.packed_linear import PackedLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = PackedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]); softmax in fp32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class Experts(nn.Module):
    # Up to this many (token, expert) pairs (a decode step), a small-batch form runs instead of grouping
    # tokens by expert: in a static batch one batched product over the gathered expert weights (no host
    # sync, so it can be captured or compiled); else a loop over the pairs on weight views (no copy),
    # which measured 3x faster than gathering in eager mode on CPU.
    SMALL_BATCH_PAIRS = 16

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, static: bool = False) -> torch.Tensor:
        if static:
            return self._gathered(x, weights, experts)
        if experts.numel() <= self.SMALL_BATCH_PAIRS:
            return self._per_pair(x, weights, experts)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token_idx, slot_idx = torch.where(experts == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            # a token routes to an expert at most once, so the indices are unique (index_add_ is slow on CPU)
            out[token_idx] += (y * weights[token_idx, slot_idx, None]).to(out.dtype)
        return out

    def _per_pair(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        rows = []
        for token, (ids, token_weights) in enumerate(zip(experts.tolist(), weights)):
            acc = torch.zeros_like(x[token])
            for slot in sorted(range(len(ids)), key=ids.__getitem__):  # ascending expert id, as the reference
                gate, up = F.linear(x[token], self.gate_up_proj[ids[slot]]).chunk(2, dim=-1)
                acc = acc + F.linear(F.silu(gate) * up, self.down_proj[ids[slot]]) * token_weights[slot]
            rows.append(acc)
        return torch.stack(rows)

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
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        # the router's E rows and the shared expert's gate row read the same input: one product
        self.router = PackedLinear(h, {"gate": config.num_experts, "shared_expert_gate": 1})
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(h, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor, static: bool = False) -> torch.Tensor:
        """static: take the sync-free expert form (see `Experts`)."""
        router_logits, shared_gate = self.router(x)
        weights, experts = route(router_logits, self.top_k, self.renormalize)
        routed = self.experts(x, weights, experts, static)
        return routed + torch.sigmoid(shared_gate) * self.shared_expert(x)
