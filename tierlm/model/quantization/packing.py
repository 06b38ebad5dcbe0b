"""Bit packing of low-bit integers into int32 words, as the two checkpoint formats lay them out.

- compressed-tensors `pack_to_int32` (pack_quantized/helpers.py): along one dimension, value i of a row
  occupies bits [i * bits, (i + 1) * bits) of the row's bit stream, LSB first, split across words where
  it straddles one (6 bits: 32 values in 6 words). A row of K values takes ceil(K * bits / 32) words.
- GPTQ / AutoRound `auto_gptq`: 32 // bits whole values per word, value j of a word at bits
  [j * bits, (j + 1) * bits); only bit widths that divide 32 (2, 4, 8). For those the layout is the
  same bit stream as above, so one pair of functions serves both, along any dimension.

Values are unsigned (0 .. 2^bits - 1); the formats' biases and zero points are applied by the callers.
"""

from __future__ import annotations

import math

import torch


def packed_length(count: int, bits: int) -> int:
    """int32 words that hold `count` values of `bits` bits."""
    return math.ceil(count * bits / 32)


def pack_int32(values: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Unsigned integers in [0, 2^bits) -> int32 words packed densely along `dim`, LSB first."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack into {bits} bits")
    moved = values.movedim(dim, -1).to(torch.int64)
    count = moved.shape[-1]
    words = packed_length(count, bits)
    position = torch.arange(count, device=values.device) * bits
    word, shift = position // 32, position % 32
    out = torch.zeros(*moved.shape[:-1], words + 1, dtype=torch.int64, device=values.device)
    # the fields never overlap, so adding places them; the bits above 31 spill into the next word
    out.index_add_(-1, word, (moved << shift) & 0xFFFFFFFF)
    out.index_add_(-1, word + 1, moved >> (32 - shift))
    out = out[..., :words]
    signed = torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)
    return signed.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, count: int, dim: int = -1) -> torch.Tensor:
    """int32 words -> the first `count` unsigned values packed along `dim` (int32)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    moved = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    if moved.shape[-1] != packed_length(count, bits):
        raise ValueError(
            f"{moved.shape[-1]} words cannot hold exactly {count} values of {bits} bits "
            f"(that takes {packed_length(count, bits)})"
        )
    position = torch.arange(count, device=words.device) * bits
    word, shift = position // 32, position % 32
    moved = torch.cat([moved, torch.zeros_like(moved[..., :1])], dim=-1)  # the word after the last
    pairs = moved[..., word] | (moved[..., word + 1] << 32)
    values = ((pairs >> shift) & ((1 << bits) - 1)).to(torch.int32)
    return values.movedim(-1, dim)
