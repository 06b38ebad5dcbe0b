"""Torch reference of QSA prefill attention: gather the selected rows, then masked SDPA (the torch path)."""

from __future__ import annotations

import torch

from tierlm.kernels.qsa_row_cache.naive import attend_rows


def sparse_attention(
    q: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See the package docstring for shapes. Copies K and V of every (query, row) pair."""
    return attend_rows(q, key_rows[rows], value_rows[rows], valid, scale)
