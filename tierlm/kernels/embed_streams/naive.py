"""Torch reference of `embed_streams` (see the package docstring): the gather, then the streams' copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.kernels.quant_linear import packing


def check_args(table: torch.Tensor, ids: torch.Tensor, hc_count: int, scales: torch.Tensor | None = None) -> int:
    """Validate the arguments; returns the hidden width H (4 values a word for an INT8 table)."""
    if table.dim() != 2:
        raise ValueError(f"embed_streams: table must be [V, H] (INT8: [V, H / 4] words), got {tuple(table.shape)}")
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"embed_streams: ids must be [N] int64, got {tuple(ids.shape)} {ids.dtype}")
    if hc_count < 1:
        raise ValueError(f"embed_streams: hc_count must be >= 1, got {hc_count}")
    if scales is None:
        return table.shape[1]
    if table.dtype != torch.int32 or not scales.is_floating_point() or scales.shape != (table.shape[0], 1):
        raise ValueError(f"embed_streams: an INT8 table must be int32 words [V, H / 4] with float scales [V, 1]; "
                         f"got {table.dtype} {tuple(table.shape)}, {scales.dtype} {tuple(scales.shape)}")
    return 4 * table.shape[1]


def embed_streams(table: torch.Tensor, ids: torch.Tensor, hc_count: int,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    hidden = check_args(table, ids, hc_count, scales)
    if scales is None:
        rows = F.embedding(ids, table)
    else:
        rows = packing.dequantize(table.index_select(0, ids), scales.index_select(0, ids), 8, hidden)
    return rows.repeat(1, hc_count)
