"""The indexer's decode key store in plain torch: the reference (see the package docstring for shapes)."""

from __future__ import annotations

import torch

from tierlm.kernels.norm_rope.naive import norm_rope_at


def group_key_rows(block_tables: torch.Tensor, starts: torch.Tensor, closes: torch.Tensor | bool, block_size: int,
                   ratio: int, scratch_block: int) -> torch.Tensor:
    """Rows of the compressed-key pool viewed [-1, id] that get the keys of the groups starting at `starts`
    [B, T] (request b's positions, its table block_tables[b]): where the group closes (`closes` [B, T], or
    True for every one), its row in the table's block holding the start; else the scratch block's first row
    (a key of a group still open is never read). A closing group's block is always in its table; were it
    not (-1), the scratch block, never a row outside the pool. (`triton.group_key_row`: the kernels' form;
    `kernels/qsa_ring` and the layer's torch paths take them too.)"""
    per_block = block_size // ratio
    block = block_tables.gather(1, starts // block_size)
    return torch.where(closes & (block >= 0), block * per_block + (starts % block_size) // ratio,
                       scratch_block * per_block)


def store_decode_block_keys(
    raw_keys: torch.Tensor, ring: torch.Tensor, index_keys: torch.Tensor, slots: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, weight: torch.Tensor, eps: float,
    inv_freq: torch.Tensor, block_size: int, scratch_block: int,
) -> None:
    """See the package docstring."""
    r = ring.shape[1]
    offset = context_lens % r
    ring[slots, offset] = raw_keys
    starts = context_lens - offset  # the open group's first position
    group = ring[slots]
    pooled = group.float().mean(dim=1).to(group.dtype)
    keys = norm_rope_at(pooled.unsqueeze(1), weight, eps, starts, inv_freq).squeeze(1)
    row = group_key_rows(block_tables, starts[:, None], (offset == r - 1)[:, None], block_size, r, scratch_block)
    index_keys.view(-1, index_keys.shape[-1])[row[:, 0]] = keys
