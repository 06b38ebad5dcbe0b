"""QSA decode block scores in plain torch: the reference (see the package docstring for shapes)."""

from __future__ import annotations

import math

import torch


def block_scores(
    q: torch.Tensor, index_keys: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Scores [B, G] of each query q [B, ih, id] against every compressed key of its block table; groups
    j >= (p+1)//R (not complete yet, or past the table's end) score -inf."""
    keys = index_keys[block_tables.clamp_min(0)].flatten(1, 2)  # [B, G, id]; -1 entries read block 0, masked
    products = torch.einsum("mhd,mgd->mhg", q.float(), keys.float())
    scores = torch.relu(products).sum(dim=1) / math.sqrt(q.shape[-1])
    groups = torch.arange(scores.shape[1], device=q.device)
    return scores.masked_fill(groups >= ((positions + 1) // ratio)[:, None], float("-inf"))
