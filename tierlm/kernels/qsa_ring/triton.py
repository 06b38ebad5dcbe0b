"""The indexer rings after each verified row as one Triton launch (same signature as `naive.ring_after_rows`):
a program per request reads its ring once, then for each of its rows in turn writes the ring after it
(entries before the context from that ring, the others from the request's rows) to the row's slot and to
the output, and the row's key row (`qsa_block_keys.triton.group_key_row`). The request's own slot is among
the targets: every read of it comes before the first write (a barrier between). No host sync.
Launched with programmatic dependent launch (`kernels/dependent_launch`); nothing it reads is a constant,
so it waits first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.qsa_block_keys.triton import group_key_row


@triton.jit
def _ring_kernel(ring_ptr, slots_ptr, raw_ptr, positions_ptr, context_ptr, state_slots_ptr, tables_ptr, rings_ptr,
                 rows_ptr, raw_stride, table_stride, ring_stride, scratch_block,
                 R: tl.constexpr, ID: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_ID: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    request = tl.program_id(0).to(tl.int64)
    entry = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_ID)
    tile = (entry < R)[:, None] & (d < ID)[None, :]
    slot = tl.load(slots_ptr + request).to(tl.int64)
    context = tl.load(context_ptr + request)
    before = tl.load(ring_ptr + slot * ring_stride + entry[:, None] * ID + d[None, :], mask=tile, other=0.0)
    tl.debug_barrier()  # the ring is read before any slot (its own among them) is written
    for t in tl.static_range(ROWS):
        row = request * ROWS + t
        position = tl.load(positions_ptr + row)
        offset = position % R
        start = position - offset
        held = start + entry  # [BLOCK_R]: the positions of the ring's entries
        from_rows = held >= context
        source = request * ROWS + tl.minimum(held - context, ROWS - 1)  # past the row: clamped into range
        fresh = tl.load(raw_ptr + source[:, None] * raw_stride + d[None, :], mask=tile & from_rows[:, None], other=0.0)
        values = tl.where(from_rows[:, None], fresh, before)
        target = tl.load(state_slots_ptr + row).to(tl.int64)
        tl.store(ring_ptr + target * ring_stride + entry[:, None] * ID + d[None, :], values, mask=tile)
        tl.store(rings_ptr + row * R * ID + entry[:, None] * ID + d[None, :], values, mask=tile)
        key_row = group_key_row(tables_ptr + request * table_stride, start, offset == R - 1, scratch_block,
                                BLOCK_SIZE, R)
        tl.store(rows_ptr + row, key_row)


def triton_ring_after_rows(
    ring: torch.Tensor, slots: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor,
    context_lens: torch.Tensor, state_slots: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    scratch_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `naive.ring_after_rows`, in one launch."""
    requests, width = state_slots.shape
    _, r, head_dim = ring.shape
    if not ring.is_contiguous() or raw_keys.stride(1) != 1:
        raise ValueError("QSA ring kernel: the ring pool must be contiguous and the raw keys' rows too")
    if block_tables.stride(1) != 1:  # (`group_key_row` reads a table row as contiguous)
        block_tables = block_tables.contiguous()
    rings = torch.empty(requests * width, r, head_dim, dtype=ring.dtype, device=ring.device)
    rows = torch.empty(requests * width, dtype=torch.int64, device=ring.device)
    if requests:
        _ring_kernel[(requests,)](
            ring, slots, raw_keys, positions, context_lens, state_slots.contiguous(), block_tables, rings, rows,
            raw_keys.stride(0), block_tables.stride(0), ring.stride(0), scratch_block, R=r, ID=head_dim,
            ROWS=width, BLOCK_SIZE=block_size, BLOCK_R=triton.next_power_of_2(r),
            BLOCK_ID=triton.next_power_of_2(head_dim), num_warps=2, **launch_options(ring.device))
    return rings, rows
