"""The row cache's step as Triton kernels (same signatures as `naive`): invalidate, plan, and decode
attention that reads its rows through the cache; plus row moves between a host pool and the device.

On CUDA the cache and the selection live on the device and the pool in registered host memory
(`memory/host_pool`): the attention kernel loads each miss's row straight from host RAM over UVA and
nothing else crosses PCIe. The launch boundary between plan and attention is the step's only grid-wide
synchronisation: every hit mark and claim is in place before any entry decides to write.
Invalidate is one kernel rather than the reference's handful of torch ops: at 2 KiB rows a step's
kernels are short, and each launch is a visible share of the step.
Invalidate, plan and the cache state the attention kernel leaves are bit-identical to `naive`; its
output equals the reference's up to floating-point summation order, and equals itself bit for bit
whether its rows came from the cache or the pool (tested under TRITON_INTERPRET=1 on CPU and on a GPU).
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


@triton.jit
def _decode_attention_kernel(
    q_ptr, rows_ptr, valid_ptr, hit_ptr, host_k_ptr, host_v_ptr, cache_k_ptr, cache_v_ptr,
    tags_ptr, hitmark_ptr, claims_ptr, epoch_ptr, acc_ptr, max_ptr, sum_ptr,
    num_entries, num_slots, scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EPOCH_SHIFT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: one request's query, entries [split * SPLIT, (split + 1) * SPLIT) of its selection,
    every head. Writes the split's unnormalised output, running max and sum per head."""
    request = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    num_heads: tl.constexpr = NUM_KV_HEADS * GROUP
    row_width: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    epoch = tl.load(epoch_ptr)
    in_group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dims_ok = dims < HEAD_DIM
    first = split * SPLIT
    last = tl.minimum(first + SPLIT, num_entries)
    for kv_head in tl.static_range(NUM_KV_HEADS):
        heads = kv_head * GROUP + in_group
        heads_ok = in_group < GROUP
        q = tl.load(q_ptr + (request * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :],
                    mask=heads_ok[:, None] & dims_ok[None, :], other=0.0).to(tl.float32)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        columns = kv_head * HEAD_DIM + dims
        for start in range(first, last, BLOCK_N):
            entries = start + tl.arange(0, BLOCK_N)
            inside = entries < last
            at = request * num_entries + entries
            row = tl.load(rows_ptr + at, mask=inside, other=0)
            valid = inside & (tl.load(valid_ptr + at, mask=inside, other=0) != 0)
            hit = tl.load(hit_ptr + at, mask=inside, other=0) != 0
            slot = row % num_slots
            # one pointer per entry: its cache slot if it hit, else its row in the pool (over UVA)
            cached = slot[:, None] * row_width + columns[None, :]
            pooled = row[:, None] * row_width + columns[None, :]
            k_ptrs = tl.where(hit[:, None], cache_k_ptr + cached, host_k_ptr + pooled)
            v_ptrs = tl.where(hit[:, None], cache_v_ptr + cached, host_v_ptr + pooled)
            loaded = inside[:, None] & dims_ok[None, :]
            k = tl.load(k_ptrs, mask=loaded, other=0.0)
            v = tl.load(v_ptrs, mask=loaded, other=0.0)
            # fp32 dots: bf16 rows convert exactly (to tf32 too), so tf32 loses nothing on them
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale  # [GROUP_PAD, N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no valid entry yet: nothing to scale
            p = tl.exp(scores - shift[:, None])
            rescale = tl.exp(running_max - shift)
            running_sum = running_sum * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            running_max = new_max
            # a miss fills its slot if its claim won and nobody hit the slot (never planned: no claim won)
            won = tl.load(claims_ptr + slot, mask=inside, other=-1) == ((epoch << EPOCH_SHIFT) | row)
            write = inside & ~hit & won & (tl.load(hitmark_ptr + slot, mask=inside, other=epoch) != epoch)
            tl.store(cache_k_ptr + cached, k, mask=write[:, None] & dims_ok[None, :])
            tl.store(cache_v_ptr + cached, v, mask=write[:, None] & dims_ok[None, :])
            if kv_head == NUM_KV_HEADS - 1:  # the row's last part is in: the slot may say it holds it
                tl.store(tags_ptr + slot, row, mask=write)
        out_at = (request * num_splits + split) * num_heads + heads
        tl.store(acc_ptr + out_at[:, None] * HEAD_DIM + dims[None, :], acc, mask=heads_ok[:, None] & dims_ok[None, :])
        tl.store(max_ptr + out_at, running_max, mask=heads_ok)
        tl.store(sum_ptr + out_at, running_sum, mask=heads_ok)


DECODE_SPLIT = 256  # selected entries per program: ~9 programs a request at a 2,048-row budget
DECODE_BLOCK_N = 32


def triton_decode_attention(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    hit: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """As `naive.decode_attention`: split over the selected entries, the splits merged afterwards.
    host_keys/host_values [R, nkv, hd] may be registered host memory read over UVA."""
    batch, num_heads, head_dim = q.shape
    num_entries = rows.shape[1]
    num_kv_heads = cache.keys.shape[1]
    group = num_heads // num_kv_heads
    num_splits = triton.cdiv(num_entries, DECODE_SPLIT)
    acc = torch.empty(batch, num_splits, num_heads, head_dim, dtype=torch.float32, device=q.device)
    running_max = torch.empty(batch, num_splits, num_heads, dtype=torch.float32, device=q.device)
    running_sum = torch.empty_like(running_max)
    _decode_attention_kernel[(batch, num_splits)](
        q.contiguous(), rows.contiguous(), valid.contiguous(), hit.contiguous(), host_keys, host_values,
        cache.keys, cache.values, cache.tags, cache.hitmark, cache.claims, cache.epoch,
        acc, running_max, running_sum, num_entries, cache.num_slots, scale,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), SPLIT=DECODE_SPLIT,
        BLOCK_N=DECODE_BLOCK_N, EPOCH_SHIFT=EPOCH_SHIFT,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return merge_splits(acc, running_max, running_sum).to(q.dtype)


def merge_splits(acc: torch.Tensor, running_max: torch.Tensor, running_sum: torch.Tensor) -> torch.Tensor:
    """Combine per-split softmax partials [B, splits, nh, (hd)] into [B, nh, hd] (fp32)."""
    overall = running_max.amax(dim=1, keepdim=True)
    weight = torch.exp(running_max - overall)  # a split with no valid entry (max -inf) weighs 0
    return (acc * weight[..., None]).sum(dim=1) / (running_sum * weight).sum(dim=1)[..., None]


@triton.jit
def _copy_rows_kernel(src_ptr, src_rows_ptr, dst_ptr, dst_rows_ptr, row_width,
                      GATHER: tl.constexpr, BLOCK_D: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_D)
    inside = columns < row_width
    if GATHER:  # dst[entry] = src[rows[entry]]
        src_row, dst_row = tl.load(src_rows_ptr + entry), entry
    else:  # dst[rows[entry]] = src[entry]
        src_row, dst_row = entry, tl.load(dst_rows_ptr + entry)
    row = tl.load(src_ptr + src_row * row_width + columns, mask=inside)
    tl.store(dst_ptr + dst_row * row_width + columns, row, mask=inside)


def triton_write_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool[rows] = values, where pool [R, nkv, hd] may be registered host memory written over UVA
    (one launch, no host sync: a decode step writing its new rows can be captured in a CUDA graph)."""
    rows, values = rows.contiguous(), values.contiguous()
    row_width = pool.shape[1:].numel()
    if rows.numel():
        _copy_rows_kernel[(rows.numel(),)](values, rows, pool, rows, row_width, GATHER=False,
                                           BLOCK_D=triton.next_power_of_2(row_width))


def triton_gather_rows(out: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor) -> None:
    """out[:len(rows)] = pool[rows], where pool may be registered host memory read over UVA: only the
    named rows cross PCIe, with no pageable bounce buffer in between."""
    rows = rows.contiguous()
    row_width = pool.shape[1:].numel()
    if rows.numel():
        _copy_rows_kernel[(rows.numel(),)](pool, rows, out, rows, row_width, GATHER=True,
                                           BLOCK_D=triton.next_power_of_2(row_width))
