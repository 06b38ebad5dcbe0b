"""Torch reference of the fused norm + rotary (the math of `model.layers.norm.RMSNorm` then
`apply_rotary`, which the model's rotary module takes from here, with its cos/sin: `rotary_cos_sin`)."""

from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, rd] of 1-D positions [N] for inverse frequencies [rd / 2]: angles in fp32 (frequency i
    at columns i and i + rd/2), cast to dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


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


def norm_rope_at(
    x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """`norm_rope` at positions [N] (cos/sin from `rotary_cos_sin`)."""
    return norm_rope(x, weight, eps, *rotary_cos_sin(positions, inv_freq, x.dtype))


def norm_rope_kv_write(
    keys: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
    values: torch.Tensor, rows: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
) -> None:
    """New tokens' keys [N, nkv, hd] normed and roped at positions [N] into key_rows[rows], their values
    [N, nkv, hd] into value_rows[rows] (pools [R, nkv, hd]; rows [N] int64)."""
    key_rows[rows] = norm_rope_at(keys, weight, eps, positions, inv_freq)
    value_rows[rows] = values
