"""Rotary tables: cos/sin per position (applied by `kernels/norm_rope`: partial NeoX, rotate-half on the
first `rotary_dim` dims, the rest pass through).

The reference's rotary is interleaved M-RoPE: each row has a (t, h, w) position, and rotary frequency i
takes the H position if i % 3 == 1 and i < 3 * mrope_section[1], the W position if i % 3 == 2 and
i < 3 * mrope_section[2], else the T position. Text rows have t = h = w, which makes it plain 1-D RoPE
(the only form a batch without images computes); image tokens get their grid's positions
(`model/vision/mrope.py`). cos/sin are computed in fp32 and cast to the activation dtype, as the
reference does (`kernels/norm_rope.naive.rotary_cos_sin`); kernels that take a text batch's positions and
the inverse frequencies compute the same angles themselves.
"""

from __future__ import annotations

from functools import cached_property

import torch

from tierlm.kernels.norm_rope.naive import rotary_cos_sin


class RotaryEmbedding:
    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int] = (11, 11, 10)) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))
        freq = torch.arange(rotary_dim // 2, device="cpu")
        self.axis_of_freq = torch.zeros_like(freq)  # 0: T, 1: H, 2: W
        for axis in (1, 2):
            self.axis_of_freq[(freq % 3 == axis) & (freq < 3 * mrope_section[axis])] = axis
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # no host copy in a forward

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse frequencies [rotary_dim / 2] and each one's M-RoPE axis, on `device` (copied once)."""
        tables = self._on_device.get(device)
        if tables is None:
            tables = self._on_device[device] = (self.inv_freq.to(device), self.axis_of_freq.to(device))
        return tables

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [N, rotary_dim] for positions [N]."""
        return rotary_cos_sin(positions, self.tables(positions.device)[0], dtype)

    def mrope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [N, rotary_dim] for (t, h, w) positions [3, N]."""
        inv_freq, axis = self.tables(positions.device)
        freqs = positions.float()[:, :, None] * inv_freq  # [3, N, rotary_dim / 2]
        freqs = freqs.gather(0, axis.expand(1, positions.shape[1], -1)).squeeze(0)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Rope:
    """The rotary tables of one forward: cos/sin at the batch's rows, computed once for every attention
    layer (not once per layer) when a layer first asks, and at other token indices (the indexer's block
    starts) on demand. A text batch also offers its 1-D `positions` and `inv_freq`, from which fused
    kernels compute the angles themselves (then no table is computed at all); an M-RoPE batch
    (`ForwardBatch.mrope_positions`; `positions` None) takes a block start's (t, h, w) from its row, or,
    for the group still open when the forward began, from `mrope_group_starts`.
    `group_starts_at`: cos/sin at each row's indexer group start, once per forward for all QSA layers; and,
    not rotary but made once per forward for all QSA layers as well, a verification batch's block tables one
    per row (`verify_row_tables`). A Rope is shared only by forwards over the same rows and block tables
    (the verify forward and the draft head's pass over it, `GreedySpeculation`)."""

    def __init__(self, rotary: RotaryEmbedding, batch, dtype: torch.dtype) -> None:
        self.rotary, self.dtype, self.batch = rotary, dtype, batch
        self._group_starts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.positions = batch.positions if batch.mrope_positions is None else None
        self.inv_freq = rotary.tables(batch.positions.device)[0]
        if batch.mrope_positions is not None:
            starts = [start for start, _ in batch.bounds]
            self.first_rows = torch.tensor(starts, dtype=torch.int64).to(batch.positions.device)

    @cached_property
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch
        if batch.mrope_positions is None:
            return self.rotary.cos_sin(batch.positions, self.dtype)
        return self.rotary.mrope_cos_sin(batch.mrope_positions, self.dtype)

    @property
    def cos(self) -> torch.Tensor:
        """cos [N, rotary_dim] at the batch's rows."""
        return self._rows[0]

    @property
    def sin(self) -> torch.Tensor:
        """sin [N, rotary_dim] at the batch's rows."""
        return self._rows[1]

    @cached_property
    def verify_row_tables(self) -> torch.Tensor:
        """The verification batch's block tables one per row [B*T, W] (`ForwardBatch.verify_row_tables`),
        copied by the first QSA layer of the forward that asks."""
        return self.batch.verify_row_tables()

    def group_starts_at(self, ratio: int, rows_per_request: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at each of the batch's rows' indexer group start (its position rounded down to a multiple
        of `ratio`; `at`'s rows_per_request), computed by the first QSA layer of the forward that asks."""
        key = ratio, rows_per_request
        if key not in self._group_starts:
            positions = self.batch.positions
            self._group_starts[key] = self.at(positions - positions % ratio, rows_per_request=rows_per_request)
        return self._group_starts[key]

    def at(
        self, positions: torch.Tensor, request: int | None = None, rows_per_request: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at token indices `positions` [K]: all of batch request `request`, or (None) the first
        `rows_per_request` of them request 0's, the next request 1's, and so on."""
        batch = self.batch
        if batch.mrope_positions is None:
            return self.rotary.cos_sin(positions, self.dtype)
        if request is None:
            requests = torch.arange(positions.shape[0], device=positions.device) // rows_per_request
        else:
            requests = torch.full_like(positions, request)
        context = batch.context_lens_tensor[requests]
        rows = (self.first_rows[requests] + positions - context).clamp(0, batch.mrope_positions.shape[1] - 1)
        in_batch = (positions >= context)[None, :]
        grid = torch.where(in_batch, batch.mrope_positions[:, rows], batch.mrope_group_starts[:, requests])
        return self.rotary.mrope_cos_sin(grid, self.dtype)
