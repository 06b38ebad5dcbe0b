"""Chunked (parallel) form of the gated delta rule for prefill, in plain torch (fp32).

Within a chunk of C tokens with cumulative log decay G_t, the per-token updates u_t solve a unit lower
triangular system, (I + A) U = beta (V - e^G K S0) with A_ts = beta_t e^(G_t - G_s) k_t.k_s for s < t
(the UT transform), after which the chunk's outputs and its final state are matrix products:
  O  = e^G (Q S0) + (tril(Q K^T) * e^(G_t - G_s)) U
  S1 = e^(G_C) S0 + (K * e^(G_C - G))^T U
Same results as `naive.recurrent_gated_delta_rule` up to fp32 rounding.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the package docstring for shapes."""
    # [B, H, T, D] fp32 so that the chunk math is batched over heads
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    state = initial_state.float()
    total = q.shape[2]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for start in range(0, total, chunk_size):
        end = min(start + chunk_size, total)
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        bc = beta[:, :, start:end]
        cum = g[:, :, start:end].cumsum(-1)  # G_t
        size = end - start
        strict_lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)
        lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        a = (bc[..., :, None] * pair_decay * (kc @ kc.transpose(-1, -2))).masked_fill(~strict_lower, 0.0)
        eye = torch.eye(size, dtype=torch.float32, device=q.device)
        rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        scores = (qc @ kc.transpose(-1, -2)) * pair_decay
        out[:, :, start:end] = cum.exp()[..., None] * (qc @ state) + scores @ u
        last = cum[..., -1:]
        state = last.exp()[..., None] * state + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return out.transpose(1, 2), state


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Several packed sequences at once, states in a pool (the reference for `chunk_triton`).

    q, k [N, Hk, Dk] (normalised, q scaled; value head h reads key head h // (Hv / Hk)), v [N, Hv, Dv],
    g, beta [N, Hv], cu_seqlens [B + 1] (sequence i is rows cu_seqlens[i]:cu_seqlens[i+1], each >= 1),
    state_pool [P, Hv, Dk, Dv] fp32, state_indices [B] (the pool slot of each sequence: its initial
    state, overwritten in place by its final state) -> o [N, Hv, Dv] fp32. Sequence by sequence through
    `chunk_gated_delta_rule`.
    """
    repeat = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        start, end = bounds[i], bounds[i + 1]
        o, final = chunk_gated_delta_rule(
            *(x[None, start:end] for x in (q, k, v, g, beta)), state_pool[slot].unsqueeze(0)
        )
        out[start:end] = o[0]
        state_pool[slot] = final[0]
    return out
