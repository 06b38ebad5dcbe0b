"""QSA selection in plain torch: the reference (see the package docstring for shapes)."""

from __future__ import annotations

import torch

from tierlm.kernels.qsa_block_scores.naive import block_of_key, ranking_keys


def top_keys(keys: torch.Tensor, top: int) -> torch.Tensor:
    """The ranking keys [M, K] of each row's K = min(top, G) highest keys [M, G] (higher score first, ties
    to the lower block: `ranking_keys`), in block order. torch.topk unsorted, then a sort of the K only."""
    chosen = torch.topk(keys, min(top, keys.shape[-1]), dim=-1, sorted=False).values
    return chosen.gather(-1, block_of_key(chosen).argsort(dim=-1))


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


def table_groups(scores: torch.Tensor | None, tables: torch.Tensor, ratio: int, block_size: int, top: int) -> int:
    """G, the blocks (compressed keys) a row of `tables` holds; scores may be None only when G <= top
    (both forms' check)."""
    groups = tables.shape[1] * (block_size // ratio)
    if scores is None and groups > top:
        raise ValueError(f"scores are needed: {groups} blocks in the table, {top} chosen")
    return groups


def selection_rows(
    scores: torch.Tensor | None, positions: torch.Tensor, tables: torch.Tensor, ratio: int, block_size: int,
    scratch_block: int, top: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, valid) [M, S]: see the package docstring. scores None: every query chooses all the blocks it
    sees (only when G <= top)."""
    groups = table_groups(scores, tables, ratio, block_size, top)
    if scores is None:
        seen = torch.arange(groups, device=positions.device) < ((positions + 1) // ratio)[:, None]
        scores = torch.zeros(seen.shape, device=positions.device).masked_fill(~seen, float("-inf"))
    token_pos, valid = chosen_positions(top_keys(ranking_keys(scores), top), positions, ratio)
    return physical_rows(token_pos, valid, tables, block_size, scratch_block), valid
