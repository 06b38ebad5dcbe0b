"""The indexer rings after each verified row, in torch ops (see the package docstring)."""

from __future__ import annotations

import torch

from tierlm.kernels.qsa_block_keys.naive import group_key_rows


def ring_after_rows(
    ring: torch.Tensor, slots: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor,
    context_lens: torch.Tensor, state_slots: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    scratch_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    requests, width = state_slots.shape
    r = ring.shape[1]
    context = context_lens[:, None, None]  # [B, 1, 1]
    source = torch.cat([ring[slots], raw_keys.view(requests, width, -1)], dim=1)  # [B, R+T, id]
    positions = positions.view(requests, width)
    offset = positions % r
    starts = positions - offset  # [B, T]: the first position of each row's open group
    held = starts[..., None] + torch.arange(r, device=raw_keys.device)  # [B, T, R]: positions of its entries
    # an entry before the context is in the ring (at its offset), the others are rows of this batch;
    # entries past the row's position are never read (clamped into range)
    index = torch.where(held < context, held % r, r + held - context).clamp_(max=r + width - 1)
    rings = source.gather(1, index.view(requests, width * r, 1).expand(-1, -1, source.shape[-1]))
    rings = rings.view(requests * width, r, -1)
    ring.index_copy_(0, state_slots.flatten(), rings)
    rows = group_key_rows(block_tables, starts, offset == r - 1, block_size, r, scratch_block)
    return rings, rows.flatten()
