"""Hyper-connections' mix and combine in plain torch: the reference (see the package docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.kernels.quant_linear.packing import dequantize


def mix(
    streams: torch.Tensor, norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
    hc_count: int, eps: float, down_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [N, hc*H] -> (block input [N, H], injection gates [N, hc] or None). A weight given with
    its scale is INT8 per channel (`int8_weight_shape`), dequantized to the streams' dtype as the layer's
    quant method does."""
    down_shape, up_shape = int8_weight_shape(down_weight, down_scale), int8_weight_shape(up_weight, up_scale)
    lowrank, with_inject = check_mix_args(streams, norm_weight, down_shape, up_shape, hc_count)
    if down_scale is not None:
        down_weight = dequantize(down_weight, down_scale, 8, down_shape[1], dtype=streams.dtype)
    if up_scale is not None:
        up_weight = dequantize(up_weight, up_scale, 8, up_shape[1], dtype=streams.dtype)
    xf = streams.float().unflatten(-1, (hc_count, -1))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (xf.flatten(-2) * (1.0 + norm_weight.float())).to(streams.dtype)
    projected = F.linear(normed, down_weight)
    low = F.silu(projected[:, :lowrank] / hc_count)
    gates = torch.sigmoid(F.linear(low, up_weight)).unflatten(-1, (hc_count, -1))
    block_input = (gates * normed.unflatten(-1, (hc_count, -1))).mean(dim=-2)
    if not with_inject:
        return block_input, None
    return block_input, 2 * torch.sigmoid(projected[:, lowrank:] / hc_count)


def combine(streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams [N, hc*H] + inject[:, s] * block_output on each stream s."""
    return streams + (block_output.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def combine_and_mix(
    streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor, norm_weight: torch.Tensor,
    down_weight: torch.Tensor, up_weight: torch.Tensor, hc_count: int, eps: float,
    down_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """combine(streams, block_output, inject), then `mix` of the result: (the new streams, block input,
    injection gates or None)."""
    streams = combine(streams, block_output, inject)
    return (streams, *mix(streams, norm_weight, down_weight, up_weight, hc_count, eps, down_scale, up_scale))


def int8_weight_shape(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[int, ...]:
    """The shape [N, K] of the weight `weight` stands for. Without a scale, weight is W itself; with one,
    W is INT8 per channel as compressed-tensors `pack-quantized` stores it (`kernels/quant_linear/packing`):
    int32 words [N, K / 4] (K a multiple of 4), value k of a row at bits 8 (k % 4) of word k // 4, stored
    with a bias of 128, and scales [N, 1]: W[n, k] = (stored - 128) * scale[n]. A clear error for a packed
    weight that is not of that form."""
    if scale is None:
        return tuple(weight.shape)
    rows = weight.shape[0] if weight.dim() == 2 else -1
    if weight.dtype != torch.int32 or rows < 0 or not scale.is_floating_point() or scale.shape != (rows, 1):
        raise ValueError(f"hyper-connection: an INT8 weight must be int32 words [N, K / 4] with float scales "
                         f"[N, 1]; got {weight.dtype} {tuple(weight.shape)}, {scale.dtype} {tuple(scale.shape)}")
    return rows, 4 * weight.shape[1]


def check_mix_args(streams, norm_weight, down_shape, up_shape, hc_count: int) -> tuple[int, bool]:
    """(low rank r, whether the down weight (shape down_shape) carries the hc injection rows); a clear
    error for shapes that do not fit together."""
    if streams.dim() != 2 or streams.shape[1] % hc_count:
        raise ValueError(f"hyper-connection: streams {tuple(streams.shape)} must be [N, hc*H] with hc = {hc_count}")
    width = streams.shape[1]
    down_shape, up_shape = tuple(down_shape), tuple(up_shape)
    lowrank = up_shape[1] if len(up_shape) == 2 else -1
    shapes_fit = (tuple(norm_weight.shape) == (width,) and up_shape == (width, lowrank) and len(down_shape) == 2
                  and down_shape[1] == width and down_shape[0] in (lowrank, lowrank + hc_count))
    if not shapes_fit:
        raise ValueError(f"hyper-connection: for streams [N, {width}] the weights must be norm [{width}], down "
                         f"[r or r + {hc_count}, {width}], up [{width}, r]; got {tuple(norm_weight.shape)}, "
                         f"{down_shape}, {up_shape}")
    return lowrank, down_shape[0] == lowrank + hc_count
