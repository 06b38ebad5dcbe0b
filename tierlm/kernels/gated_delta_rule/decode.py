"""A Gated DeltaNet layer's whole decode step after its input projections, in plain torch (the reference for
`decode_triton`, and the path CPU runs).

One token per request; request i's conv window and recurrent state are row slots[i] of the pools and are
updated in place (rows may repeat: static decode's padding rows all point at the scratch slot, whose
contents are garbage nobody reads). Shapes, with C = 2 Hk Dk + Hv Dv conv channels (q | k | v) and value
head h reading key head h // (Hv / Hk):
  mixed [B, C], z [B, Hv*Dv], b, a [B, Hv] (the in_proj outputs: any row stride, unit column stride),
  conv_weight [C, Kc], A_log, dt_bias [Hv], norm_weight [Dv],
  conv_pool [S, C, Kc-1] (the last Kc-1 inputs, oldest first), state_pool [S, Hv, Dk, Dv] fp32, slots [B]
  -> [B, Hv*Dv] in mixed's dtype, ready for out_proj.
Per request, in this order (the roundings to the model dtype are where transformers rounds):
  conv   = silu(sum_j conv_weight[:, j] window[:, j])   products and sum fp32, rounded once, then silu
  q, k   = l2norm(conv q, k channels) (q scaled by Dk^-1/2), v = conv v channels
  beta   = sigmoid(b),  g = -exp(A_log) softplus(a + dt_bias)
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q   (fp32; `fused_recurrent`)
  out    = norm_weight * rmsnorm(o rounded) (rounded) * act(z)    (act: silu or sigmoid)
`gated_delta_verify` is the same step over T tokens per request (speculative verification), writing the
conv window and state after each token to its own slot, so a rejected draft is undone by copying a slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_step

GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def decode_head_counts(mixed: torch.Tensor, state_pool: torch.Tensor) -> tuple[int, int, int, int]:
    """(Hk, Hv, Dk, Dv) from the shapes, checked: the conv channels must be 2 Hk Dk + Hv Dv with Hv a multiple of Hk."""
    num_value_heads, head_k_dim, head_v_dim = state_pool.shape[1:]
    key_channels = mixed.shape[1] - num_value_heads * head_v_dim
    num_key_heads = key_channels // (2 * head_k_dim)
    if key_channels <= 0 or key_channels % (2 * head_k_dim) or num_value_heads % num_key_heads:
        raise ValueError(
            f"{mixed.shape[1]} conv channels do not split into q, k of Dk={head_k_dim} and v of {num_value_heads} "
            f"value heads x {head_v_dim} with value heads a multiple of key heads"
        )
    return num_key_heads, num_value_heads, head_k_dim, head_v_dim


def _l2norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * x * rsqrt(sum(x^2) + 1e-6) over the last dim (one fused rms_norm, as model/layers/norm.py)."""
    d = x.shape[-1]
    return F.rms_norm(x, (d,), eps=1e-6 / d) * (scale * d**-0.5)


def gated_delta_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    eps: float,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """See the module docstring. Static shapes, no host sync (CUDA-graph and torch.compile safe)."""
    num_key_heads, num_value_heads, head_k_dim, head_v_dim = decode_head_counts(mixed, state_pool)
    n, key_dim = mixed.shape[0], num_key_heads * head_k_dim
    # index_select / index_copy_: whole-slot copies, several times cheaper than [] indexing
    window = torch.cat([conv_pool.index_select(0, slots), mixed.unsqueeze(-1)], dim=-1)  # [B, C, Kc]
    conv_pool.index_copy_(0, slots, window[..., 1:])
    conv = F.silu((window * conv_weight.float()).sum(-1).to(mixed.dtype))  # fp32 products and sum, one rounding
    q, k, v = conv.split([key_dim, key_dim, num_value_heads * head_v_dim], dim=-1)
    q = _l2norm(q.float().view(n, num_key_heads, head_k_dim), scale=head_k_dim**-0.5)
    k = _l2norm(k.float().view(n, num_key_heads, head_k_dim))
    beta = torch.sigmoid(b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    out, final = fused_recurrent_gated_delta_rule_step(
        q, k, v.view(n, num_value_heads, head_v_dim), g, beta, state_pool.index_select(0, slots)
    )
    state_pool.index_copy_(0, slots, final)
    return _gated_output(out, z, norm_weight, eps, gate_activation, mixed.dtype)


def gated_delta_verify(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    state_slots: torch.Tensor,
    eps: float,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """T tokens per request (speculative verification: a request's last token and its drafts), keeping the
    state after every one of them. Rows are request-major (mixed [B*T, C], z [B*T, Hv*Dv], b, a [B*T, Hv]);
    request i starts from slot slots[i], and its conv window and recurrent state after its row t go to
    slot state_slots[i, t] ([B, T]; the last column is normally `slots`, the other slots must differ from
    `slots`). Per row the math and roundings of `gated_delta_decode`, which is this with T = 1 and
    state_slots = slots[:, None]. Static shapes, no host sync. -> [B*T, Hv*Dv]."""
    num_key_heads, num_value_heads, head_k_dim, head_v_dim = decode_head_counts(mixed, state_pool)
    requests, width = state_slots.shape
    channels = mixed.shape[1]
    kernel, key_dim = conv_weight.shape[-1], num_key_heads * head_k_dim
    window = torch.cat([conv_pool.index_select(0, slots), mixed.view(requests, width, channels).transpose(1, 2)],
                       dim=-1)  # [B, C, Kc-1+T]
    after = window.unfold(-1, kernel - 1, 1)[:, :, 1:]  # [B, C, T, Kc-1]: the window after each row
    conv_pool.index_copy_(0, state_slots.flatten(), after.transpose(1, 2).flatten(0, 1))
    taps = window.unfold(-1, kernel, 1)  # [B, C, T, Kc]
    conv = F.silu((taps * conv_weight.float()[:, None, :]).sum(-1).to(mixed.dtype))  # one rounding, as decode
    q, k, v = conv.transpose(1, 2).flatten(0, 1).split([key_dim, key_dim, num_value_heads * head_v_dim], dim=-1)
    q = _l2norm(q.float().view(requests, width, num_key_heads, head_k_dim), scale=head_k_dim**-0.5)
    k = _l2norm(k.float().view(requests, width, num_key_heads, head_k_dim))
    v = v.reshape(requests, width, num_value_heads, head_v_dim)
    beta = torch.sigmoid(b).view(requests, width, num_value_heads)
    g = (-A_log.float().exp() * F.softplus(a.float() + dt_bias)).view(requests, width, num_value_heads)
    state = state_pool.index_select(0, slots)
    out = []
    for t in range(width):
        o, state = fused_recurrent_gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        state_pool.index_copy_(0, state_slots[:, t], state)
        out.append(o)
    return _gated_output(torch.stack(out, dim=1).flatten(0, 1), z, norm_weight, eps, gate_activation, mixed.dtype)


def _gated_output(core: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_activation: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """The rule's output o [N, Hv, Dv] fp32 -> norm_weight * rmsnorm(o rounded) (rounded) * act(z), [N, Hv*Dv]."""
    core = core.to(dtype).float()
    normed = norm_weight * (core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gate = GATE_ACTIVATIONS[gate_activation](z.unflatten(-1, core.shape[1:]).float())
    return (normed * gate).to(dtype).flatten(-2)
