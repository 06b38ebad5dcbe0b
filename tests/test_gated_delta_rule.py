"""The gated delta rule's fast forms against the per-token reference (kernels/gated_delta_rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierlm.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_step,
    recurrent_gated_delta_rule,
)


def inputs(b, t, h, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 3
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("t", [1, 5, 64, 65, 200])
def test_chunked_equals_per_token(t):
    q, k, v, g, beta, state = inputs(2, t, 3, 16, 8, seed=t)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("group", [1, 2, 4])
def test_fused_step_with_grouped_keys_equals_per_token(group):
    hk, dk, dv = 2, 16, 8
    q, k, v, g, beta, state = inputs(3, 1, hk * group, dk, dv, seed=group)
    # the reference sees each key head repeated for its value heads
    qk, kk = q[:, :, ::group], k[:, :, ::group]
    o_ref, s_ref = recurrent_gated_delta_rule(
        qk.repeat_interleave(group, 2), kk.repeat_interleave(group, 2), v, g, beta, state
    )
    o, s = fused_recurrent_gated_delta_rule_step(qk[:, 0], kk[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert torch.allclose(o, o_ref[:, 0], atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5)
