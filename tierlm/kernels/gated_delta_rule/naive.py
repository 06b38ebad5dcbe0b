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
        state = state * g[:, t].exp()[..., None, None]
        memory = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state
