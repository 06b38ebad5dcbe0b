"""The torch reference for `quant_linear`: dequantize the whole weight, then F.linear in x's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.kernels.quant_linear.packing import dequantize


def check_weight(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bits: int | None) -> None:
    """The checks both forms share (the packed layout itself is checked by `packing.check_packed`)."""
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if (bits is None) != (scales is None):
        raise ValueError("a packed weight needs both bits and scales; an unquantized one neither")
    if bits is None:
        if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
            raise ValueError(f"weight {tuple(weight.shape)} is not [N, K={x.shape[-1]}]")
        if weight.dtype != x.dtype:
            raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    elif weight.dim() != 2:
        raise ValueError(f"packed weight must be [N, words], got {tuple(weight.shape)}")


def quant_linear(x: torch.Tensor, weight_or_packed: torch.Tensor, *, scales: torch.Tensor | None = None,
                 bits: int | None = None, group_size: int | None = None) -> torch.Tensor:
    """y = x W^T for x [..., K] -> [..., N] in x's dtype.

    Unquantized: weight_or_packed is W [N, K] in x's dtype (scales, bits, group_size None).
    Quantized: weight_or_packed is the packed int32 [N, ceil(K * bits / 32)], scales [N, K / group_size]
    (or [N, 1]), bits 4 / 6 / 8; group_size defaults to what the scales imply (see `packing`)."""
    check_weight(x, weight_or_packed, scales, bits)
    if bits is None:
        return F.linear(x, weight_or_packed)
    w = dequantize(weight_or_packed, scales, bits, x.shape[-1], group_size, dtype=x.dtype)
    return F.linear(x, w)
