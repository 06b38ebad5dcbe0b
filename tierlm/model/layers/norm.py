"""The three normalisations of Qwen4-Exp (there are no pre-layer norms: hyper-connections own them).

- `RMSNorm`: Gemma style, y = x * rsqrt(mean(x^2) + eps) * (1 + w) computed in fp32 and cast back;
  with `group_size` the vector is normalised in independent groups (one per hyper-connection stream).
- `GatedRMSNorm`: GDN output, y = w * norm(x) (cast to dtype first) * act(z) with a plain weight.
- `l2norm`: GDN q/k, x * rsqrt(sum(x^2) + 1e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, group_size: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.group_size is not None:
            xf = xf.unflatten(-1, (-1, self.group_size))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group_size is not None:
            xf = xf.flatten(-2)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, activation: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = F.silu if activation == "silu" else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * self.activation(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6, scale: float = 1.0) -> torch.Tensor:
    """scale * x * rsqrt(sum(x^2) + eps), as one fused rms_norm: x * rsqrt(mean(x^2) + eps/d) / sqrt(d)."""
    d = x.shape[-1]
    return F.rms_norm(x, (d,), eps=eps / d) * (scale * d**-0.5)
