"""3-D M-RoPE positions of a prompt with images (transformers' `get_rope_index`, images only).

Text tokens advance one position on all three axes. A run of image placeholder tokens (one image: its
t*h*w/merge^2 merged features, in merge-block order) starting where the text left off at position s gets
(s + frame, s + row, s + col) over its merged grid, and the text after it resumes at
s + max(h, w)/merge. Past the prompt every token is text: position = index + delta, with
delta = (the prompt's largest position + 1) - prompt length (<= 0 when images are in it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.model.vision.grid import Grid, merged_tokens


@dataclass(frozen=True)
class MropePositions:
    """A request's M-RoPE positions: the prompt's table [3, P] (an empty table: a text request) and the
    offset of every token past it."""

    prompt: torch.Tensor
    delta: int

    @classmethod
    def text(cls) -> MropePositions:
        return cls(torch.zeros(3, 0, dtype=torch.int64), 0)

    @classmethod
    def of_prompt(cls, token_ids: list[int], image_token_id: int, grids: list[Grid], merge: int) -> MropePositions:
        """token_ids: the expanded prompt (each image's placeholders in one run); grids: the images' patch
        grids in prompt order. A run whose length does not fit its grid is a ValueError."""
        ids = torch.tensor(token_ids, dtype=torch.int64)
        is_image = ids == image_token_id
        pieces, position, index, image = [], 0, 0, 0
        while index < len(ids):
            end = index
            while end < len(ids) and is_image[end] == is_image[index]:
                end += 1
            if not is_image[index]:
                pieces.append(torch.arange(position, position + end - index).expand(3, -1))
                position += end - index
            else:
                if image == len(grids):
                    raise ValueError(f"the prompt has more image placeholder runs than the {len(grids)} images given")
                grid = grids[image]
                if end - index != merged_tokens(grid, merge):
                    raise ValueError(f"image {image}: {end - index} placeholder tokens, but its grid {grid} gives "
                                     f"{merged_tokens(grid, merge)}")
                t, h, w = grid[0], grid[1] // merge, grid[2] // merge
                frames, rows, cols = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                pieces.append(torch.stack([frames, rows, cols]).flatten(1) + position)
                position += max(h, w)
                image += 1
            index = end
        if image != len(grids):
            raise ValueError(f"{len(grids)} images given, but the prompt has {image} placeholder runs")
        table = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
        delta = int(table.max()) + 1 - table.shape[1] if table.numel() else 0
        return cls(table, delta)

    def span(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of token indices [start, end)."""
        prompt_len = self.prompt.shape[1]
        inside = self.prompt[:, start:min(end, prompt_len)]
        after = torch.arange(max(start, prompt_len), max(end, prompt_len)) + self.delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)
