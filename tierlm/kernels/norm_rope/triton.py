"""The fused norm + rotary as one Triton launch (same signature as `naive.norm_rope`; the package
docstring has the shapes and the rounding). Triton's CPU interpreter truncates fp32 -> bf16 casts
instead of rounding them, so there the kernel keeps every step in fp32 and torch rounds its fp32 output
once (the same function of the inputs, without the intermediate roundings)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, x_stride_n, x_stride_h, eps,
                      HEADS: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr,
                      ROUND: tl.constexpr):
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    columns = tl.arange(0, BLOCK_D)
    inside = columns < D
    half = RD // 2
    # the element each column's rotate-half pairs with (itself past the rotary dims)
    partner = tl.where(columns < half, columns + half, tl.where(columns < RD, columns - half, columns))
    row = x_ptr + token * x_stride_n + head * x_stride_h
    x = tl.load(row + columns, mask=inside, other=0.0)
    dtype = x.dtype if ROUND else tl.float32
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd * (1.0 + tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32))).to(dtype)
    xp = tl.load(row + partner, mask=inside, other=0.0).to(tl.float32)
    paired = (xp * rstd * (1.0 + tl.load(weight_ptr + partner, mask=inside, other=0.0).to(tl.float32))).to(dtype)
    paired = tl.where(columns < half, -paired.to(tl.float32), paired.to(tl.float32)).to(dtype)
    rotary = columns < RD
    cos = tl.load(cos_ptr + token * RD + columns, mask=rotary, other=1.0)
    sin = tl.load(sin_ptr + token * RD + columns, mask=rotary, other=0.0)
    # rot * cos + rotated * sin with each product and the sum rounded to x's dtype, as torch computes it
    turned = ((normed.to(tl.float32) * cos.to(tl.float32)).to(dtype).to(tl.float32)
              + (paired.to(tl.float32) * sin.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    out = tl.where(rotary, turned, normed)
    tl.store(out_ptr + (token * HEADS + head) * D + columns, out, mask=inside)


def triton_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """As `naive.norm_rope`, in one launch; no host sync (a CUDA graph captures it)."""
    n, heads, dim = x.shape
    rd = cos.shape[-1]
    if x.stride(2) != 1:
        raise ValueError("x's last dim must be contiguous")
    if rd % 2 or rd > dim or cos.shape != (n, rd) or sin.shape != (n, rd):
        raise ValueError(f"cos/sin must be [{n}, rd] with rd even and <= {dim}, got {tuple(cos.shape)}")
    interpreted = x.device.type == "cpu"
    out = torch.empty(n, heads, dim, dtype=torch.float32 if interpreted else x.dtype, device=x.device)
    if n:
        _norm_rope_kernel[(n, heads)](
            x, weight, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), eps, HEADS=heads, D=dim,
            RD=rd, BLOCK_D=triton.next_power_of_2(dim), ROUND=not interpreted,
        )
    return out.to(x.dtype)
