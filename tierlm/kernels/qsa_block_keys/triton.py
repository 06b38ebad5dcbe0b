"""The indexer's decode key store as one Triton launch (same signature as `naive.store_decode_block_keys`):
one program per request writes its raw key into the ring and, if that closes its group, sums the group
(the ring's R - 1 earlier keys and the new one, in ring order, as torch's mean does), then norms and ropes
the mean with `kernels/norm_rope`'s helpers (angles from the group's first position) and stores it in the
pool. No host sync; the CPU interpreter path keeps fp32 and lets torch round once (see `norm_rope`).
Launched with programmatic dependent launch (`kernels/dependent_launch`): the norm weight and the inverse
frequencies (module constants) are loaded before the wait for the kernel before, everything else after."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.norm_rope.triton import (
    column_frequencies,
    norm_rotate,
    norm_scales,
    rotary_at,
    rotate_half_partner,
)


@triton.jit
def group_key_row(table_row_ptr, start, closes, scratch_block, BLOCK_SIZE: tl.constexpr, RATIO: tl.constexpr):
    """`naive.group_key_rows` for one request's group starting at `start` (table_row_ptr: its block table's
    row): the pool row (viewed [-1, id]) its key goes to."""
    block = tl.load(table_row_ptr + start // BLOCK_SIZE)
    row = block * (BLOCK_SIZE // RATIO) + (start % BLOCK_SIZE) // RATIO
    return tl.where(closes & (block >= 0), row, scratch_block * (BLOCK_SIZE // RATIO))


@triton.jit
def _store_kernel(raw_ptr, ring_ptr, keys_ptr, slots_ptr, context_ptr, tables_ptr, weight_ptr, inv_freq_ptr,
                  raw_stride, table_stride, scratch_block, eps, RATIO: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    request = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_D)
    inside = columns < D
    partner = rotate_half_partner(columns, RD)
    scale, partner_scale = norm_scales(weight_ptr, columns, partner, inside)  # constants: before the wait
    frequencies = column_frequencies(inv_freq_ptr, columns, RD)
    wait_for_inputs(PDL)
    context = tl.load(context_ptr + request)
    offset = context % RATIO
    raw_row = raw_ptr + request * raw_stride
    raw = tl.load(raw_row + columns, mask=inside, other=0.0)
    ring_row = ring_ptr + tl.load(slots_ptr + request) * (RATIO * D)
    tl.store(ring_row + offset * D + columns, raw, mask=inside)
    closes = offset == RATIO - 1
    if closes:
        dtype = raw.dtype if ROUND else tl.float32
        total = tl.zeros([BLOCK_D], tl.float32)
        total_partner = tl.zeros([BLOCK_D], tl.float32)
        for t in tl.static_range(RATIO - 1):
            total += tl.load(ring_row + t * D + columns, mask=inside, other=0.0).to(tl.float32)
            total_partner += tl.load(ring_row + t * D + partner, mask=inside, other=0.0).to(tl.float32)
        total += raw.to(tl.float32)
        total_partner += tl.load(raw_row + partner, mask=inside, other=0.0).to(tl.float32)
        pooled = (total / RATIO).to(dtype).to(tl.float32)
        pooled_partner = (total_partner / RATIO).to(dtype).to(tl.float32)
        start = context - offset
        cos, sin = rotary_at(start, frequencies, columns, RD, dtype)
        key = norm_rotate(pooled, pooled_partner, scale, partner_scale, columns, cos, sin, eps, D, RD, dtype)
        row = group_key_row(tables_ptr + request * table_stride, start, closes, scratch_block, BLOCK_SIZE, RATIO)
        tl.store(keys_ptr + row * D + columns, key, mask=inside)


def triton_store_decode_block_keys(
    raw_keys: torch.Tensor, ring: torch.Tensor, index_keys: torch.Tensor, slots: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, weight: torch.Tensor, eps: float,
    inv_freq: torch.Tensor, block_size: int, scratch_block: int,
) -> None:
    """As `naive.store_decode_block_keys`, in one launch (the scratch block is not written)."""
    batch, dim = raw_keys.shape
    ratio = ring.shape[1]
    if (ring.shape[2] != dim or index_keys.shape[1:] != (block_size // ratio, dim) or not ring.is_contiguous()
            or raw_keys.stride(1) != 1):
        raise ValueError(f"raw keys {tuple(raw_keys.shape)} (last dim contiguous), ring {tuple(ring.shape)} "
                         f"(contiguous) and pool {tuple(index_keys.shape)} do not agree for block size {block_size}")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    pool = index_keys
    if raw_keys.device.type == "cpu":  # the interpreter: fp32 out, rounded once by torch
        pool = index_keys.float()
    if batch:
        _store_kernel[(batch,)](
            raw_keys, ring, pool, slots.contiguous(), context_lens.contiguous(), block_tables, weight, inv_freq,
            raw_keys.stride(0), block_tables.stride(0), scratch_block, eps, RATIO=ratio, D=dim, RD=2 * inv_freq.shape[0],
            BLOCK_D=triton.next_power_of_2(dim), BLOCK_SIZE=block_size, ROUND=raw_keys.device.type != "cpu",
            **launch_options(raw_keys.device),
        )
    if pool is not index_keys:
        index_keys.copy_(pool)
