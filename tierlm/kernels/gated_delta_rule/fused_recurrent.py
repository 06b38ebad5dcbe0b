"""One decode step of the gated delta rule for a batch of requests, with grouped key heads.

Same math as `naive.recurrent_gated_delta_rule` for T = 1, but the key heads are not repeated for each
of their value heads: q and k broadcast over the group, which saves the copies and a dozen small ops
per layer and step (decode is dispatch-bound). Shapes: q, k [B, Hk, Dk] (normalised, q scaled),
v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv] fp32 -> (o [B, Hv, Dv] fp32, new state).
"""

from __future__ import annotations

import torch


def fused_recurrent_gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hk, dk = k.shape
    hv, dv = v.shape[1:]
    group = hv // hk
    q = q.float().view(b, hk, 1, 1, dk)
    k = k.float().view(b, hk, 1, 1, dk)
    s = state.float().view(b, hk, group, dk, dv) * g.float().exp().view(b, hk, group, 1, 1)
    delta = (v.float().view(b, hk, group, 1, dv) - k @ s) * beta.float().view(b, hk, group, 1, 1)
    s = s + k.transpose(-1, -2) @ delta
    return (q @ s).view(b, hv, dv), s.view(b, hv, dk, dv)
