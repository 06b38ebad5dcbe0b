"""What follows from each image's patch grid alone (no weights): the vision tower's per-patch inputs.

A grid is (t, h, w): t temporal patches (1 for an image), h x w spatial patches. The image processor
emits patches block-major over spatial_merge_size x spatial_merge_size blocks (the 2x2 patches the merger
joins are consecutive), so every per-patch quantity here is laid out in that order too.
"""

from __future__ import annotations

import torch

Grid = tuple[int, int, int]


def patch_coordinates(grids: list[Grid], merge: int) -> torch.Tensor:
    """(row, col) of every patch [P, 2], block-major within each frame, frames repeating their grid."""
    coords = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        frame = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
        coords.append(frame.repeat(t, 1))
    return torch.cat(coords)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear interpolation (align_corners) of `size` points onto a table axis of `side` entries: the two
    table entries [n, 2] each point reads and their weights [n, 2]."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    low = source.floor()
    frac = source - low
    taps = torch.stack([low, low + 1], dim=-1).long().clamp(0, side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)


def position_table_taps(grids: list[Grid], merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The learned side x side position table resampled (bilinear, align_corners) to each image's h x w
    grid, as four table rows [P, 4] per patch and their weights [P, 4]: embedding = sum of weighted rows."""
    indices, weights = [], []
    coords = patch_coordinates(grids, merge)
    start = 0
    for t, h, w in grids:
        rows, cols = coords[start : start + t * h * w].unbind(-1)
        start += t * h * w
        row_taps, row_weights = _axis_taps(rows, h, side)
        col_taps, col_weights = _axis_taps(cols, w, side)
        indices.append((row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1))
        weights.append((row_weights[:, :, None] * col_weights[:, None, :]).flatten(1))
    return torch.cat(indices), torch.cat(weights)


def frame_bounds(grids: list[Grid]) -> list[tuple[int, int]]:
    """[start, end) patch rows of every frame: attention runs within a frame, never across images."""
    bounds, start = [], 0
    for t, h, w in grids:
        for _ in range(t):
            bounds.append((start, start + h * w))
            start += h * w
    return bounds


def merged_tokens(grid: Grid, merge: int) -> int:
    """Features (prompt tokens) one image gives after the merger: t * h * w / merge^2."""
    t, h, w = grid
    return t * h * w // (merge * merge)
