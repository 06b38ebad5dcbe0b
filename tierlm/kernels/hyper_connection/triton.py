"""Hyper-connections' mix and combine as Triton kernels (same signatures as `naive`), for decode batches.

mix, two launches (at the real widths, hc 4 x H 2560, r 320: W_down|inj 6.6 MB and W_up 6.6 MB, each read
once per BLOCK_N tokens, by enough programs to read them at the memory's pace):
  1. `_mix_down_kernel`, programs over (BLOCK_J rows of W_down|inj, one of hc * SPLIT slices of the
     streams (each inside one stream), token block): the RMSNorm is linear in x once each stream's rms is
     known, so a program multiplies x * (1 + w_norm) (rounded to the streams' dtype, as the reference
     rounds the normed input) by its weight tile and stores an fp32 partial per slice, plus the slice's
     sum of squares. The last program to arrive (`split_reduce.arrival_counters`) adds each stream's
     partials times its 1/rms and applies the mixer's activations: silu(. / hc) (stored for launch 2)
     and the injection gates 2 sigmoid(. / hc).
  2. `_mix_up_kernel`, programs over (BLOCK_H of the H columns, token block): for each stream s, the
     gates sigmoid(W_up[s] . low) of its columns, the normed streams (x / rms * (1 + w)), and the mean
     over streams of their products.
INT8 per-channel mixer weights (int4-mixed checkpoints; half the bytes) are a compile-time variant of
both launches: each int32 word is loaded once and split into its 4 signed values in registers
(`int8_tile`, exact in the streams' dtype, so tl.dot multiplies them as it multiplies bf16 weights), and
each row's fp32 dot product is multiplied by the row's scale (launch 1: in the finishing program, after
the sum over slices; launch 2: before the sigmoid). The reference rounds q * scale to the streams' dtype
first: in fp32 the two agree to fp32 roundoff, in bf16 the kernel skips one rounding of the weight.
combine, one launch (`_combine_kernel`): streams + inject[s] * block_output, the streams read in place.
Values are rounded to the streams' dtype where the reference rounds them; sums are fp32. No host sync:
CUDA graphs capture all three. Up to MAX_TOKENS tokens (prefill chunks take the reference's GEMMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.hyper_connection.naive import check_mix_args, int8_weight_shape
from tierlm.kernels.quant_linear.triton import dot_precision, round_to
from tierlm.kernels.split_reduce import arrival_counters, dot_acc

MAX_TOKENS = 64
BLOCK_N = 16  # tokens per program: tl.dot's least M
# launch 1's tiles by batch, the first entry whose token bound covers it: (BLOCK_J rows of W_down|inj,
# BLOCK_K columns per step, SPLIT slices per stream, warps). H200, real widths (bench/decode_fusions.py
# --sweep-hc): one token 21.3 us with its own tiles (440 programs) vs 30.2 us with the batch tiles (168
# programs), which stay best from 4 tokens (34.6 vs 36.0 us at 4, 33.7 vs 42.4 at 16)
DOWN_TILES = ((1, (32, 256, 10, 4)), (MAX_TOKENS, (16, 128, 2, 4)))
BLOCK_H, BLOCK_R = 16, 64  # launch 2: 160 programs at the real widths; BLOCK_R: low-rank columns per step
UP_WARPS = 4
COMBINE_BLOCK = 256


@triton.jit
def int8_tile(w_ptr, rows, r_mask, k0, k_end, ROW_WORDS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """INT8 per-channel weights (`naive.int8_weight_shape`: int32 words [N, ROW_WORDS], 4 values each):
    the signed values q = stored - 128 of rows `rows` (int64, masked by r_mask) at columns
    [k0, k0 + BLOCK_K) (k0 and k_end multiples of 4), as fp32 [BLOCK_ROWS, BLOCK_K] (exact: small
    integers), 0 at columns >= k_end. Each word is loaded once and split in registers."""
    words_at = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    mask = r_mask[:, None] & (words_at * 4 < k_end)[None, :]
    words = tl.load(w_ptr + rows[:, None] * ROW_WORDS + words_at[None, :], mask=mask, other=0)
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    stored = (words.to(tl.uint32, bitcast=True)[:, :, None] >> shifts[None, None, :]) & 0xFF
    q = tl.where(mask[:, :, None], stored.to(tl.int32) - 128, 0)
    return tl.reshape(q.to(tl.float32), (BLOCK_ROWS, BLOCK_K))  # value j of word i: column 4 i + j


@triton.jit
def _finish_mix_down(partial_ptr, sumsq_ptr, down_scale_ptr, low_ptr, rstd_ptr, inject_ptr, tokens, t_mask,
                     num_slices, eps, HIDDEN: tl.constexpr, HC: tl.constexpr, SPLIT: tl.constexpr,
                     LOWRANK: tl.constexpr, OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_OUT: tl.constexpr,
                     DOWN_INT8: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """The last program of a token block: each stream's 1/rms (stored for launch 2), the projection as
    the sum over streams of 1/rms times their partials (INT8: times each row's scale), then
    silu(. / hc) -> low, 2 sigmoid(. / hc) -> inject. Partials are read past L1 (.cg): other programs
    wrote them."""
    rows = tl.arange(0, BLOCK_OUT)
    projected = tl.zeros((BLOCK_N, BLOCK_OUT), dtype=tl.float32)
    token_rows = tokens.to(tl.int64) * num_slices
    for stream in range(HC):
        squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
        partial = tl.zeros((BLOCK_N, BLOCK_OUT), dtype=tl.float32)
        for part in range(SPLIT):
            slice_rows = token_rows + stream * SPLIT + part
            squares += tl.load(sumsq_ptr + slice_rows, mask=t_mask, other=0.0, cache_modifier=".cg")
            partial += tl.load(partial_ptr + slice_rows[:, None] * OUT_ROWS + rows[None, :],
                               mask=t_mask[:, None] & (rows < OUT_ROWS)[None, :], other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(squares / HIDDEN + eps)
        tl.store(rstd_ptr + tokens * HC + stream, rstd, mask=t_mask)
        projected += rstd[:, None] * partial
    if DOWN_INT8:
        projected *= tl.load(down_scale_ptr + rows, mask=rows < OUT_ROWS, other=0.0).to(tl.float32)[None, :]
    projected = round_to(projected, DTYPE, PRECISION).to(tl.float32)  # the linear's output dtype
    scaled = round_to(projected / HC, DTYPE, PRECISION).to(tl.float32)
    low = round_to(scaled * tl.sigmoid(scaled), DTYPE, PRECISION)
    tl.store(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + rows[None, :], low,
             mask=t_mask[:, None] & (rows < LOWRANK)[None, :])
    if OUT_ROWS > LOWRANK:
        inject = 2.0 * round_to(tl.sigmoid(scaled), DTYPE, PRECISION).to(tl.float32)
        tl.store(inject_ptr + tokens.to(tl.int64)[:, None] * HC + (rows - LOWRANK)[None, :],
                 round_to(inject, DTYPE, PRECISION),
                 mask=t_mask[:, None] & ((rows >= LOWRANK) & (rows < OUT_ROWS))[None, :])


@triton.jit
def _mix_down_kernel(x_ptr, stride_x, norm_ptr, w_ptr, w_scale_ptr, partial_ptr, sumsq_ptr, counter_ptr, low_ptr,
                     rstd_ptr, inject_ptr, n_tokens, slice_width, eps, HIDDEN: tl.constexpr, HC: tl.constexpr,
                     SPLIT: tl.constexpr, LOWRANK: tl.constexpr, OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_OUT: tl.constexpr, INT8: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Program (row block, slice, token block): partial [token, slice, row] of W_down|inj times
    x * (1 + w_norm) over one slice of one stream; row block 0 also stores the slice's sum of squares.
    INT8: the weight's signed values q (exact in the streams' dtype), its row scales (w_scale_ptr)
    applied by the finishing program."""
    row_block, slice_id, token_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_slices = tl.num_programs(1)
    dtype = x_ptr.dtype.element_ty
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    rows = row_block * BLOCK_J + tl.arange(0, BLOCK_J)
    r_mask = rows < OUT_ROWS
    stream, part = slice_id // SPLIT, slice_id % SPLIT
    start = stream * HIDDEN + part * slice_width
    end = stream * HIDDEN + tl.minimum((part + 1) * slice_width, HIDDEN)
    acc = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
    squares = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        columns = k0 + tl.arange(0, BLOCK_K)
        c_mask = columns < end
        x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + columns[None, :],
                    mask=t_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        squares += x * x
        scale = 1.0 + tl.load(norm_ptr + columns, mask=c_mask, other=0.0).to(tl.float32)
        if INT8:
            w = int8_tile(w_ptr, rows.to(tl.int64), r_mask, k0, end, HC * HIDDEN // 4, BLOCK_J, BLOCK_K).to(dtype)
        else:
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (HC * HIDDEN) + columns[None, :],
                        mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        acc = dot_acc(acc, round_to(x * scale[None, :], dtype, PRECISION), w, PRECISION)
    slice_rows = tokens.to(tl.int64) * num_slices + slice_id
    tl.store(partial_ptr + slice_rows[:, None] * OUT_ROWS + rows[None, :], acc, mask=t_mask[:, None] & r_mask[None, :])
    if row_block == 0:
        tl.store(sumsq_ptr + slice_rows, tl.sum(squares, axis=1), mask=t_mask)
    tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
    arrived = tl.atomic_add(counter_ptr + token_block, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) * num_slices - 1:
        _finish_mix_down(partial_ptr, sumsq_ptr, w_scale_ptr, low_ptr, rstd_ptr, inject_ptr, tokens, t_mask,
                         num_slices, eps, HIDDEN, HC, SPLIT, LOWRANK, OUT_ROWS, BLOCK_N, BLOCK_OUT, INT8, dtype,
                         PRECISION)
        tl.atomic_xchg(counter_ptr + token_block, 0)  # ready for the next launch


@triton.jit
def _mix_up_kernel(x_ptr, stride_x, norm_ptr, up_ptr, up_scale_ptr, low_ptr, rstd_ptr, out_ptr, n_tokens,
                   HIDDEN: tl.constexpr, HC: tl.constexpr, LOWRANK: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr):
    """Program (column block, token block): block input [tokens, columns] = mean over streams s of
    sigmoid(W_up[s*H + columns] . low) * normed stream s at those columns. INT8: W_up's signed values,
    each row's dot product times its scale (up_scale_ptr)."""
    column_block, token_block = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    columns = column_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = columns < HIDDEN
    total = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    for stream in range(HC):
        channels = stream * HIDDEN + columns
        acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
        for r0 in range(0, LOWRANK, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            r_mask = ranks < LOWRANK
            low = tl.load(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                          mask=t_mask[:, None] & r_mask[None, :], other=0.0)
            if INT8:
                up = int8_tile(up_ptr, channels.to(tl.int64), h_mask, r0, LOWRANK, LOWRANK // 4, BLOCK_H,
                               BLOCK_R).to(dtype)
            else:
                up = tl.load(up_ptr + channels.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                             mask=h_mask[:, None] & r_mask[None, :], other=0.0)
            acc = dot_acc(acc, low, up, PRECISION)
        if INT8:
            acc *= tl.load(up_scale_ptr + channels, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        gate = round_to(tl.sigmoid(round_to(acc, dtype, PRECISION).to(tl.float32)), dtype, PRECISION).to(tl.float32)
        x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + channels[None, :],
                    mask=t_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tokens * HC + stream, mask=t_mask, other=0.0)
        scale = 1.0 + tl.load(norm_ptr + channels, mask=h_mask, other=0.0).to(tl.float32)
        normed = round_to(x * rstd[:, None] * scale[None, :], dtype, PRECISION).to(tl.float32)
        total += round_to(gate * normed, dtype, PRECISION).to(tl.float32)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + columns[None, :],
             round_to(total / HC, dtype, PRECISION), mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def _combine_kernel(x_ptr, stride_x, block_ptr, stride_block, inject_ptr, stride_inject, out_ptr,
                    HIDDEN: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """Program (token, column block): every stream's columns + inject[s] * block output there."""
    token, column_block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    columns = column_block * BLOCK + tl.arange(0, BLOCK)
    mask = columns < HIDDEN
    block_output = tl.load(block_ptr + token * stride_block + columns, mask=mask, other=0.0).to(tl.float32)
    for stream in range(HC):
        inject = tl.load(inject_ptr + token * stride_inject + stream).to(tl.float32)
        x = tl.load(x_ptr + token * stride_x + stream * HIDDEN + columns, mask=mask, other=0.0).to(tl.float32)
        added = round_to(block_output * inject, dtype, PRECISION).to(tl.float32)
        tl.store(out_ptr + token * (HC * HIDDEN) + stream * HIDDEN + columns, round_to(x + added, dtype, PRECISION),
                 mask=mask)


def mix(
    streams: torch.Tensor, norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
    hc_count: int, eps: float, down_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `naive.mix`, for up to MAX_TOKENS tokens, in two launches; INT8 weights (given with their
    scales) are read packed, in place."""
    lowrank, with_inject = check_mix_args(streams, norm_weight, int8_weight_shape(down_weight, down_scale),
                                          int8_weight_shape(up_weight, up_scale), hc_count)
    n, width = streams.shape
    hidden, out_rows = width // hc_count, down_weight.shape[0]
    if (down_scale is not None or up_scale is not None) and hidden % 4:
        raise ValueError(f"hyper-connection kernel: INT8 weights need a stream width divisible by 4, got {hidden}")
    if n > MAX_TOKENS:
        raise ValueError(f"hyper-connection kernel: {n} tokens, at most {MAX_TOKENS} (larger batches take the "
                         "reference)")
    block_input = streams.new_empty(n, hidden)
    inject = streams.new_empty(n, hc_count) if with_inject else None
    if n == 0:
        return block_input, inject
    if streams.stride(1) != 1:
        raise ValueError("hyper-connection kernel: the streams' last dimension must be contiguous")
    down_weight, up_weight, norm_weight = down_weight.contiguous(), up_weight.contiguous(), norm_weight.contiguous()
    down_int8, up_int8 = down_scale is not None, up_scale is not None
    down_scale = down_scale.contiguous() if down_int8 else down_weight  # (a dense weight's is never read)
    up_scale = up_scale.contiguous() if up_int8 else up_weight
    block_j, block_k, split_goal, down_warps = next(tiles for bound, tiles in DOWN_TILES if n <= bound)
    slice_width = triton.cdiv(triton.cdiv(hidden, split_goal), block_k) * block_k
    slices = hc_count * triton.cdiv(hidden, slice_width)
    split = slices // hc_count
    token_blocks = triton.cdiv(n, BLOCK_N)
    f32 = {"dtype": torch.float32, "device": streams.device}
    partial, sumsq = torch.empty(n, slices, out_rows, **f32), torch.empty(n, slices, **f32)
    low, rstd = streams.new_empty(n, lowrank), torch.empty(n, hc_count, **f32)
    counters = arrival_counters("hyper_connection", streams.device, triton.cdiv(MAX_TOKENS, BLOCK_N))
    precision = dot_precision(streams)
    _mix_down_kernel[(triton.cdiv(out_rows, block_j), slices, token_blocks)](
        streams, streams.stride(0), norm_weight, down_weight, down_scale, partial, sumsq, counters, low, rstd,
        inject if with_inject else low, n, slice_width, eps, HIDDEN=hidden, HC=hc_count, SPLIT=split,
        LOWRANK=lowrank, OUT_ROWS=out_rows, BLOCK_N=BLOCK_N, BLOCK_J=block_j, BLOCK_K=block_k,
        BLOCK_OUT=triton.next_power_of_2(out_rows), INT8=down_int8, PRECISION=precision,
        num_warps=down_warps,
    )
    _mix_up_kernel[(triton.cdiv(hidden, BLOCK_H), token_blocks)](
        streams, streams.stride(0), norm_weight, up_weight, up_scale, low, rstd, block_input, n, HIDDEN=hidden,
        HC=hc_count, LOWRANK=lowrank, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_R=BLOCK_R,
        INT8=up_int8, PRECISION=precision, num_warps=UP_WARPS,
    )
    return block_input, inject


def combine(streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """As `naive.combine`, in one launch."""
    n, width = streams.shape
    hc_count = inject.shape[1]
    hidden = width // hc_count
    if block_output.shape != (n, hidden) or inject.shape != (n, hc_count) or width != hc_count * hidden:
        raise ValueError(f"hyper-connection combine: streams {tuple(streams.shape)}, block output "
                         f"{tuple(block_output.shape)} and inject {tuple(inject.shape)} do not fit together")
    if streams.stride(1) != 1 or block_output.stride(1) != 1 or inject.stride(1) != 1:
        raise ValueError("hyper-connection combine: every input's last dimension must be contiguous")
    out = torch.empty(n, width, dtype=streams.dtype, device=streams.device)
    if n:
        _combine_kernel[(n, triton.cdiv(hidden, COMBINE_BLOCK))](
            streams, streams.stride(0), block_output, block_output.stride(0), inject, inject.stride(0), out,
            HIDDEN=hidden, HC=hc_count, BLOCK=COMBINE_BLOCK, PRECISION=dot_precision(streams), num_warps=4,
        )
    return out
