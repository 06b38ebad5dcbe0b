"""Hyper-connections' mix and combine as Triton kernels (same signatures as `naive`), for decode batches.

mix, two launches (at the real widths, hc 4 x H 2560, r 320: W_down|inj 6.6 MB and W_up 6.6 MB, each read
once per BLOCK_N tokens). A decode GEMV this small is bound by load latency, not arithmetic, so each
program reads one tile, with no loop, and many programs run at once:
  1. `_mix_down_kernel`, programs over (BLOCK_J rows of W_down|inj, one BLOCK_K slice of one stream,
     token block): 21 x 20 = 420 at the real widths. The RMSNorm is linear in x once each stream's rms
     is known, so a program multiplies x * (1 + w_norm) (rounded to the streams' dtype, as the reference
     rounds the normed input) by its weight tile and stores an fp32 partial, plus its slice's sum of
     squares. The last of a row block's slices to arrive (`split_reduce.arrival_counters`) adds the
     partials of each stream times that stream's 1/rms and applies the mixer's activations to its rows:
     silu(. / hc) -> the low-rank vector (for launch 2), 2 sigmoid(. / hc) -> the injection gates.
  2. `_mix_up_kernel`, programs over (BLOCK_H of the H columns, token block): for each stream s, the
     gates sigmoid(W_up[s] . low) of its columns (W_up's rows read whole: one tile per stream), the
     normed streams (x / rms * (1 + w)), and the mean over streams of their products.
combine, one launch (`_combine_kernel`): streams + inject[s] * block_output, the streams read in place.
Values are rounded to the streams' dtype where the reference rounds them; sums are fp32. No host sync:
CUDA graphs capture all three. Up to MAX_TOKENS tokens (prefill chunks take the reference's GEMMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.hyper_connection.naive import check_mix_args
from tierlm.kernels.quant_linear.triton import dot_precision, round_to
from tierlm.kernels.split_reduce import arrival_counters, dot_acc

MAX_TOKENS = 64
BLOCK_N = 16  # tokens per program: tl.dot's least M
BLOCK_J, BLOCK_K = 16, 512  # launch 1: W_down|inj rows and stream columns per program
BLOCK_H = 16  # launch 2: H columns per program (160 programs at the real widths)
NUM_WARPS = 8
COMBINE_BLOCK = 256


@triton.jit
def _mix_down_kernel(x_ptr, stride_x, norm_ptr, w_ptr, partial_ptr, sumsq_ptr, counter_ptr, low_ptr, rstd_ptr,
                     inject_ptr, n_tokens, eps, HIDDEN: tl.constexpr, HC: tl.constexpr, LOWRANK: tl.constexpr,
                     OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Program (row block, slice, token block): the partial [token, slice, row] of W_down|inj times
    x * (1 + w_norm) over one slice of one stream, and the slice's sum of squares [row block, token, slice]
    (each row block keeps its own: its last program needs no other row block's)."""
    row_block, slice_id, token_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_slices = tl.num_programs(1)
    per_stream = num_slices // HC
    dtype = x_ptr.dtype.element_ty
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    rows = row_block * BLOCK_J + tl.arange(0, BLOCK_J)
    r_mask = rows < OUT_ROWS
    stream, part = slice_id // per_stream, slice_id % per_stream
    within = part * BLOCK_K + tl.arange(0, BLOCK_K)
    c_mask = within < HIDDEN
    columns = stream * HIDDEN + within
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + columns[None, :],
                mask=t_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
    scale = 1.0 + tl.load(norm_ptr + columns, mask=c_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (HC * HIDDEN) + columns[None, :],
                mask=r_mask[:, None] & c_mask[None, :], other=0.0)
    acc = dot_acc(tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32), round_to(x * scale[None, :], dtype, PRECISION), w,
                  PRECISION)
    slice_rows = tokens.to(tl.int64) * num_slices + slice_id
    out_mask = t_mask[:, None] & r_mask[None, :]
    tl.store(partial_ptr + slice_rows[:, None] * OUT_ROWS + rows[None, :], acc, mask=out_mask)
    sumsq = sumsq_ptr + row_block * n_tokens * num_slices
    tl.store(sumsq + slice_rows, tl.sum(x * x, axis=1), mask=t_mask)
    tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
    counter = counter_ptr + token_block * tl.num_programs(0) + row_block
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_slices - 1:
        # this row block's projection: sum over streams of 1/rms times the stream's partials (read past L1)
        projected = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
        for s in range(HC):
            squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
            partial = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
            for p in range(per_stream):
                rows_of = tokens.to(tl.int64) * num_slices + s * per_stream + p
                squares += tl.load(sumsq + rows_of, mask=t_mask, other=0.0, cache_modifier=".cg")
                partial += tl.load(partial_ptr + rows_of[:, None] * OUT_ROWS + rows[None, :], mask=out_mask,
                                   other=0.0, cache_modifier=".cg")
            rstd = 1.0 / tl.sqrt(squares / HIDDEN + eps)
            if row_block == 0:
                tl.store(rstd_ptr + tokens * HC + s, rstd, mask=t_mask)
            projected += rstd[:, None] * partial
        projected = round_to(projected, dtype, PRECISION).to(tl.float32)  # the linear's output dtype
        scaled = round_to(projected / HC, dtype, PRECISION).to(tl.float32)
        low = round_to(scaled * tl.sigmoid(scaled), dtype, PRECISION)
        tl.store(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + rows[None, :], low,
                 mask=t_mask[:, None] & (rows < LOWRANK)[None, :])
        if OUT_ROWS > LOWRANK:
            inject = 2.0 * round_to(tl.sigmoid(scaled), dtype, PRECISION).to(tl.float32)
            tl.store(inject_ptr + tokens.to(tl.int64)[:, None] * HC + (rows - LOWRANK)[None, :],
                     round_to(inject, dtype, PRECISION), mask=t_mask[:, None] & ((rows >= LOWRANK) & r_mask)[None, :])
        tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _mix_up_kernel(x_ptr, stride_x, norm_ptr, up_ptr, low_ptr, rstd_ptr, out_ptr, n_tokens, HIDDEN: tl.constexpr,
                   HC: tl.constexpr, LOWRANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """Program (column block, token block): block input [tokens, columns] = mean over streams s of
    sigmoid(W_up[s*H + columns] . low) * normed stream s at those columns."""
    column_block, token_block = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    columns = column_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = columns < HIDDEN
    ranks = tl.arange(0, BLOCK_R)
    r_mask = ranks < LOWRANK
    low = tl.load(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                  mask=t_mask[:, None] & r_mask[None, :], other=0.0)
    total = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    for stream in tl.static_range(HC):
        channels = stream * HIDDEN + columns
        up = tl.load(up_ptr + channels.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                     mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        acc = dot_acc(tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32), low, up, PRECISION)
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
    hc_count: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `naive.mix`, for up to MAX_TOKENS tokens, in two launches."""
    lowrank, with_inject = check_mix_args(streams, norm_weight, down_weight, up_weight, hc_count)
    n, width = streams.shape
    hidden, out_rows = width // hc_count, down_weight.shape[0]
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
    row_blocks, slices = triton.cdiv(out_rows, BLOCK_J), hc_count * triton.cdiv(hidden, BLOCK_K)
    f32 = dict(dtype=torch.float32, device=streams.device)
    partial, sumsq = torch.empty(n, slices, out_rows, **f32), torch.empty(row_blocks, n, slices, **f32)
    low, rstd = streams.new_empty(n, lowrank), torch.empty(n, hc_count, **f32)
    counters = arrival_counters("hyper_connection", streams.device, triton.cdiv(MAX_TOKENS, BLOCK_N) * row_blocks)
    precision = dot_precision(streams)
    _mix_down_kernel[(row_blocks, slices, triton.cdiv(n, BLOCK_N))](
        streams, streams.stride(0), norm_weight, down_weight, partial, sumsq, counters, low, rstd,
        inject if with_inject else low, n, eps, HIDDEN=hidden, HC=hc_count, LOWRANK=lowrank, OUT_ROWS=out_rows,
        BLOCK_N=BLOCK_N, BLOCK_J=BLOCK_J, BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=NUM_WARPS,
    )
    _mix_up_kernel[(triton.cdiv(hidden, BLOCK_H), triton.cdiv(n, BLOCK_N))](
        streams, streams.stride(0), norm_weight, up_weight, low, rstd, block_input, n, HIDDEN=hidden, HC=hc_count,
        LOWRANK=lowrank, BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H, BLOCK_R=triton.next_power_of_2(lowrank),
        PRECISION=precision, num_warps=NUM_WARPS,
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
