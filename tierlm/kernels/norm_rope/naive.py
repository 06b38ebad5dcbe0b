"""Torch reference of the fused norm + rotary (the math of `model.layers.norm.RMSNorm` then
`apply_rotary`, which the model's rotary module takes from here)."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX rotary: x [N, heads, D]; cos/sin [N, rotary_dim] (rotary_dim <= D); rotate-half on the
    first rotary_dim dims, the rest pass through."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """See the package docstring for shapes."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    return apply_rotary(normed, cos, sin)
