"""The torch reference for `fused_moe`: a loop over the hit experts in ascending id, as transformers'
Qwen4ExpTextExperts and `model/layers/moe.py` compute it (each expert's products in x's dtype, its
routing-weighted output added to the token's accumulator, also in x's dtype, expert by expert); with a
`SharedExpert`, its SwiGLU output times its gate added after, as the MoE block adds it (in x's dtype).

Quantized experts are dequantized one at a time as the loop reaches them (the stack is never
dequantized whole). This module also owns the argument checks both forms share.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tierlm.kernels.quant_linear.packing import check_packed, dequantize

FORMAT_BITS = {"unquantized": None, "int4": 4, "int6": 6, "int8": 8}


class SharedExpert(NamedTuple):
    """The MoE block's shared expert, taken by `fused_moe` as one more expert of every token, whose
    routing weight is its gate: out[t] += gate[t] * down(silu(gate_proj(x[t])) * up_proj(x[t])).

    gate [T, 1] (or [T]): the sigmoid of the shared-expert gate's logit, per token. format "unquantized":
    w_gate_up [2S, H] (gate rows, then up rows) and w_down [H, S] in x's dtype; "int4" / "int6" / "int8":
    the same packed (`quant_linear.packing`) with scales = (gate_up_scales [2S, H / g1], down_scales
    [H, S / g2]), each projection's group size implied by its scales (per-channel: one column). Its
    format and width S may differ from the routed experts'."""

    gate: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    format: str = "unquantized"
    scales: tuple[torch.Tensor, torch.Tensor] | None = None


def check_shared_args(x: torch.Tensor, shared: SharedExpert) -> tuple[int | None, int, int, int]:
    """Validate a `SharedExpert` for x [T, H]; returns (bits or None, its width S, gate_up's group size,
    down's group size; 0 and 0 unquantized)."""
    if shared.format not in FORMAT_BITS:
        raise ValueError(f"shared expert format must be one of {sorted(FORMAT_BITS)}, got {shared.format!r}")
    bits = FORMAT_BITS[shared.format]
    t, h = x.shape
    if shared.gate.numel() != t or not shared.gate.is_floating_point():
        raise ValueError(f"the shared expert's gate must be floating point with one value per token ([T={t}, 1]), "
                         f"got {shared.gate.dtype} {tuple(shared.gate.shape)}")
    w_gate_up, w_down = shared.w_gate_up, shared.w_down
    if w_gate_up.dim() != 2 or w_down.dim() != 2 or w_gate_up.shape[0] % 2 or w_down.shape[0] != h:
        raise ValueError(f"the shared expert's w_gate_up must be [2S, .] and w_down [H={h}, .]; got "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    s = w_gate_up.shape[0] // 2
    if bits is None:
        if shared.scales is not None:
            raise ValueError("an unquantized shared expert takes no scales")
        if w_gate_up.shape[1] != h or w_down.shape[1] != s:
            raise ValueError(f"the shared expert's w_gate_up must be [2S, H={h}] and w_down [H, S={s}]; got "
                             f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
        if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
            raise ValueError(f"the shared expert's weights ({w_gate_up.dtype}, {w_down.dtype}) must have x's dtype "
                             f"{x.dtype}")
        return None, s, 0, 0
    if shared.scales is None or len(shared.scales) != 2:
        raise ValueError(f"shared expert format {shared.format!r} needs scales=(gate_up_scales, down_scales)")
    return (bits, s, check_packed(w_gate_up, shared.scales[0], bits, h, None),
            check_packed(w_down, shared.scales[1], bits, s, None))


def check_moe_args(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, format: str, scales, group_size: int | None
                   ) -> tuple[int | None, int, int]:
    """Validate the shapes and dtypes of `fused_moe`'s arguments (not the ids' values: that would need a
    host sync, which a captured decode step cannot take); returns (bits or None, intermediate size I, group size or 0)."""
    if format not in FORMAT_BITS:
        raise ValueError(f"format must be one of {sorted(FORMAT_BITS)}, got {format!r}")
    bits = FORMAT_BITS[format]
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be floating point [T, H], got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={t}, k]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_gate_up.shape[0] != w_down.shape[0]:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} must be stacked "
                         "[E, ...] over the same experts")
    two_i = w_gate_up.shape[1]
    if two_i % 2 or w_down.shape[1] != h:
        raise ValueError(f"w_gate_up must be [E, 2I, .] and w_down [E, H={h}, .]; got {tuple(w_gate_up.shape)}, "
                         f"{tuple(w_down.shape)}")
    i = two_i // 2
    if bits is None:
        if scales is not None or group_size is not None:
            raise ValueError("unquantized experts take no scales or group_size")
        if w_gate_up.shape[2] != h or w_down.shape[2] != i:
            raise ValueError(f"w_gate_up must be [E, 2I, H={h}] and w_down [E, H, I={i}]; got "
                             f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
        if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
            raise ValueError(f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must have x's dtype {x.dtype}")
        group = 0
    else:
        if scales is None or len(scales) != 2:
            raise ValueError(f"format {format!r} needs scales=(gate_up_scales, down_scales)")
        group = check_packed(w_gate_up, scales[0], bits, h, group_size)
        if check_packed(w_down, scales[1], bits, i, group) != group:
            raise ValueError("gate_up and down scales imply different group sizes")
    return bits, i, group


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, format: str = "unquantized", scales=None, group_size: int | None = None,
              shared: SharedExpert | None = None) -> torch.Tensor:
    """Top-k SwiGLU experts: out[t] = sum over slots s, in ascending expert id, of
    topk_weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t])) with e = topk_ids[t, s]; plus, with
    `shared`, shared.gate[t] * the shared expert's SwiGLU of x[t] (see `SharedExpert`).

    x [T, H]; topk_weights [T, k] (any float dtype); topk_ids [T, k] int, each token's ids distinct.
    format "unquantized": w_gate_up [E, 2I, H] (gate rows, then up rows) and w_down [E, H, I] in x's dtype,
    as `Experts` holds them. format "int4" / "int6" / "int8": the same weights packed (see
    `quant_linear.packing`): w_gate_up int32 [E, 2I, ceil(H * bits / 32)], w_down int32
    [E, H, ceil(I * bits / 32)], scales = (gate_up_scales [E, 2I, H / group], down_scales [E, H, I / group]);
    group_size defaults to what the scales imply. Returns [T, H] in x's dtype."""
    bits, i, group = check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids, format, scales, group_size)
    if shared is not None:
        check_shared_args(x, shared)
    h, num_experts = x.shape[1], w_gate_up.shape[0]
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts})")

    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if bits is None:
            return w_gate_up[e], w_down[e]
        return (dequantize(w_gate_up[e], scales[0][e], bits, h, group, dtype=x.dtype),
                dequantize(w_down[e], scales[1][e], bits, i, group, dtype=x.dtype))

    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():  # ascending
        tokens, slots = torch.where(topk_ids == e)
        gate_up, down = expert_weights(e)
        gate, up = F.linear(x[tokens], gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down) * topk_weights[tokens, slots, None].to(x.dtype)
        out[tokens] += y  # a token routes to an expert at most once: the indices are unique
    if shared is not None:
        out = out + shared.gate.reshape(-1, 1).to(x.dtype) * shared_expert(x, shared)
    return out


def shared_expert(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """The shared expert's SwiGLU of x [T, H] (without its gate), in x's dtype, as the model's layers
    compute it (a packed weight dequantized and rounded to x's dtype first)."""
    bits, s, gate_up_group, down_group = check_shared_args(x, shared)
    w_gate_up, w_down = shared.w_gate_up, shared.w_down
    if bits is not None:
        w_gate_up = dequantize(w_gate_up, shared.scales[0], bits, x.shape[1], gate_up_group, dtype=x.dtype)
        w_down = dequantize(w_down, shared.scales[1], bits, s, down_group, dtype=x.dtype)
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)
