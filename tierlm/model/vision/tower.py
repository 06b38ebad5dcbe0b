"""The Qwen4-Exp vision tower (`model.visual.*`): flattened patches -> merged features of the text width.

patch embed (a Conv3d whose stride is its kernel, run as the linear map it is) + the learned square
position table resampled to each image's grid (`grid.position_table_taps`) -> pre-LN blocks (LayerNorm,
biased qkv, 2-D axial rotary, attention within each frame, proj; LayerNorm, GELU-tanh MLP) -> merger
(LayerNorm per patch, each spatial_merge x spatial_merge block of patches concatenated, Linear, GELU,
Linear to out_hidden_size). Module names mirror the checkpoint, so `model.visual.X` loads into `X`.

Rotary: head_dim/4 frequencies inv_freq_i = theta^(-4i/head_dim); a patch at (row, col) has angles
cat(row * inv_freq, col * inv_freq), repeated twice over the head (rotate-half over the whole head),
applied in fp32 and cast back, as the reference does. The weights are held dense (no quant method).

`stream_from_host` (--mm-encoder-offload) moves every weight to (pinned) host memory; forwards then
stream them to the device unit by unit (`streamed.py`), with bit-identical features.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.config import VisionConfig
from tierlm.kernels.norm_rope.naive import apply_rotary
from tierlm.model.vision.grid import Grid, frame_bounds, patch_coordinates, position_table_taps
from tierlm.model.vision.streamed import StreamedWeights

LAYER_NORM_EPS = 1e-6


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [P, C * tp * p * p] (channel-major, as the processor flattens them) -> [P, hidden]."""
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=True)
        self.proj = nn.Linear(c.hidden_size, c.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: list[tuple[int, int]]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = torch.empty_like(q)
        for start, end in frames:  # bidirectional attention within each frame
            qf, kf, vf = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qf, kf, vf).transpose(0, 1)
        return self.proj(out.flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(c)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=LAYER_NORM_EPS)
        self.mlp = VisionMLP(c)

    def forward(self, x, cos, sin, frames) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        merged = c.hidden_size * c.spatial_merge_size**2
        self.norm = nn.LayerNorm(c.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, c.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, hidden], each block's patches consecutive -> [P / merge^2, out_hidden_size]."""
        merged = self.norm(x).view(-1, self.linear_fc1.in_features)
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        quarter = config.head_dim // 4
        exponents = torch.arange(quarter, dtype=torch.float32, device="cpu") * 4 / config.head_dim  # not on meta
        self.inv_freq = 1.0 / config.rope_theta**exponents
        self.streamed: StreamedWeights | None = None  # --mm-encoder-offload: the weights in host memory

    def units(self) -> list[nn.Module]:
        """The modules a forward runs, in its order, each once (what a streamed tower copies one at a time)."""
        return [self.patch_embed, self.pos_embed, *self.blocks, self.merger]

    def stream_from_host(self, device: torch.device | str) -> None:
        """Move every weight to host memory (pinned on CUDA); forwards then compute on `device`, each unit's
        weights copied there one unit ahead of its compute. The caller frees the device's cached blocks."""
        self.streamed = StreamedWeights(self.units(), device)

    @property
    def device(self) -> torch.device:
        """Where the tower computes (its inputs go there)."""
        return self.streamed.device if self.streamed is not None else self.pos_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """patches [P, patch_values] of the images whose grids are `grids` (in order) -> features
        [sum of t*h*w/merge^2, out_hidden_size], each image's rows consecutive in its merge-block order."""
        c = self.config
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape != (expected, c.patch_values):
            raise ValueError(f"patches: expected [{expected}, {c.patch_values}] for grids {grids}, got "
                             f"{list(patches.shape)}")
        with self._weights() as run:  # run(unit, *args): the unit called with its weights on the device
            x = run(self.patch_embed, patches)
            x = x + self.positions(grids, x.device, run).to(x.dtype)
            cos, sin = self.rotary(grids, x.device)
            frames = frame_bounds(grids)
            for block in self.blocks:
                x = run(block, x, cos, sin, frames)
            return run(self.merger, x)

    @contextmanager
    def _weights(self):
        if self.streamed is not None:
            with self.streamed.session() as run:
                yield run
        else:
            yield lambda unit, *args: unit(*args)

    def positions(self, grids: list[Grid], device: torch.device, run) -> torch.Tensor:
        """The learned position embedding of every patch [P, hidden] (fp32): four weighted table rows."""
        indices, weights = position_table_taps(grids, self.config.spatial_merge_size, self.config.position_grid_side)
        rows = run(self.pos_embed, indices.to(device)).float()
        return (rows * weights.to(device)[..., None]).sum(1)

    def rotary(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] (fp32) of every patch's (row, col)."""
        coords = patch_coordinates(grids, self.config.spatial_merge_size).to(device).float()
        angles = (coords[:, :, None] * self.inv_freq.to(device)).flatten(1)  # [P, head_dim/2]: rows then cols
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()
