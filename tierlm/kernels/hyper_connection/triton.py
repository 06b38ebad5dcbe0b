"""Hyper-connections' mix and combine as Triton kernels (same signatures as `naive`), for decode batches.

mix. At the real widths (hc 4 x H 2560, r 320) its weights are W_down|inj 6.6 MB and W_up 6.6 MB (half
that INT8): a few microseconds of memory traffic, so the time is the chain of dependent steps. The form
before this one took 15 + 10 us per mix on an H200 at one token: launch 1's last program added up
hc x SPLIT partial vectors in a serial loop (40 L2 round trips, and for 16 tokens a single program
reading 0.8 MB), launch 2's programs walked 4 streams x 5 low-rank tiles of 2 KB, one DRAM round trip
each. Here no program loops over its weights: each reads one tile, with every load issued up front.
  down programs (row block of BLOCK_J rows of W_down|inj, one BLOCK_K slice of one stream, token block):
    the RMSNorm is linear in x once each stream's rms is known, so a program multiplies x * (1 + w_norm)
    (rounded to the streams' dtype, as the reference rounds the normed input) by its weight tile and
    stores an fp32 partial and its slice's sum of squares. The last of a row block's programs to arrive
    (`split_reduce.arrival_counters`) loads all of the row block's partials and sums of squares in one
    tile, scales each slice by its stream's 1/rms, sums, and applies the mixer's activations to its
    rows: silu(. / hc) -> the low-rank vector, 2 sigmoid(. / hc) -> the injection gates; row block 0's
    also stores each stream's 1/rms.
  up programs (BLOCK_H of the H columns for all hc streams, token block): one tile of W_up (the
    hc x BLOCK_H rows, the whole low rank), the gates sigmoid(W_up . low), the normed streams
    x / rms * (1 + w) and the mean over streams of their products.
  One launch (MixTiles.one_launch): a program takes a ticket (an atomic counter) when it starts; the
    first tickets are the down programs, the rest the up programs, which load their weight tile, streams
    and norm weights first, then wait until every row block of their tokens is finished (a second
    counter), then read the low-rank vector. A program holding ticket t started after every ticket
    below t, so every down program is running or done before any up program waits: it cannot deadlock,
    whatever order the hardware starts programs in. W_up streams in while W_down is read. The last up
    program to finish sets the counters back to zero. Two launches: the same programs, down then up,
    no tickets and no waiting.
INT8 per-channel mixer weights (int4-mixed checkpoints; half the bytes) are a compile-time variant: each
int32 word tile is loaded once and value j of every word (`_lane`, exact in the streams' dtype, so
tl.dot multiplies it as it multiplies bf16 weights) meets the input columns 4 w + j, loaded strided: four
dots per tile, no reshape; each row's fp32 dot product is multiplied by the row's scale (down: in the
finishing program; up: before the sigmoid). The reference rounds q * scale to the streams' dtype first:
in fp32 the two agree to fp32 roundoff, in bf16 the kernel skips one rounding of the weight.
combine, one launch (`_combine_kernel`): streams + inject[s] * block_output, the streams read in place.
Values are rounded to the streams' dtype where the reference rounds them; sums are fp32, in a fixed order
(the same bits on every call). No host sync: CUDA graphs capture all of it. Up to MAX_TOKENS tokens
(prefill chunks take the reference's GEMMs). Tiles by batch: MIX_TILES (bench/decode_fusions.py --sweep-hc).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tierlm.kernels.hyper_connection.naive import check_mix_args, int8_weight_shape
from tierlm.kernels.quant_linear.triton import dot_precision, round_to
from tierlm.kernels.split_reduce import arrival_counters, dot_acc

MAX_TOKENS = 64
BLOCK_N = 16  # tokens per program: tl.dot's least M
MAX_TOKEN_BLOCKS = MAX_TOKENS // BLOCK_N
COMBINE_BLOCK = 256


class MixTiles(NamedTuple):
    """The mix's launch shape. On a GPU tl.dot needs block_k / lanes >= 16 (lanes: 4 for INT8 weights,
    else 1) and hc x block_h >= 16."""
    one_launch: bool  # down and up programs in one launch (tickets, see above) or in two
    block_j: int  # W_down|inj rows per down program
    block_k: int  # stream columns per down program: hc x cdiv(H, block_k) slices
    block_h: int  # H columns per up program (x hc streams = its rows of W_up, each the whole low rank)
    warps: int


# by batch, the first entry whose token bound covers it. Real widths: 21 row blocks x 20 slices = 420 down
# programs of 16 KB of W_down|inj (the router GEMV's tile, 3.7 us for 2.6 MB on an H200) and 320 up
# programs of 4 x 8 rows x 320 of W_up (20 KB)
MIX_TILES = ((MAX_TOKENS, MixTiles(True, 16, 512, 8, 4)),)

# the arrival counters (`split_reduce`, owner "hyper_connection_mix"), each kind on its own 128-byte line
# (the up programs poll DONE while the down programs count themselves in): [TICKETS] tickets taken,
# [FINISHED] up programs done, [DONE + token block] row blocks finished, [ROW_ARRIVALS + token block *
# row blocks + row block] down programs arrived
TICKETS, FINISHED, DONE, ROW_ARRIVALS = tl.constexpr(0), tl.constexpr(32), tl.constexpr(64), tl.constexpr(96)


@triton.jit
def _lane(words, lane: tl.constexpr, DTYPE: tl.constexpr):
    """Value `lane` (0-3) of each int32 word of INT8 per-channel weights (`naive.int8_weight_shape`),
    q = stored - 128, in DTYPE (exact: small integers), in the words' shape and layout. (Through fp32:
    the interpreter's int32 -> bf16 conversion is wrong, triton 3.9.)"""
    stored = (words.to(tl.uint32, bitcast=True) >> (8 * lane)) & 0xFF
    return (stored.to(tl.int32) - 128).to(tl.float32).to(DTYPE)


@triton.jit
def _down_program(index, x_ptr, stride_x, norm_ptr, w_ptr, w_scale_ptr, partial_ptr, sumsq_ptr, counter_ptr,
                  low_ptr, rstd_ptr, inject_ptr, n_tokens, eps, HIDDEN: tl.constexpr, HC: tl.constexpr,
                  SPLIT: tl.constexpr, LOWRANK: tl.constexpr, OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, SLICES_P2: tl.constexpr, INT8: tl.constexpr,
                  SIGNAL: tl.constexpr, PRECISION: tl.constexpr):
    """Down program `index` = (token block, row block, slice): partial [token, slice, row] of W_down|inj
    times x * (1 + w_norm) over one slice of one stream, and the slice's sum of squares [row block, token,
    slice] (each row block keeps its own: its finishing program needs no other row block's). The last
    of the row block's programs to arrive finishes its rows (`_finish_rows`); SIGNAL: then counts the row
    block as done for the token block's up programs."""
    SLICES: tl.constexpr = HC * SPLIT
    ROW_BLOCKS: tl.constexpr = (OUT_ROWS + BLOCK_J - 1) // BLOCK_J
    LANES: tl.constexpr = 4 if INT8 else 1  # INT8: value j of each word meets input column 4 w + j
    dtype = x_ptr.dtype.element_ty
    slice_id, row_block, token_block = index % SLICES, (index // SLICES) % ROW_BLOCKS, index // (SLICES * ROW_BLOCKS)
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    rows = row_block * BLOCK_J + tl.arange(0, BLOCK_J)
    r_mask = rows < OUT_ROWS
    stream, part = slice_id // SPLIT, slice_id % SPLIT
    first = part * BLOCK_K + tl.arange(0, BLOCK_K // LANES) * LANES  # each word's first column in the stream
    if INT8:  # H % 4 == 0: a word is wholly inside the stream or wholly past it
        words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (HC * HIDDEN // 4) + (stream * HIDDEN + first)[None, :] // 4,
                        mask=r_mask[:, None] & (first < HIDDEN)[None, :], other=0)
    acc = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
    squares = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for lane in tl.static_range(LANES):
        c_mask = first + lane < HIDDEN
        columns = stream * HIDDEN + first + lane
        x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + columns[None, :],
                    mask=t_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
        scale = 1.0 + tl.load(norm_ptr + columns, mask=c_mask, other=0.0).to(tl.float32)
        if INT8:
            w = _lane(words, lane, dtype)
        else:
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (HC * HIDDEN) + columns[None, :],
                        mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        acc = dot_acc(acc, round_to(x * scale[None, :], dtype, PRECISION), w, PRECISION)
    slice_rows = tokens.to(tl.int64) * SLICES + slice_id
    tl.store(partial_ptr + slice_rows[:, None] * OUT_ROWS + rows[None, :], acc, mask=t_mask[:, None] & r_mask[None, :])
    tl.store(sumsq_ptr + row_block * n_tokens * SLICES + slice_rows, squares, mask=t_mask)
    tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
    arrivals = counter_ptr + ROW_ARRIVALS + token_block * ROW_BLOCKS + row_block
    if tl.atomic_add(arrivals, 1, sem="acq_rel") == SLICES - 1:
        _finish_rows(partial_ptr, sumsq_ptr + row_block * n_tokens * SLICES, w_scale_ptr, low_ptr, rstd_ptr,
                     inject_ptr, tokens, t_mask, rows, r_mask, row_block, eps, HIDDEN, HC, SPLIT, LOWRANK, OUT_ROWS,
                     SLICES_P2, INT8, dtype, PRECISION)
        tl.atomic_xchg(arrivals, 0)  # ready for the next launch
        if SIGNAL:
            tl.debug_barrier()  # every thread's stores are issued before the row block counts as done
            tl.atomic_add(counter_ptr + DONE + token_block, 1, sem="release")


@triton.jit
def _finish_rows(partial_ptr, sumsq_ptr, w_scale_ptr, low_ptr, rstd_ptr, inject_ptr, tokens, t_mask, rows, r_mask,
                 row_block, eps, HIDDEN: tl.constexpr, HC: tl.constexpr, SPLIT: tl.constexpr, LOWRANK: tl.constexpr,
                 OUT_ROWS: tl.constexpr, SLICES_P2: tl.constexpr, INT8: tl.constexpr, DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """A row block's last program: every slice's partial and sum of squares in one load each (read past
    L1, .cg: other programs wrote them), each stream's 1/rms (row block 0 stores it), the projection as
    the sum over slices of their stream's 1/rms times the partial (INT8: times each row's scale), then
    silu(. / hc) -> low, 2 sigmoid(. / hc) -> inject."""
    SLICES: tl.constexpr = HC * SPLIT
    slices = tl.arange(0, SLICES_P2)
    s_mask = slices < SLICES
    slice_rows = tokens.to(tl.int64)[:, None] * SLICES + slices[None, :]  # [BLOCK_N, SLICES_P2]
    ts_mask = t_mask[:, None] & s_mask[None, :]
    partial = tl.load(partial_ptr + slice_rows[:, :, None] * OUT_ROWS + rows[None, None, :],
                      mask=ts_mask[:, :, None] & r_mask[None, None, :], other=0.0, cache_modifier=".cg")
    squares = tl.load(sumsq_ptr + slice_rows, mask=ts_mask, other=0.0, cache_modifier=".cg")
    stream_of = slices // SPLIT
    slice_rstd = tl.zeros_like(squares)
    for stream in tl.static_range(HC):
        in_stream = (stream_of == stream)[None, :]
        rstd = 1.0 / tl.sqrt(tl.sum(tl.where(in_stream, squares, 0.0), axis=1) / HIDDEN + eps)
        if row_block == 0:
            tl.store(rstd_ptr + tokens * HC + stream, rstd, mask=t_mask)
        slice_rstd = tl.where(in_stream, rstd[:, None], slice_rstd)
    projected = tl.sum(partial * slice_rstd[:, :, None], axis=1)
    if INT8:
        projected *= tl.load(w_scale_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    projected = round_to(projected, DTYPE, PRECISION).to(tl.float32)  # the linear's output dtype
    scaled = round_to(projected / HC, DTYPE, PRECISION).to(tl.float32)
    low = round_to(scaled * tl.sigmoid(scaled), DTYPE, PRECISION)
    tl.store(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + rows[None, :], low,
             mask=t_mask[:, None] & (rows < LOWRANK)[None, :])
    if OUT_ROWS > LOWRANK:
        inject = 2.0 * round_to(tl.sigmoid(scaled), DTYPE, PRECISION).to(tl.float32)
        tl.store(inject_ptr + tokens.to(tl.int64)[:, None] * HC + (rows - LOWRANK)[None, :],
                 round_to(inject, DTYPE, PRECISION), mask=t_mask[:, None] & ((rows >= LOWRANK) & r_mask)[None, :])


@triton.jit
def _up_program(index, x_ptr, stride_x, norm_ptr, up_ptr, up_scale_ptr, counter_ptr, low_ptr, rstd_ptr, out_ptr,
                n_tokens, HIDDEN: tl.constexpr, HC: tl.constexpr, HC_P2: tl.constexpr, LOWRANK: tl.constexpr,
                ROW_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                INT8: tl.constexpr, WAIT: tl.constexpr, PRECISION: tl.constexpr):
    """Up program `index` = (token block, column block): block input [tokens, columns] = mean over streams
    s of sigmoid(W_up[s*H + columns] . low) * normed stream s at those columns, all streams' rows in one
    tile [HC_P2 * BLOCK_H, BLOCK_R]. WAIT: everything that does not need the down programs is loaded
    first, then the program waits until the token block's ROW_BLOCKS row blocks are done. INT8: W_up's
    signed values, each row's dot product times its scale (up_scale_ptr)."""
    COLUMN_BLOCKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    LANES: tl.constexpr = 4 if INT8 else 1  # INT8: value j of each word meets rank 4 w + j
    dtype = x_ptr.dtype.element_ty
    column_block, token_block = index % COLUMN_BLOCKS, index // COLUMN_BLOCKS
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    lanes = tl.arange(0, HC_P2 * BLOCK_H)  # (stream, column) pairs, stream-major
    stream_of, columns = lanes // BLOCK_H, column_block * BLOCK_H + lanes % BLOCK_H
    ch_mask = (stream_of < HC) & (columns < HIDDEN)
    channels = stream_of * HIDDEN + columns
    first = tl.arange(0, BLOCK_R // LANES) * LANES  # each word's first rank
    w_mask = ch_mask[:, None] & (first < LOWRANK)[None, :]
    if INT8:
        weights = tl.load(up_ptr + channels.to(tl.int64)[:, None] * (LOWRANK // 4) + (first // 4)[None, :],
                          mask=w_mask, other=0)
        up_scale = tl.load(up_scale_ptr + channels, mask=ch_mask, other=0.0).to(tl.float32)
    else:
        weights = tl.load(up_ptr + channels.to(tl.int64)[:, None] * LOWRANK + first[None, :], mask=w_mask, other=0.0)
    tc_mask = t_mask[:, None] & ch_mask[None, :]
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + channels[None, :], mask=tc_mask,
                other=0.0).to(tl.float32)
    scale = 1.0 + tl.load(norm_ptr + channels, mask=ch_mask, other=0.0).to(tl.float32)
    if WAIT:
        done = counter_ptr + DONE + token_block
        if PRECISION == "interpreter":
            # it runs programs one by one in ticket order: nothing to wait for. A token block whose row
            # blocks are not all counted done (on a GPU: a hang) poisons the output instead, for tests to see
            ready = tl.atomic_add(done, 0, sem="acquire")
            scale += tl.where(ready == ROW_BLOCKS, 0.0, float("nan"))
        else:
            ready = tl.load(done, volatile=True)  # polled with plain loads: no read-modify-writes on the line
            while ready < ROW_BLOCKS:
                ready = tl.load(done, volatile=True)
            tl.atomic_add(done, 0, sem="acquire")  # the finishers' stores (released with their counts) seen below
    acc = tl.zeros((BLOCK_N, HC_P2 * BLOCK_H), dtype=tl.float32)
    for lane in tl.static_range(LANES):
        low = tl.load(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + (first + lane)[None, :],
                      mask=t_mask[:, None] & (first + lane < LOWRANK)[None, :], other=0.0, cache_modifier=".cg")
        if INT8:
            acc = dot_acc(acc, low, _lane(weights, lane, dtype), PRECISION)
        else:
            acc = dot_acc(acc, low, weights, PRECISION)
    if INT8:
        acc *= up_scale[None, :]
    gate = round_to(tl.sigmoid(round_to(acc, dtype, PRECISION).to(tl.float32)), dtype, PRECISION).to(tl.float32)
    rstd = tl.load(rstd_ptr + tokens[:, None] * HC + stream_of[None, :], mask=tc_mask, other=0.0, cache_modifier=".cg")
    normed = round_to(x * rstd * scale[None, :], dtype, PRECISION).to(tl.float32)
    products = round_to(gate * normed, dtype, PRECISION).to(tl.float32)  # 0 at padded streams and columns
    total = tl.sum(tl.reshape(products, (BLOCK_N, HC_P2, BLOCK_H)), axis=1)
    out_columns = column_block * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + out_columns[None, :],
             round_to(total / HC, dtype, PRECISION), mask=t_mask[:, None] & (out_columns < HIDDEN)[None, :])


@triton.jit
def _reset_if_last(counter_ptr, token_blocks, up_programs):
    """One launch: an up program counts itself done; the last sets the launch's counters back to zero
    (every program has taken its ticket by then: every down program for the up programs to be done)."""
    if tl.atomic_add(counter_ptr + FINISHED, 1, sem="acq_rel") == up_programs - 1:
        tl.atomic_xchg(counter_ptr + TICKETS, 0)
        for block in range(token_blocks):
            tl.atomic_xchg(counter_ptr + DONE + block, 0)
        tl.atomic_xchg(counter_ptr + FINISHED, 0)


@triton.jit
def _mix_kernel(x_ptr, stride_x, norm_ptr, down_ptr, down_scale_ptr, up_ptr, up_scale_ptr, partial_ptr, sumsq_ptr,
                counter_ptr, low_ptr, rstd_ptr, inject_ptr, out_ptr, n_tokens, token_blocks, eps,
                HIDDEN: tl.constexpr, HC: tl.constexpr, HC_P2: tl.constexpr, SPLIT: tl.constexpr,
                LOWRANK: tl.constexpr, OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                BLOCK_K: tl.constexpr, SLICES_P2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                DOWN_INT8: tl.constexpr, UP_INT8: tl.constexpr, ROLE: tl.constexpr, PRECISION: tl.constexpr):
    """ROLE "down": program i is down program i; "up": up program i (after a launch of the down ones);
    "both": a program's ticket t is down program t, or up program t - (number of down programs)."""
    ROW_BLOCKS: tl.constexpr = (OUT_ROWS + BLOCK_J - 1) // BLOCK_J
    COLUMN_BLOCKS: tl.constexpr = (HIDDEN + BLOCK_H - 1) // BLOCK_H
    if ROLE == "down":
        _down_program(tl.program_id(0), x_ptr, stride_x, norm_ptr, down_ptr, down_scale_ptr, partial_ptr, sumsq_ptr,
                      counter_ptr, low_ptr, rstd_ptr, inject_ptr, n_tokens, eps, HIDDEN, HC, SPLIT, LOWRANK, OUT_ROWS,
                      BLOCK_N, BLOCK_J, BLOCK_K, SLICES_P2, DOWN_INT8, False, PRECISION)
    elif ROLE == "up":
        _up_program(tl.program_id(0), x_ptr, stride_x, norm_ptr, up_ptr, up_scale_ptr, counter_ptr, low_ptr, rstd_ptr,
                    out_ptr, n_tokens, HIDDEN, HC, HC_P2, LOWRANK, ROW_BLOCKS, BLOCK_N, BLOCK_H, BLOCK_R, UP_INT8,
                    False, PRECISION)
    else:
        ticket = tl.atomic_add(counter_ptr + TICKETS, 1, sem="relaxed")
        down_programs = token_blocks * (ROW_BLOCKS * HC * SPLIT)
        if ticket < down_programs:
            _down_program(ticket, x_ptr, stride_x, norm_ptr, down_ptr, down_scale_ptr, partial_ptr, sumsq_ptr,
                          counter_ptr, low_ptr, rstd_ptr, inject_ptr, n_tokens, eps, HIDDEN, HC, SPLIT, LOWRANK,
                          OUT_ROWS, BLOCK_N, BLOCK_J, BLOCK_K, SLICES_P2, DOWN_INT8, True, PRECISION)
        else:
            _up_program(ticket - down_programs, x_ptr, stride_x, norm_ptr, up_ptr, up_scale_ptr, counter_ptr, low_ptr,
                        rstd_ptr, out_ptr, n_tokens, HIDDEN, HC, HC_P2, LOWRANK, ROW_BLOCKS, BLOCK_N, BLOCK_H, BLOCK_R,
                        UP_INT8, True, PRECISION)
            _reset_if_last(counter_ptr, token_blocks, token_blocks * COLUMN_BLOCKS)


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
    """As `naive.mix`, for up to MAX_TOKENS tokens, in one launch or two (MIX_TILES); INT8 weights (given
    with their scales) are read packed, in place."""
    lowrank, with_inject = check_mix_args(streams, norm_weight, int8_weight_shape(down_weight, down_scale),
                                          int8_weight_shape(up_weight, up_scale), hc_count)
    n, width = streams.shape
    hidden, out_rows = width // hc_count, down_weight.shape[0]
    down_int8, up_int8 = down_scale is not None, up_scale is not None
    if (down_int8 or up_int8) and hidden % 4:
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
    down_scale = down_scale.contiguous() if down_int8 else down_weight  # (a dense weight's is never read)
    up_scale = up_scale.contiguous() if up_int8 else up_weight
    tiles = next(tiles for bound, tiles in MIX_TILES if n <= bound)
    if tiles.block_k % 4 and down_int8:
        raise ValueError(f"hyper-connection kernel: INT8 weights need block_k divisible by 4, got {tiles.block_k}")
    split = triton.cdiv(hidden, tiles.block_k)
    row_blocks, column_blocks = triton.cdiv(out_rows, tiles.block_j), triton.cdiv(hidden, tiles.block_h)
    token_blocks = triton.cdiv(n, BLOCK_N)
    f32 = {"dtype": torch.float32, "device": streams.device}
    partial, sumsq = torch.empty(n, hc_count * split, out_rows, **f32), torch.empty(row_blocks, n, hc_count * split, **f32)
    low, rstd = streams.new_empty(n, lowrank), torch.empty(n, hc_count, **f32)
    counters = arrival_counters("hyper_connection_mix", streams.device,
                                ROW_ARRIVALS.value + MAX_TOKEN_BLOCKS * row_blocks)
    args = (streams, streams.stride(0), norm_weight, down_weight, down_scale, up_weight, up_scale, partial, sumsq,
            counters, low, rstd, inject if with_inject else low, block_input, n, token_blocks, eps)
    constants = {
        "HIDDEN": hidden, "HC": hc_count, "HC_P2": triton.next_power_of_2(hc_count), "SPLIT": split,
        "LOWRANK": lowrank, "OUT_ROWS": out_rows, "BLOCK_N": BLOCK_N, "BLOCK_J": tiles.block_j,
        "BLOCK_K": tiles.block_k, "SLICES_P2": triton.next_power_of_2(hc_count * split), "BLOCK_H": tiles.block_h,
        # the whole low rank in one tile (INT8: each of the 4 lanes at least tl.dot's least K)
        "BLOCK_R": max(triton.next_power_of_2(lowrank), 64 if up_int8 else 16),
        "DOWN_INT8": down_int8, "UP_INT8": up_int8, "PRECISION": dot_precision(streams), "num_warps": tiles.warps,
    }
    down_programs, up_programs = token_blocks * row_blocks * hc_count * split, token_blocks * column_blocks
    if tiles.one_launch:
        _mix_kernel[(down_programs + up_programs,)](*args, ROLE="both", **constants)
    else:
        _mix_kernel[(down_programs,)](*args, ROLE="down", **constants)
        _mix_kernel[(up_programs,)](*args, ROLE="up", **constants)
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
