"""QSA selection in plain torch: the reference (see the package docstring for shapes)."""

from __future__ import annotations

import torch

from tierlm.kernels.qsa_block_scores.naive import block_of_key


def chosen_positions(top_keys: torch.Tensor, positions: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions [M, S] each query attends to and their validity: its top blocks' tokens, then its
    open tail [nb*R, p]."""
    r = ratio
    in_block = torch.arange(r, device=top_keys.device)
    chosen_pos = (block_of_key(top_keys)[..., None] * r + in_block).flatten(1)
    chosen_ok = (top_keys >= 0)[..., None].expand(-1, -1, r).flatten(1)
    tail_pos = ((positions + 1) // r * r)[:, None] + in_block[: r - 1]
    return torch.cat([chosen_pos, tail_pos], dim=1), torch.cat([chosen_ok, tail_pos <= positions[:, None]], dim=1)


def physical_rows(
    token_pos: torch.Tensor, valid: torch.Tensor, tables: torch.Tensor, block_size: int, scratch_block: int
) -> torch.Tensor:
    """Each valid token position's pool row through its query's block table; invalid: the scratch row."""
    bs = block_size
    tables = torch.where(tables < 0, scratch_block, tables)
    block = tables.gather(1, torch.clamp(token_pos // bs, max=tables.shape[1] - 1))
    return torch.where(valid, block * bs + token_pos % bs, scratch_block * bs)


def selection_rows(
    top_keys: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, ratio: int, block_size: int,
    scratch_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, valid) [M, S]: see the package docstring."""
    token_pos, valid = chosen_positions(top_keys, positions, ratio)
    return physical_rows(token_pos, valid, tables, block_size, scratch_block), valid
