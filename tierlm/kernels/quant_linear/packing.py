"""The packed integer weight format the low-bit kernels read: compressed-tensors `pack-quantized`.

A weight W [N, K] quantized symmetrically to `bits` (4, 6 or 8) with one scale per `group_size`
consecutive input columns is stored as
  weight_packed int32 [N, ceil(K * bits / 32)]: row n's K values packed densely along K, value k at
      bits [k * bits, (k + 1) * bits) of the row's bit stream, LSB first: word k * bits // 32, shift
      k * bits % 32. For 4 and 8 bits a word holds 32 / bits whole values (value j of a word at bits
      [j * bits, (j + 1) * bits)); 6-bit values straddle words (16 values in 3 words).
  weight_scale [N, K / group_size] (or [N, 1]: one scale per output channel),
each value stored unsigned with a bias of 2^(bits-1): w = (q - 2^(bits-1)) * scale, q in [0, 2^bits).
This is what compressed-tensors' `pack_to_int32` / `unpack_from_int32` (pack_quantized/helpers.py, v0.20)
write and read for packed_dim=1: the int8 value plus the offset, shifted to bit position i * bits of the
row and split across int32 words where it straddles. Stacked MoE experts add a leading expert dimension
([E, N, ceil(K * bits / 32)] and [E, N, K / group_size]).

This module owns the format in plain torch: checks, packing, unpacking and dequantizing (the kernels'
references use it), and a round-to-nearest quantizer that tests and benchmarks use to make packed weights
(the checkpoint quantizer with its clip search lives elsewhere).
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (4, 6, 8)


def packed_width(k: int, bits: int) -> int:
    """int32 words per row of K packed values."""
    return math.ceil(k * bits / 32)


def check_packed(packed: torch.Tensor, scales: torch.Tensor, bits: int, k: int, group_size: int | None) -> int:
    """Validate a packed weight [..., N, words] and its scales [..., N, groups] for K input columns;
    returns the group size (K for one scale per channel). group_size None: taken from the scales."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weight must be int32, got {packed.dtype}")
    if packed.shape[-1] != packed_width(k, bits):
        raise ValueError(f"packed weight has {packed.shape[-1]} words per row; {k} values of {bits} bits "
                         f"need {packed_width(k, bits)}")
    if scales.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed weight {tuple(packed.shape)} "
                         "(expected one row of scales per output row)")
    if not scales.is_floating_point():
        raise ValueError(f"scales must be floating point, got {scales.dtype}")
    groups = scales.shape[-1]
    if group_size is None:
        if groups == 0 or k % groups:
            raise ValueError(f"{groups} scale columns do not divide K={k} into equal groups")
        group_size = k // groups
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={k}")
    if groups != k // group_size:
        raise ValueError(f"scales have {groups} columns; K={k} in groups of {group_size} needs {k // group_size}")
    return group_size


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [..., K] in [0, 2^bits) -> int32 words [..., ceil(K * bits / 32)], densely, LSB first."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if values.numel() and (values.min() < 0 or values.max() >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits}) to pack into {bits} bits")
    k = values.shape[-1]
    words = packed_width(k, bits)
    positions = torch.arange(k, device=values.device) * bits  # bit position of each value in its row
    word, shift = positions // 32, positions % 32
    v = values.to(torch.int64)
    out = torch.zeros(*values.shape[:-1], words + 1, dtype=torch.int64, device=values.device)
    # bit fields never overlap, so adding places them; the part above bit 31 goes to the next word
    out.index_add_(-1, word, (v << shift) & 0xFFFFFFFF)
    out.index_add_(-1, word + 1, v >> (32 - shift))  # shift 0: v >> 32 == 0
    out = out[..., :words]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 words [..., W] -> the K unsigned values [..., K] (int32) they hold."""
    positions = torch.arange(k, device=packed.device) * bits
    word, shift = positions // 32, positions % 32
    words = packed.to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[..., :1])], dim=-1)  # the word after the last
    combined = words[..., word] | (words[..., word + 1] << 32)
    return ((combined >> shift) & ((1 << bits) - 1)).to(torch.int32)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, k: int, group_size: int | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Packed weight [..., N, W] + scales [..., N, K / group] -> W [..., N, K] in dtype (default: the
    scales' dtype). (q - 2^(bits-1)) * scale is formed in fp32 (exact: a small integer times the scale),
    then rounded once to dtype, as the kernels do in registers."""
    group_size = check_packed(packed, scales, bits, k, group_size)
    q = unpack(packed, bits, k) - (1 << (bits - 1))
    w = q.float() * scales.float().repeat_interleave(group_size, dim=-1)
    return w.to(dtype or scales.dtype)


def quantize(weight: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric quantization of W [..., N, K] -> (packed int32, scales [..., N, K / group]).
    scale = max|w| / (2^(bits-1) - 1) per group (as llm-compressor's minmax observer for symmetric ints)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    k = weight.shape[-1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K={k}")
    grouped = weight.float().unflatten(-1, (k // group_size, group_size))
    qmax = (1 << (bits - 1)) - 1
    scales = (grouped.abs().amax(dim=-1) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    scales = scales.to(scale_dtype or weight.dtype)
    q = torch.round(grouped / scales.float().unsqueeze(-1)).clamp(-qmax - 1, qmax).flatten(-2)
    return pack(q.to(torch.int64) + (1 << (bits - 1)), bits), scales
