"""Per-token reference of the gated delta rule (fp32). Used for decode steps and as the test oracle."""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the package docstring for shapes; iterates over T."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = initial_state.float()  # never written in place: each step makes a new tensor
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        k_t = k[:, t, :, None, :]  # [B, H, 1, Dk]
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t, :, None, :] - k_t @ state) * beta[:, t, :, None, None]  # [B, H, 1, Dv]
        state = state + k_t.transpose(-1, -2) @ delta
        out[:, t] = (q[:, t, :, None, :] @ state).squeeze(-2)
    return out, state
