"""`PackedLinear`: several checkpoint projections of the same input stacked into one weight.

Projections that read the same activations (GDN's q|k|v, z, b, a; a hyper-connection's mixer and
injection gates; the router and the shared-expert gate) run as one matrix product instead of several:
at decode, each small GEMV costs more in launch and dispatch than in arithmetic. The checkpoint keeps
them apart; `packed_rows` tells the loader which rows each checkpoint tensor fills.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        """parts: checkpoint name (relative to the parent module) -> output rows, in packing order."""
        super().__init__()
        self.part_names = list(parts)
        self.part_sizes = list(parts.values())
        self.weight = nn.Parameter(torch.empty(sum(self.part_sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.part_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.part_sizes, dim=-1)

    def packed_rows(self) -> dict[str, tuple[int, int]]:
        """checkpoint part name -> (first row, end row) in the packed weight."""
        rows, start = {}, 0
        for name, size in zip(self.part_names, self.part_sizes):
            rows[name] = (start, start + size)
            start += size
        return rows
