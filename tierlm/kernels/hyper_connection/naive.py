"""Hyper-connections' mix and combine in plain torch: the reference (see the package docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mix(
    streams: torch.Tensor, norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
    hc_count: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [N, hc*H] -> (block input [N, H], injection gates [N, hc] or None)."""
    lowrank, with_inject = check_mix_args(streams, norm_weight, down_weight, up_weight, hc_count)
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


def check_mix_args(streams, norm_weight, down_weight, up_weight, hc_count: int) -> tuple[int, bool]:
    """(low rank r, whether down_weight carries the hc injection rows); a clear error for shapes that
    do not fit together."""
    if streams.dim() != 2 or streams.shape[1] % hc_count:
        raise ValueError(f"hyper-connection: streams {tuple(streams.shape)} must be [N, hc*H] with hc = {hc_count}")
    width = streams.shape[1]
    lowrank = up_weight.shape[1] if up_weight.dim() == 2 else -1
    shapes_fit = (norm_weight.shape == (width,) and up_weight.shape == (width, lowrank) and down_weight.dim() == 2
                  and down_weight.shape[1] == width and down_weight.shape[0] in (lowrank, lowrank + hc_count))
    if not shapes_fit:
        raise ValueError(f"hyper-connection: for streams [N, {width}] the weights must be norm [{width}], down "
                         f"[r or r + {hc_count}, {width}], up [{width}, r]; got {tuple(norm_weight.shape)}, "
                         f"{tuple(down_weight.shape)}, {tuple(up_weight.shape)}")
    return lowrank, down_weight.shape[0] == lowrank + hc_count
