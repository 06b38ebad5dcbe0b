"""The row cache's step as three Triton kernels: invalidate, plan, read (same signatures as `naive`),
and the write of new rows into a host pool.

On CUDA the cache and the selection live on the device and the pool in registered host memory
(`memory/host_pool`): the read kernel loads each miss's row straight from host RAM over UVA, one row per
entry, and nothing else crosses PCIe. The launch boundary between plan and read is the step's only
grid-wide synchronisation: every hit mark and claim is in place before any entry decides to write.
Invalidate is one kernel rather than the reference's handful of torch ops: at 2 KiB rows a step's
kernels are short, and each launch is a visible share of the step.
Bit-identical to `naive` (tested under TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.qsa_row_cache.naive import EPOCH_SHIFT, QSARowCache

PLAN_BLOCK = 256


@triton.jit
def _invalidate_kernel(rows_ptr, num_rows, tags_ptr, epoch_ptr, num_slots, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < num_rows
    rows = tl.load(rows_ptr + offsets, mask=inside, other=0)
    slots = rows % num_slots
    held = tl.load(tags_ptr + slots, mask=inside, other=-1)
    # every writer of a slot stores the same -1: duplicates need no atomics
    tl.store(tags_ptr + slots, tl.full([BLOCK], -1, tl.int64), mask=inside & (held == rows))
    if tl.program_id(0) == 0:
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


def triton_invalidate(cache: QSARowCache, rows_written: torch.Tensor) -> None:
    """As `QSARowCache.invalidate`, in one launch."""
    rows = rows_written.flatten().contiguous()
    n = rows.numel()
    _invalidate_kernel[(max(1, triton.cdiv(n, PLAN_BLOCK)),)](
        rows, n, cache.tags, cache.epoch, cache.num_slots, BLOCK=PLAN_BLOCK
    )


@triton.jit
def _plan_kernel(
    rows_ptr, valid_ptr, hit_ptr, tags_ptr, hitmark_ptr, claims_ptr, epoch_ptr, hits_ptr, misses_ptr,
    num_entries, num_slots, EPOCH_SHIFT: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < num_entries
    rows = tl.load(rows_ptr + offsets, mask=inside, other=0)
    valid = tl.load(valid_ptr + offsets, mask=inside, other=0) != 0
    slots = rows % num_slots
    tags = tl.load(tags_ptr + slots, mask=inside, other=-1)
    epoch = tl.load(epoch_ptr)
    hit = valid & (tags == rows)
    miss = valid & (tags != rows)
    tl.atomic_max(hitmark_ptr + slots, tl.full([BLOCK], 0, tl.int64) + epoch, mask=hit)
    tl.atomic_max(claims_ptr + slots, (epoch << EPOCH_SHIFT) | rows, mask=miss)
    tl.store(hit_ptr + offsets, hit, mask=inside)
    tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64)))
    tl.atomic_add(misses_ptr, tl.sum(miss.to(tl.int64)))


@triton.jit
def _read_kernel(
    rows_ptr, hit_ptr, host_k_ptr, host_v_ptr, cache_k_ptr, cache_v_ptr, tags_ptr, hitmark_ptr, claims_ptr,
    epoch_ptr, out_k_ptr, out_v_ptr, num_slots, row_width, EPOCH_SHIFT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + entry)
    hit = tl.load(hit_ptr + entry) != 0
    slot = row % num_slots
    columns = tl.arange(0, BLOCK_D)
    inside = columns < row_width
    cached = slot * row_width + columns
    pooled = row * row_width + columns
    # masked-off loads move no bytes: a hit reads only VRAM, a miss only the host row
    from_cache, from_pool = tl.where(hit, inside, False), tl.where(hit, False, inside)
    keys = tl.where(
        hit, tl.load(cache_k_ptr + cached, mask=from_cache), tl.load(host_k_ptr + pooled, mask=from_pool)
    )
    values = tl.where(
        hit, tl.load(cache_v_ptr + cached, mask=from_cache), tl.load(host_v_ptr + pooled, mask=from_pool)
    )
    tl.store(out_k_ptr + entry * row_width + columns, keys, mask=inside)
    tl.store(out_v_ptr + entry * row_width + columns, values, mask=inside)
    epoch = tl.load(epoch_ptr)
    won = tl.load(claims_ptr + slot) == ((epoch << EPOCH_SHIFT) | row)
    write = ~hit & won & (tl.load(hitmark_ptr + slot) != epoch)
    tl.store(cache_k_ptr + cached, keys, mask=tl.where(write, inside, False))
    tl.store(cache_v_ptr + cached, values, mask=tl.where(write, inside, False))
    tl.store(tags_ptr + slot, row, mask=write)


def triton_plan_rows(cache: QSARowCache, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """As `naive.plan_rows`."""
    rows, valid = rows.contiguous(), valid.contiguous()
    hit = torch.empty_like(valid)
    n = rows.numel()
    _plan_kernel[(triton.cdiv(n, PLAN_BLOCK),)](
        rows, valid, hit, cache.tags, cache.hitmark, cache.claims, cache.epoch, cache.hits, cache.misses,
        n, cache.num_slots, EPOCH_SHIFT=EPOCH_SHIFT, BLOCK=PLAN_BLOCK,
    )
    return hit


def triton_read_rows(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    rows: torch.Tensor,
    hit: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `naive.read_rows`; host_keys/host_values may be registered host memory read over UVA."""
    rows, hit = rows.contiguous(), hit.contiguous()
    row_shape = cache.keys.shape[1:]
    out_k = torch.empty(*rows.shape, *row_shape, dtype=cache.keys.dtype, device=cache.keys.device)
    out_v = torch.empty_like(out_k)
    row_width = row_shape.numel()
    _read_kernel[(rows.numel(),)](
        rows, hit, host_keys, host_values, cache.keys, cache.values, cache.tags, cache.hitmark, cache.claims,
        cache.epoch, out_k, out_v, cache.num_slots, row_width,
        EPOCH_SHIFT=EPOCH_SHIFT, BLOCK_D=triton.next_power_of_2(row_width),
    )
    return out_k, out_v


@triton.jit
def _write_kernel(rows_ptr, src_ptr, pool_ptr, row_width, BLOCK_D: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + entry)
    columns = tl.arange(0, BLOCK_D)
    inside = columns < row_width
    tl.store(pool_ptr + row * row_width + columns, tl.load(src_ptr + entry * row_width + columns, mask=inside),
             mask=inside)


def triton_write_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool[rows] = values, where pool [R, nkv, hd] may be registered host memory written over UVA
    (one launch, no host sync: a decode step writing its new rows can be captured in a CUDA graph)."""
    rows, values = rows.contiguous(), values.contiguous()
    row_width = pool.shape[1:].numel()
    if rows.numel():
        _write_kernel[(rows.numel(),)](rows, values, pool, row_width, BLOCK_D=triton.next_power_of_2(row_width))
