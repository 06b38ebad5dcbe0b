"""The indexer's decode key store in plain torch: the reference (see the package docstring for shapes)."""

from __future__ import annotations

import torch

from tierlm.kernels.norm_rope.naive import norm_rope_at


def store_decode_block_keys(
    raw_keys: torch.Tensor, ring: torch.Tensor, index_keys: torch.Tensor, slots: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, weight: torch.Tensor, eps: float,
    inv_freq: torch.Tensor, block_size: int, scratch_block: int,
) -> None:
    """See the package docstring."""
    r, bs = ring.shape[1], block_size
    offset = context_lens % r
    ring[slots, offset] = raw_keys
    starts = context_lens - offset  # the open group's first position
    group = ring[slots]
    pooled = group.float().mean(dim=1).to(group.dtype)
    keys = norm_rope_at(pooled.unsqueeze(1), weight, eps, starts, inv_freq).squeeze(1)
    block = block_tables.gather(1, (starts // bs)[:, None]).squeeze(1)
    row = torch.where(offset == r - 1, block * (bs // r) + (starts % bs) // r, scratch_block * (bs // r))
    index_keys.view(-1, index_keys.shape[-1])[row] = keys
