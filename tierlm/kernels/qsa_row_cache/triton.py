"""The row cache's step as Triton kernels (same signatures as `naive`): store (new rows into the pools,
invalidating their slots), plan, and decode attention that reads its rows through the cache; plus the
gather that stages prefill rows from a host pool.

On CUDA the cache and the selection live on the device and the pool in registered host memory
(`memory/host_pool`): the attention kernel loads each miss's row straight from host RAM over UVA and
nothing else crosses PCIe. The launch boundary between plan and attention is the step's only grid-wide
synchronisation: every hit mark and claim is in place before any entry decides to write.
Every kernel here is launched with programmatic dependent launch (`kernels/dependent_launch`) and waits
first (nothing it reads is a constant); so under PDL that boundary is the attention kernel's wait, which
returns once the plan kernel has finished and its atomics are visible.
Store is one kernel rather than the reference's handful of torch ops, and the splits' merge is one
more: at 2 KiB rows a step's kernels are short, and each launch is a visible share of the step.
Store, plan and the cache state the attention kernel leaves are bit-identical to `naive`; its
output equals the reference's up to floating-point summation order, and equals itself bit for bit
whether its rows came from the cache or the pool (tested under TRITON_INTERPRET=1 on CPU and on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.qsa_row_cache.naive import EPOCH_SHIFT, QSARowCache

PLAN_BLOCK = 64  # entries per plan program: ~32 programs for one request's 2k entries


@triton.jit
def _store_kernel(rows_ptr, keys_ptr, values_ptr, host_k_ptr, host_v_ptr, tags_ptr, epoch_ptr, num_rows, num_slots,
                  ROW_WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program per new row: its K and V into the pool (over UVA), its slot emptied if it holds the row."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    entry = tl.program_id(0).to(tl.int64)
    if entry < num_rows:
        row = tl.load(rows_ptr + entry)
        columns = tl.arange(0, BLOCK_D)
        inside = columns < ROW_WIDTH
        tl.store(host_k_ptr + row * ROW_WIDTH + columns, tl.load(keys_ptr + entry * ROW_WIDTH + columns, mask=inside),
                 mask=inside)
        tl.store(host_v_ptr + row * ROW_WIDTH + columns,
                 tl.load(values_ptr + entry * ROW_WIDTH + columns, mask=inside), mask=inside)
        slot = row % num_slots
        # every writer of a slot stores the same -1: duplicates need no atomics
        tl.store(tags_ptr + slot, -1, mask=tl.load(tags_ptr + slot) == row)
    if entry == 0:
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


def triton_store_rows(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """As `naive.store_rows`, in one launch and without a host sync (a captured decode step can run it):
    the pools may be registered host memory, written over UVA."""
    rows, keys, values = rows.contiguous(), keys.contiguous(), values.contiguous()
    row_width = host_keys.shape[1:].numel()
    _store_kernel[(max(1, rows.numel()),)](
        rows, keys, values, host_keys, host_values, cache.tags, cache.epoch, rows.numel(), cache.num_slots,
        ROW_WIDTH=row_width, BLOCK_D=triton.next_power_of_2(row_width), **launch_options(rows.device),
    )


@triton.jit
def _plan_kernel(
    rows_ptr, valid_ptr, hit_ptr, tags_ptr, hitmark_ptr, claims_ptr, epoch_ptr, hits_ptr, misses_ptr,
    num_entries, num_slots, EPOCH_SHIFT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
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
        n, cache.num_slots, EPOCH_SHIFT=EPOCH_SHIFT, BLOCK=PLAN_BLOCK, **launch_options(rows.device),
    )
    return hit


@triton.jit
def _decode_attention_kernel(
    q_ptr, rows_ptr, valid_ptr, hit_ptr, host_k_ptr, host_v_ptr, cache_k_ptr, cache_v_ptr,
    tags_ptr, hitmark_ptr, claims_ptr, epoch_ptr, acc_ptr, max_ptr, sum_ptr,
    num_entries, num_slots, scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, EPOCH_SHIFT: tl.constexpr,
    PRECISION: tl.constexpr, HITS: tl.constexpr, PDL: tl.constexpr,
):
    """One program: one request, one KV head and its GROUP query heads, entries [split * SPLIT,
    (split + 1) * SPLIT) of the request's selection. Writes the split's unnormalised output, running
    max and running sum per query head; a winning miss writes its head's part of the row (and, in the
    head-0 program, the tag: nothing reads a slot in the step that fills it)."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    request = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    num_splits = tl.num_programs(1)
    num_heads: tl.constexpr = NUM_KV_HEADS * GROUP
    row_width: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    epoch = tl.load(epoch_ptr)
    in_group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + in_group
    heads_ok = in_group < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dims_ok = dims < HEAD_DIM
    columns = kv_head * HEAD_DIM + dims
    q = tl.load(q_ptr + (request * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :],
                mask=heads_ok[:, None] & dims_ok[None, :], other=0.0).to(tl.float32)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    first = split * SPLIT
    last = tl.minimum(first + SPLIT, num_entries)
    for start in range(first, last, BLOCK_N):
        entries = start + tl.arange(0, BLOCK_N)
        inside = entries < last
        at = request * num_entries + entries
        row = tl.load(rows_ptr + at, mask=inside, other=0)
        valid = inside & (tl.load(valid_ptr + at, mask=inside, other=0) != 0)
        if HITS:
            hit = tl.load(hit_ptr + at, mask=inside, other=0) != 0
        else:  # a cache never planned: every entry reads the pool
            hit = entries < 0
        slot = row % num_slots
        # a miss fills its slot if its claim won and nobody hit the slot (never planned: no claim won);
        # asked before the rows are loaded, so that these small reads wait alongside the long ones
        won = tl.load(claims_ptr + slot, mask=inside, other=-1) == ((epoch << EPOCH_SHIFT) | row)
        write = valid & ~hit & won & (tl.load(hitmark_ptr + slot, mask=inside, other=epoch) != epoch)
        # one pointer per entry: its cache slot if it hit, else its row in the pool (over UVA)
        cached = slot[:, None] * row_width + columns[None, :]
        pooled = row[:, None] * row_width + columns[None, :]
        loaded = valid[:, None] & dims_ok[None, :]  # an invalid entry (padding) reads nothing
        k = tl.load(tl.where(hit[:, None], cache_k_ptr + cached, host_k_ptr + pooled), mask=loaded, other=0.0)
        v = tl.load(tl.where(hit[:, None], cache_v_ptr + cached, host_v_ptr + pooled), mask=loaded, other=0.0)
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
        tl.store(cache_k_ptr + cached, k, mask=write[:, None] & dims_ok[None, :])
        tl.store(cache_v_ptr + cached, v, mask=write[:, None] & dims_ok[None, :])
        if kv_head == 0:
            tl.store(tags_ptr + slot, row, mask=write)
    out_at = (request * num_splits + split) * num_heads + heads
    tl.store(acc_ptr + out_at[:, None] * HEAD_DIM + dims[None, :], acc, mask=heads_ok[:, None] & dims_ok[None, :])
    tl.store(max_ptr + out_at, running_max, mask=heads_ok)
    tl.store(sum_ptr + out_at, running_sum, mask=heads_ok)


DECODE_SPLIT = 32  # selected entries per program: 65 programs per request and KV head at a 2,048-row budget
DECODE_BLOCK_N = 32
DECODE_WARPS = 4
MERGE_CHUNK = 64  # splits the merge kernel reads at once: every split of a 2,048-row budget in one go


def triton_decode_attention(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    hit: torch.Tensor | None,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `naive.decode_attention`: split over the selected entries, the splits merged afterwards (the
    gate applied there). host_keys/host_values [R, nkv, hd] may be registered host memory read over UVA."""
    batch, num_heads, head_dim = q.shape
    num_entries = rows.shape[1]
    num_kv_heads = cache.keys.shape[1]
    group = num_heads // num_kv_heads
    num_splits = triton.cdiv(num_entries, DECODE_SPLIT)
    acc = torch.empty(batch, num_splits, num_heads, head_dim, dtype=torch.float32, device=q.device)
    running_max = torch.empty(batch, num_splits, num_heads, dtype=torch.float32, device=q.device)
    running_sum = torch.empty_like(running_max)
    _decode_attention_kernel[(batch, num_splits, num_kv_heads)](
        q.contiguous(), rows.contiguous(), valid.contiguous(), None if hit is None else hit.contiguous(), host_keys,
        host_values,
        cache.keys, cache.values, cache.tags, cache.hitmark, cache.claims, cache.epoch,
        acc, running_max, running_sum, num_entries, cache.num_slots, scale,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), SPLIT=DECODE_SPLIT,
        BLOCK_N=DECODE_BLOCK_N, EPOCH_SHIFT=EPOCH_SHIFT,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HITS=hit is not None, num_warps=DECODE_WARPS,
        **launch_options(q.device),
    )
    out = torch.empty_like(q)
    splits_pad = triton.next_power_of_2(num_splits)
    dim_block = min(64, triton.next_power_of_2(head_dim))
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"gate must be [B, nh, hd] {tuple(q.shape)} with a contiguous last dim, got {tuple(gate.shape)}")
    _merge_kernel[(batch, num_heads, triton.cdiv(head_dim, dim_block))](
        acc, running_max, running_sum, out, gate, num_splits, num_heads, 0 if gate is None else gate.stride(0),
        0 if gate is None else gate.stride(1), HEAD_DIM=head_dim, SPLITS_PAD=splits_pad,
        CHUNK=min(MERGE_CHUNK, splits_pad), DIM_BLOCK=dim_block, GATED=gate is not None,
        **launch_options(q.device),
    )
    return out


@triton.jit
def _merge_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, gate_ptr, num_splits, num_heads, gate_stride_b, gate_stride_h,
                  HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr, DIM_BLOCK: tl.constexpr,
                  GATED: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, head, DIM_BLOCK dims): the softmax partials of its splits, rescaled to
    the overall max and summed; GATED: times sigmoid(gate), each rounded to the output dtype first, as
    torch's out * torch.sigmoid(gate) rounds."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.program_id(2) * DIM_BLOCK + tl.arange(0, DIM_BLOCK)
    splits = tl.arange(0, SPLITS_PAD)
    at = (request * num_splits + splits) * num_heads + head
    overall = tl.max(tl.load(max_ptr + at, mask=splits < num_splits, other=float("-inf")), axis=0)
    total = tl.zeros([DIM_BLOCK], tl.float32)
    norm = tl.zeros([CHUNK], tl.float32)
    for first in range(0, num_splits, CHUNK):
        chunk = first + tl.arange(0, CHUNK)
        inside = chunk < num_splits
        part = (request * num_splits + chunk) * num_heads + head
        weight = tl.exp(tl.load(max_ptr + part, mask=inside, other=float("-inf")) - overall)  # empty split: 0
        norm += weight * tl.load(sum_ptr + part, mask=inside, other=0.0)
        partial = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                          mask=inside[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        total += tl.sum(partial * weight[:, None], axis=0)
    dtype = out_ptr.dtype.element_ty
    out = (total / tl.sum(norm, axis=0)).to(dtype)
    if GATED:
        gate = tl.load(gate_ptr + request * gate_stride_b + head * gate_stride_h + dims, mask=dims < HEAD_DIM,
                       other=0.0)
        out = (out.to(tl.float32) * tl.sigmoid(gate.to(tl.float32)).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + (request * num_heads + head) * HEAD_DIM + dims, out, mask=dims < HEAD_DIM)


@triton.jit
def _gather_rows_kernel(pool_ptr, rows_ptr, out_ptr, ROW_WIDTH: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    entry = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_D)
    inside = columns < ROW_WIDTH
    row = tl.load(rows_ptr + entry)
    tl.store(out_ptr + entry * ROW_WIDTH + columns, tl.load(pool_ptr + row * ROW_WIDTH + columns, mask=inside),
             mask=inside)


def triton_gather_rows(out: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor) -> None:
    """out[:len(rows)] = pool[rows], where pool may be registered host memory read over UVA: only the
    named rows cross PCIe, with no pageable bounce buffer in between."""
    rows = rows.contiguous()
    row_width = pool.shape[1:].numel()
    if rows.numel():
        _gather_rows_kernel[(rows.numel(),)](pool, rows, out, ROW_WIDTH=row_width,
                                             BLOCK_D=triton.next_power_of_2(row_width),
                                             **launch_options(out.device))
