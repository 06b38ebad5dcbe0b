"""Rotary tables: cos/sin per position (applied by `kernels/norm_rope`: partial NeoX, rotate-half on the
first `rotary_dim` dims, the rest pass through).

For text the reference's interleaved M-RoPE has identical T/H/W positions, which makes it plain 1-D RoPE.
cos/sin are computed in fp32 and cast to the activation dtype, as the reference does.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))
        self._on_device: dict[torch.device, torch.Tensor] = {}  # no host copy inside a forward

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [N, rotary_dim] for positions [N]."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Rope:
    """The rotary tables of one forward: cos/sin at the tokens' positions, computed once here for every
    attention layer (not once per layer), and at other positions (the indexer's block starts) on demand."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.dtype = rotary, dtype
        self.cos, self.sin = rotary.cos_sin(positions, dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions, self.dtype)
