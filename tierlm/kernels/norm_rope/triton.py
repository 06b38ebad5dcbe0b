"""The fused norm + rotary as one Triton launch (same signatures as `naive`; the package docstring has the
shapes and the rounding). Triton's CPU interpreter truncates fp32 -> bf16 casts instead of rounding them,
so there the kernel keeps every step in fp32 and torch rounds its fp32 output once (the same function of
the inputs, without the intermediate roundings).

Launched with programmatic dependent launch (`kernels/dependent_launch`): a program loads the norm
weight and the inverse frequencies (module constants no kernel of the step writes) before it waits for
the kernel before it, then its row, positions or cos/sin tables (a previous kernel may write them).

The jit helpers are shared with other kernels that end in a norm + rotary: `norm_scales` and
`column_frequencies` (the constants, loaded before the wait), `rotary_at` (cos/sin of one position from
those frequencies) and `norm_rotate` (the norm and rotation of one head's row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs


@triton.jit
def column_frequencies(inv_freq_ptr, columns, RD: tl.constexpr):
    """Each column's inverse frequency inv_freq[column % (RD / 2)] (0 past the rotary dims): what `rotary_at`
    turns into angles."""
    return tl.load(inv_freq_ptr + columns % (RD // 2), mask=columns < RD, other=0.0)


@triton.jit
def rotary_at(position, frequencies, columns, RD: tl.constexpr, dtype: tl.constexpr):
    """cos, sin (fp32 values of `dtype`) of each column's angle position * frequencies (`column_frequencies`),
    as `naive.rotary_cos_sin` computes them; 1 and 0 past the rotary dims."""
    rotary = columns < RD
    angle = position.to(tl.float32) * frequencies
    cos = tl.where(rotary, tl.cos(angle), 1.0).to(dtype).to(tl.float32)
    sin = tl.where(rotary, tl.sin(angle), 0.0).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def norm_scales(weight_ptr, columns, partner, inside):
    """The Gemma norm's factors (1 + w) in fp32 at each column and at its rotate-half partner."""
    scale = 1.0 + tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    partner_scale = 1.0 + tl.load(weight_ptr + partner, mask=inside, other=0.0).to(tl.float32)
    return scale, partner_scale


@triton.jit
def norm_rotate(xf, xpf, scale, partner_scale, columns, cos, sin, eps, D: tl.constexpr, RD: tl.constexpr,
                dtype: tl.constexpr):
    """One head's row: xf [BLOCK_D] (fp32) and xpf, the same row at each column's rotate-half partner;
    Gemma RMS norm in fp32 (scale, partner_scale: `norm_scales`) rounded to dtype, then rotation with each
    product and the sum rounded to dtype, as torch computes them. cos/sin [BLOCK_D] fp32."""
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd * scale).to(dtype)
    paired = (xpf * rstd * partner_scale).to(dtype)
    paired = tl.where(columns < RD // 2, -paired.to(tl.float32), paired.to(tl.float32)).to(dtype)
    turned = ((normed.to(tl.float32) * cos).to(dtype).to(tl.float32)
              + (paired.to(tl.float32) * sin).to(dtype).to(tl.float32)).to(dtype)
    return tl.where(columns < RD, turned, normed)


@triton.jit
def rotate_half_partner(columns, RD: tl.constexpr):
    """The column each column's rotate-half pairs with (itself past the rotary dims)."""
    half = RD // 2
    return tl.where(columns < half, columns + half, tl.where(columns < RD, columns - half, columns))


@triton.jit
def _norm_rope_kernel(x_ptr, weight_ptr, cos_ptr, sin_ptr, positions_ptr, inv_freq_ptr, out_ptr, rows_ptr,
                      values_ptr, value_out_ptr, x_stride_n, x_stride_h, v_stride_n, v_stride_h, eps,
                      HEADS: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr,
                      ROUND: tl.constexpr, AT_POSITIONS: tl.constexpr, INTO_ROWS: tl.constexpr,
                      PDL: tl.constexpr):
    allow_dependents(PDL)
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    columns = tl.arange(0, BLOCK_D)
    inside = columns < D
    partner = rotate_half_partner(columns, RD)
    scale, partner_scale = norm_scales(weight_ptr, columns, partner, inside)  # constants: before the wait
    if AT_POSITIONS:
        frequencies = column_frequencies(inv_freq_ptr, columns, RD)
    wait_for_inputs(PDL)
    row = x_ptr + token * x_stride_n + head * x_stride_h
    x = tl.load(row + columns, mask=inside, other=0.0)
    dtype = x.dtype if ROUND else tl.float32
    if AT_POSITIONS:
        cos, sin = rotary_at(tl.load(positions_ptr + token), frequencies, columns, RD, dtype)
    else:
        rotary = columns < RD
        cos = tl.load(cos_ptr + token * RD + columns, mask=rotary, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * RD + columns, mask=rotary, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=inside, other=0.0)
    out = norm_rotate(x.to(tl.float32), xp.to(tl.float32), scale, partner_scale, columns, cos, sin, eps, D, RD,
                      dtype)
    if INTO_ROWS:  # the key into its pool row, the value beside it
        at = (tl.load(rows_ptr + token) * HEADS + head) * D + columns
        tl.store(out_ptr + at, out, mask=inside)
        value = tl.load(values_ptr + token * v_stride_n + head * v_stride_h + columns, mask=inside)
        tl.store(value_out_ptr + at, value, mask=inside)
    else:
        tl.store(out_ptr + (token * HEADS + head) * D + columns, out, mask=inside)


def _launch(x, weight, eps, out, rd, cos=None, sin=None, positions=None, inv_freq=None, rows=None, values=None,
            value_rows=None) -> None:
    n, heads, dim = x.shape
    if x.stride(2) != 1:
        raise ValueError("x's last dim must be contiguous")
    if rd % 2 or rd > dim:
        raise ValueError(f"the rotary dims must be even and <= {dim}, got {rd}")
    if n:
        into = rows is not None
        _norm_rope_kernel[(n, heads)](
            x, weight, cos, sin, positions, inv_freq, out, rows, values, value_rows, x.stride(0), x.stride(1),
            values.stride(0) if into else 0, values.stride(1) if into else 0, eps, HEADS=heads, D=dim, RD=rd,
            BLOCK_D=triton.next_power_of_2(dim), ROUND=x.device.type != "cpu", AT_POSITIONS=positions is not None,
            INTO_ROWS=into, **launch_options(x.device),
        )


def triton_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """As `naive.norm_rope`, in one launch; no host sync (a CUDA graph captures it)."""
    n, heads, dim = x.shape
    rd = cos.shape[-1]
    if cos.shape != (n, rd) or sin.shape != (n, rd):
        raise ValueError(f"cos/sin must be [{n}, rd], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    out = torch.empty(n, heads, dim, dtype=torch.float32 if x.device.type == "cpu" else x.dtype, device=x.device)
    _launch(x, weight, eps, out, rd, cos=cos.contiguous(), sin=sin.contiguous())
    return out.to(x.dtype)


def triton_norm_rope_at(
    x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """As `naive.norm_rope_at`: cos/sin computed in the kernel from the positions (no table launches)."""
    n, heads, dim = x.shape
    out = torch.empty(n, heads, dim, dtype=torch.float32 if x.device.type == "cpu" else x.dtype, device=x.device)
    _launch(x, weight, eps, out, 2 * inv_freq.shape[0], positions=positions.contiguous(), inv_freq=inv_freq)
    return out.to(x.dtype)


def triton_norm_rope_kv_write(
    keys: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
    values: torch.Tensor, rows: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor,
) -> None:
    """As `naive.norm_rope_kv_write`, in one launch (instead of the norm + rotary and two index_puts)."""
    if values.shape != keys.shape or values.stride(2) != 1 or key_rows.shape[1:] != keys.shape[1:]:
        raise ValueError(f"keys {tuple(keys.shape)}, values {tuple(values.shape)} (last dim contiguous) and pool "
                         f"rows {tuple(key_rows.shape)} must agree")
    pool = key_rows
    if keys.device.type == "cpu":  # the interpreter: fp32 out, rounded once by torch (see the module docstring)
        pool = key_rows.float()
    _launch(keys, weight, eps, pool, 2 * inv_freq.shape[0], positions=positions.contiguous(), inv_freq=inv_freq,
            rows=rows.contiguous(), values=values, value_rows=value_rows)
    if pool is not key_rows:
        key_rows[rows] = pool[rows].to(key_rows.dtype)
