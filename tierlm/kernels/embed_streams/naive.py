"""Torch reference of `embed_streams` (see the package docstring): the gather, then the streams' copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_args(table: torch.Tensor, ids: torch.Tensor, hc_count: int) -> None:
    if table.dim() != 2:
        raise ValueError(f"embed_streams: table must be [V, H], got {tuple(table.shape)}")
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"embed_streams: ids must be [N] int64, got {tuple(ids.shape)} {ids.dtype}")
    if hc_count < 1:
        raise ValueError(f"embed_streams: hc_count must be >= 1, got {hc_count}")


def embed_streams(table: torch.Tensor, ids: torch.Tensor, hc_count: int) -> torch.Tensor:
    check_args(table, ids, hc_count)
    return F.embedding(ids, table).repeat(1, hc_count)
