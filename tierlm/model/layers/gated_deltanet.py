"""Gated DeltaNet linear attention with per-request state in pooled slots.

Per token: project to mixed q|k|v channels, a causal depthwise conv over time (kernel Kc, window kept
in the slot between calls), silu, split, beta = sigmoid(b), log decay g = -exp(A_log) softplus(a + dt_bias),
l2-normalised q and k (q scaled by dk^-1/2), then the gated delta rule (`kernels/gated_delta_rule`) and a
gated RMS norm. Multi-token chunks use the chunked form; single-token decodes of all requests in the
batch run together, everything between in_proj and out_proj in one step (`gated_delta_rule.decode`).
Both start from and write back the slot's state. A speculative verification batch (`batch.position_slots`)
also keeps the state after each of a request's rows in the slot given for it: when every request verifies
T rows, through the decode step's multi-token form (`gated_delta_verify`, the same kernels on CUDA);
otherwise request by request, row by row. On CUDA a prefill batch's rule runs as one Triton
launch over all its requests (`chunk_triton`; TIERLM_NO_TRITON_GDN_PREFILL=1 turns it off), and a decode
step as one Triton launch (`decode_triton`; TIERLM_NO_FUSED_GDN_DECODE=1 turns it off); on CPU
request by request, and the decode step, in torch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_decode,
    gated_delta_verify,
    recurrent_gated_delta_rule,
)
from tierlm.model.cache import GDNState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.norm import GatedRMSNorm, l2norm
from tierlm.model.layers.packed_linear import Linear, PackedLinear


def causal_depthwise_conv(window: torch.Tensor, weight: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """window [B, C, P + T] (P = (K-1)*dilation past values first), weight [C, K] -> [B, C, T] in window's dtype.

    One strided view of the K taps per output and one weighted sum: a few ops whatever T is, where
    `F.conv1d`'s setup dominates a decode step on CPU. The products and their sum are fp32 and the result
    is rounded once, as `F.conv1d` accumulates: rounding every bf16 tap x weight product before the sum
    put outputs hundreds of ulps off where the products cancel (tests/test_bf16_parity.py).
    """
    kernel = weight.shape[1]
    taps = window.unfold(-1, (kernel - 1) * dilation + 1, 1)[..., ::dilation]  # [B, C, T, K]
    return (taps * weight.float()[:, None, :]).sum(-1).to(window.dtype)


def fused_decode_applies(x: torch.Tensor) -> bool:
    """The decode step through `decode_triton`'s kernels: on CUDA, unless TIERLM_NO_FUSED_GDN_DECODE=1."""
    return x.is_cuda and not os.environ.get("TIERLM_NO_FUSED_GDN_DECODE")


def triton_prefill_applies(x: torch.Tensor) -> bool:
    """The prefill rule through `chunk_triton`: on CUDA, unless TIERLM_NO_TRITON_GDN_PREFILL=1."""
    return x.is_cuda and not os.environ.get("TIERLM_NO_TRITON_GDN_PREFILL")


class GatedDeltaNet(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = c.linear_conv_kernel_dim
        h = c.hidden_size
        self.in_proj = PackedLinear(
            h, {"in_proj_qkv": self.conv_dim, "in_proj_z": self.value_dim, "in_proj_b": self.num_v_heads,
                "in_proj_a": self.num_v_heads},
        )
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, c.rms_norm_eps, c.output_gate_act)
        self.gate_activation = c.output_gate_act
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: GDNState) -> torch.Tensor:
        mixed, z, b, a = self.in_proj(x)  # mixed: [N, C]
        if batch.is_decode_only or batch.verify_slots is not None:
            return self.out_proj(self._decode(mixed, z, b, a, batch, state))
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self._chunks(mixed, beta, g, batch, state).to(x.dtype)  # [N, nv, dv]
        return self.out_proj(self.norm(core, z).flatten(-2))

    def _chunks(self, mixed, beta, g, batch: ForwardBatch, state: GDNState) -> torch.Tensor:
        """Any batch: each request's chunk through the conv and the chunked (or per-token) rule."""
        weight = self.conv1d.weight.squeeze(1)
        if triton_prefill_applies(mixed) and not any(batch.position_slots or ()):
            return self._chunks_triton(mixed, beta, g, batch, state, weight)
        core = torch.empty(mixed.shape[0], self.num_v_heads, self.head_v_dim, device=mixed.device)
        position_slots = batch.position_slots or [[]] * batch.num_requests
        for (start, end), slot, after in zip(batch.bounds, batch.state_slots, position_slots):
            window = torch.cat([state.conv[slot], mixed[start:end].T], dim=-1).unsqueeze(0)
            for t, target in enumerate(after):  # speculative verification: the window after each row
                state.conv[target] = window[0, :, t + 1 : t + self.kernel]
            state.conv[slot] = window[0, :, -(self.kernel - 1) :]
            conv = F.silu(causal_depthwise_conv(window, weight)).transpose(1, 2)  # [1, T, C]
            q, k, v = self.heads(conv)
            g_, beta_, initial = g[start:end].unsqueeze(0), beta[start:end].unsqueeze(0), state.recurrent[slot][None]
            if after:  # row by row, the state after each row kept
                for t, target in enumerate([*after, slot]):
                    out, initial = recurrent_gated_delta_rule(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                                                              g_[:, t : t + 1], beta_[:, t : t + 1], initial)
                    state.recurrent[target] = initial[0]
                    core[start + t] = out[0, 0]
                continue
            rule = chunk_gated_delta_rule if end - start > 1 else recurrent_gated_delta_rule
            out, final = rule(q, k, v, g_, beta_, initial)
            state.recurrent[slot] = final[0]
            core[start:end] = out[0]
        return core

    def _chunks_triton(self, mixed, beta, g, batch: ForwardBatch, state: GDNState, weight) -> torch.Tensor:
        """As `_chunks`: the conv request by request, then the rule for every request in one launch."""
        from tierlm.kernels.gated_delta_rule.chunk_triton import triton_chunk_gated_delta_rule_varlen

        conv = torch.empty_like(mixed)  # [N, C]
        for (start, end), slot in zip(batch.bounds, batch.state_slots):
            window = torch.cat([state.conv[slot], mixed[start:end].T], dim=-1).unsqueeze(0)
            state.conv[slot] = window[0, :, -(self.kernel - 1) :]
            conv[start:end] = F.silu(causal_depthwise_conv(window, weight))[0].T
        q, k, v = self.heads(conv, repeat_keys=False)
        cu_seqlens = torch.tensor([0, *(end for _, end in batch.bounds)], dtype=torch.int32, device=mixed.device)
        return triton_chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, state.recurrent, batch.slots)

    def _decode(self, mixed, z, b, a, batch: ForwardBatch, state: GDNState) -> torch.Tensor:
        """One token per request, or T per request of a speculative verification batch (the state after
        each row into `batch.verify_slots`), all requests at once, from the in_proj outputs to out_proj's
        input [N, nv*dv]: static shapes, no host sync (CUDA-graph safe)."""
        weights = (self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, self.norm.weight, state.conv,
                   state.recurrent, batch.slots)
        fused = fused_decode_applies(mixed)
        if batch.verify_slots is not None:
            if fused:
                from tierlm.kernels.gated_delta_rule.decode_triton import triton_gated_delta_verify as verify
            else:
                verify = gated_delta_verify
            return verify(mixed, z, b, a, *weights, batch.verify_slots, self.norm.eps, self.gate_activation)
        if fused:
            from tierlm.kernels.gated_delta_rule.decode_triton import triton_gated_delta_decode as step
        else:
            step = gated_delta_decode
        return step(mixed, z, b, a, *weights, self.norm.eps, self.gate_activation)

    def heads(self, conv: torch.Tensor, repeat_keys: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv [..., C] -> q, k [..., nv, dk] (normalised, q scaled; nk heads if not repeat_keys), v [..., nv, dv]."""
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        q, k = l2norm(q.float(), scale=self.head_k_dim**-0.5), l2norm(k.float())
        repeat = self.num_v_heads // self.num_k_heads
        if repeat > 1 and repeat_keys:  # value head j reads key head j // repeat
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        return q, k, v
