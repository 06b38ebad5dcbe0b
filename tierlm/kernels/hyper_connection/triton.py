"""Hyper-connections' mix and combine as Triton kernels (same signatures as `naive`), for decode batches.

mix, two launches. At the real widths (hc 4 x H 2560, r 320) W_down|inj and W_up are 6.6 MB each in bf16
(half that INT8): ~1.6 us each at copy bandwidth, so a mix costs its chain of dependent steps, not its
bytes. Here no program loops over its weights: each reads one tile, with every load issued up front (the
loop over streams is unrolled), then computes and stores. (The form before this one took
15 + 10.5 us on an H200 at one token: launch 1's last program summed hc x SPLIT partial tiles one after
another, and each launch-2 program walked 4 streams x 5 low-rank tiles, one memory round trip each.)
  1. `_mix_down_kernel`, programs over (slice, row block, token block); a slice is BLOCK_K columns of one
     stream. The RMSNorm is linear in x once each stream's rms is known, so a program multiplies
     x * (1 + w_norm) (rounded to the streams' dtype, as the reference rounds the normed input) by its
     tile of BLOCK_J rows of W_down|inj and stores an fp32 partial per (token, slice, row), and the slice's
     sum of squares (each row block its own copy). The last of a row block's programs to arrive
     (`split_reduce.arrival_counters`, a counter per row block and token block) loads all of the row
     block's partials and sums of squares in one tile each, takes each stream's 1/rms, sums the partials
     times their stream's 1/rms and applies the mixer's activations to its rows: silu(. / hc) -> the
     low-rank vector, 2 sigmoid(. / hc) -> the injection gates; row block 0's also stores each stream's
     1/rms for launch 2. The row blocks finish in parallel, each in one more round trip to L2.
  2. `_mix_up_kernel`, programs over (BLOCK_H of the H columns, token block): each stream's BLOCK_H rows
     of W_up (the whole low rank), the gates sigmoid(W_up . low), the normed streams x / rms * (1 + w), and
     the mean over streams of their products. The GEMV form holds every stream's rows as one tile
     [hc x BLOCK_H, r] (stream-major): one sum over the low rank for all of them and the mean over streams
     a sum within each thread's rows (sm_90: 20 barriers a program at one token against 29 with a tile a
     stream, 22 against 37 without up_finish); its inputs (low, every stream's x and 1/rms, each 1/rms
     loaded or added from the sums of squares in the layout it is used in) are all loaded right after the
     wait, before the first product. The tl.dot form walks the streams, a tile each. (H100, the 4-layer
     bf16 stack, bench/results/decode_roofline_nvidia-h100_s22.txt, ctx 512: alone, one process a tree,
     0.998x at one stream and 1.017x at four; with the GDN kernel's early state, alternating, 1.009-1.013x
     and 1.017x, int4-mixed 1.001x / 1.017x.)
  With MixTiles.up_finish (one token: MIX_TILES) launch 1 has no arrival: row block 0's programs store the
  sums of squares, and every launch-2 program loads all the partials with its inputs (MIX_TILES' one-token
  slices are whole streams, BLOCK_K >= H: [4 slices, rows], 5 KB a token) and finishes the projection
  itself (`_projected_rows`: the same fixed-order sums, redundantly in each program; column block 0's
  store the injection gates). That saves launch 1's memory barrier, atomic and second round trip; it costs
  each up program the partials' registers (sm_90, triton 3.6, real widths, the merged tile: 168 a thread
  at one token against 92 without; 2 tokens 128 / 167 / 255 at block_h 2 / 4 / 8, no spills; before the
  merged tile 2 tokens spilled or read slower, MIX_TILES).
  Products (`_times_rows`), by MixTiles.block_n, the tokens per program: from 16 (tl.dot's least M, fewer
  tokens padded) tl.dot; below 16 a broadcast multiply and a sum over K in fp32 (a GEMV: for 1-8 tokens
  no padded tensor-core tile and no shared-memory staging). Tiles by batch: MIX_TILES, picked with
  `bench/decode_fusions.py --sweep-hc` (H200; one token's on an H100, in the 4-layer stack: MIX_TILES).
INT8 per-channel mixer weights (int4-mixed checkpoints; half the bytes) are a compile-time variant of both
launches: each int32 word is loaded once and split into its 4 signed values in registers (`_int8_values`,
exact in the streams' dtype, so both product forms multiply them as they multiply bf16 weights), and each
row's fp32 dot product is multiplied by the row's scale (W_down|inj's: by the program that finishes the
projection, after the sum over slices; W_up's: before the sigmoid). The reference rounds q * scale to the
streams' dtype first: in fp32 the two agree to fp32 roundoff, in bf16 the kernel skips one rounding of the
weight.
combine, one launch (`_combine_kernel`): streams + inject[s] * block_output, the streams read in place.
combine_and_mix: a combine folded into the next mix (`_mix_down_kernel`'s COMBINE): its programs add the
block output to the streams as they read them, row block 0's store the new streams, launch 2 reads those.
Values are rounded to the streams' dtype where the reference rounds them; sums are fp32 in a fixed order
(no float atomics: the same bits on every call). No host sync: CUDA graphs capture them all. Up to
MAX_TOKENS tokens (prefill chunks take the reference's GEMMs).
(One launch instead of two, measured on an H200 in session 12 and dropped: the down programs counted
themselves in and the up programs, later in the grid, spun on that count before finishing; in bf16 18.8-22.9
us a mix at one token against 12.0, 40.9-58.5 against 22.8 at four, over the tiles tried, with a nanosleep of
0-1000 ns between polls or none.)
Every launch uses programmatic dependent launch (`kernels/dependent_launch`): a down program loads its
weight tile and norm weight before it waits for the kernel before it; an up program every stream's W_up
tile, scales and norm weight in the GEMV form, the first stream's in the tl.dot form (DOT_PRELOADED_STREAMS:
more would spill), so those bytes can stream in while the kernel before it finishes. combine has no
weights and waits first.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.hyper_connection.naive import check_mix_args, int8_weight_shape
from tierlm.kernels.quant_linear.triton import dot_precision, round_to
from tierlm.kernels.split_reduce import arrival_counters, dot_acc

MAX_TOKENS = 64
DOT_MIN = 16  # tl.dot's least size of each dimension on a GPU
COMBINE_BLOCK = 256
# the up programs' streams whose W_up tiles load before the wait (PDL) in the tl.dot form (block_n >= DOT_MIN);
# the GEMV form loads every stream's. Compiled for sm_90 (ptxas, triton 3.6, real widths, 16 tokens): with
# more, the [16, 512] tiles no longer fit in registers beside the products (2: 512 bytes of spills, 4: 1,856)
DOT_PRELOADED_STREAMS = 1


class MixTiles(NamedTuple):
    """The mix's launch shape; every number a power of 2. The tl.dot form (block_n >= DOT_MIN) needs block_j,
    block_h and block_k >= DOT_MIN and no up_finish; INT8 weights block_k >= 4 (whole words)."""
    block_n: int  # tokens per program: from DOT_MIN products by tl.dot, below by broadcast multiply + sum
    block_j: int  # rows of W_down|inj per down program
    block_k: int  # stream columns per down program: hc x cdiv(H, block_k) slices
    down_warps: int
    block_h: int  # H columns per up program (its rows of W_up: hc x block_h, each the whole low rank)
    up_warps: int
    up_finish: bool = False  # the GEMV form only: every up program sums the down projection's slices and
    #                          applies the mixer's activations itself (no arrival round trip in launch 1)


# by batch, the first entry whose token bound covers it: the candidate nearest each batch's best over real
# and demo-small widths, bf16 and INT8 (H200, `bench/decode_fusions.py --sweep-hc`, session 8;
# bench/results/decode_fusions_hc_sweep_nvidia-h200.json). Real widths, bf16, one token: 12.2 us a mix
# (two-launch form before it: 21.2); 4 tokens 21.0 (34.6), 16 tokens 18.1 (33.9); INT8 13.5, 21.9, 29.6
# (29.9, 41.6, 42.1). One token: 20 slices x 41 row blocks = 820 down programs of 8 KB of W_down|inj,
# 320 up programs of 4 x 8 rows x 320 of W_up (20 KB)
# Two tokens (a K=1 verify step, or two streams) have an entry of their own: session 15's sweep at batch 2
# (`--sweep-hc --batches 2`, bench/results/decode_fusions_hc_sweep_b2_nvidia-h200.txt), real widths, MIX_TILES
# with the 4-token tiles then with this entry: bf16 22.7 -> 17.3 us, INT8 26.4 -> 16.4; demo-small, this
# tile in the first run: bf16 6.4 -> 5.3, INT8 7.0 -> 5.8
# One token finishes in the up launch since session 21 (H100, bench/results/decode_fusions_hc_sweep_nvidia-h100_s21.txt
# and decode_roofline_nvidia-h100_s21hc.txt): the sweep, a mix alone, 12.3 us before (bf16; INT8 13.7) -> 9.5-14.6
# (10.0-15.8) over the up_finish candidates; in the real-width 4-layer stack at ctx 512, interleaved in one process
# against the earlier (1, 8, 512, 4, 8, 4): (1, 8, 1024, 4, 8, 4, True) 1.029x bf16, 1.056x int4-mixed, and this
# entry 1.001x / 1.015x over that one. At 2 and 4 tokens the stack read the up_finish tiles slower (2 tokens,
# block_h 2-4: 0.917-0.984x; 4 tokens, block_h 2-4: 0.881-0.954x; session 21, a tile a stream in the up launch,
# before the merged tile: not measured since), so they keep the down launch's finish
MIX_TILES = ((1, MixTiles(1, 2, 4096, 4, 8, 4, True)), (2, MixTiles(2, 8, 512, 4, 8, 4)),
             (4, MixTiles(4, 8, 512, 4, 8, 4)), (MAX_TOKENS, MixTiles(16, 32, 256, 4, 16, 4)))


@triton.jit
def _int8_values(words, ROWS: tl.constexpr, WORDS: tl.constexpr, DTYPE: tl.constexpr):
    """INT8 per-channel weights' int32 words [ROWS, WORDS] (`naive.int8_weight_shape`) -> their signed values
    q = stored - 128 [ROWS, 4 WORDS] in DTYPE (exact: small integers), value j of word w at column 4 w + j.
    Split in registers: tl.join puts its new dimension inside each thread, so the reshape moves nothing.
    (Through fp32: the interpreter's int32 -> bf16 conversion is wrong, triton 3.9.)"""
    bits = words.to(tl.uint32, bitcast=True)
    v0 = ((bits & 0xFF).to(tl.int32) - 128).to(tl.float32).to(DTYPE)
    v1 = (((bits >> 8) & 0xFF).to(tl.int32) - 128).to(tl.float32).to(DTYPE)
    v2 = (((bits >> 16) & 0xFF).to(tl.int32) - 128).to(tl.float32).to(DTYPE)
    v3 = ((bits >> 24).to(tl.int32) - 128).to(tl.float32).to(DTYPE)
    values = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [ROWS, WORDS, 2, 2]: [r, w, i, k] = value 2 i + k of word w
    return tl.reshape(values, (ROWS, 4 * WORDS))


@triton.jit
def _times_rows(acc, x, w, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BLOCK_N, J] + x [BLOCK_N, K] times the rows of w [J, K], in fp32. DOT: tl.dot; else a broadcast
    multiply and a sum over K (the products of two values of the streams' dtype are exact in fp32)."""
    if DOT:
        result = dot_acc(acc, x, w, PRECISION)
    else:
        result = acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return result


@triton.jit
def _mix_down_kernel(x_ptr, stride_x, block_ptr, stride_block, gate_ptr, stride_gate, combined_ptr, norm_ptr, w_ptr,
                     w_scale_ptr, partial_ptr, sumsq_ptr, counter_ptr, low_ptr, rstd_ptr, inject_ptr, n_tokens, eps,
                     HIDDEN: tl.constexpr, HC: tl.constexpr, SPLIT: tl.constexpr, LOWRANK: tl.constexpr,
                     OUT_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                     SLICES_P2: tl.constexpr, INT8: tl.constexpr, DOT: tl.constexpr, COMBINE: tl.constexpr,
                     UP_FINISH: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (slice, row block, token block): partial [token, slice, row] of W_down|inj times
    x * (1 + w_norm) over one slice of one stream, and the slice's sum of squares [row block, token,
    slice]; the row block's last program to arrive finishes its rows (`_finish_rows`). UP_FINISH: no
    arrival, row block 0's programs store the sums of squares (one copy) and `_mix_up_kernel` finishes
    every row. INT8: the weight's signed values q, its row scales (w_scale_ptr) applied by the finishing
    program. COMBINE: x is the streams plus the previous block's output times its gate for the stream
    (gate_ptr), rounded as `_combine_kernel` rounds; row block 0's programs store it (combined_ptr,
    [N, hc*H]). PDL: the weight tile and the norm weight are loaded before `wait_for_inputs`."""
    allow_dependents(PDL)
    SLICES: tl.constexpr = HC * SPLIT
    slice_id, row_block, token_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    rows = row_block * BLOCK_J + tl.arange(0, BLOCK_J)
    r_mask = rows < OUT_ROWS
    stream, part = slice_id // SPLIT, slice_id % SPLIT
    in_stream = part * BLOCK_K + tl.arange(0, BLOCK_K)
    c_mask = in_stream < HIDDEN
    columns = stream * HIDDEN + in_stream
    if INT8:  # H % 4 == 0: a word lies wholly inside the stream or wholly past it
        word_at = (stream * HIDDEN + part * BLOCK_K) // 4 + tl.arange(0, BLOCK_K // 4)
        words = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (HC * HIDDEN // 4) + word_at[None, :],
                        mask=r_mask[:, None] & (part * BLOCK_K + 4 * tl.arange(0, BLOCK_K // 4) < HIDDEN)[None, :],
                        other=0)
        w = _int8_values(words, BLOCK_J, BLOCK_K // 4, dtype)
    else:
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * (HC * HIDDEN) + columns[None, :],
                    mask=r_mask[:, None] & c_mask[None, :], other=0.0)
    scale = 1.0 + tl.load(norm_ptr + columns, mask=c_mask, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + columns[None, :],
                mask=t_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
    if COMBINE:
        block_output = tl.load(block_ptr + tokens.to(tl.int64)[:, None] * stride_block + in_stream[None, :],
                               mask=t_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + tokens.to(tl.int64) * stride_gate + stream, mask=t_mask, other=0.0).to(tl.float32)
        combined = round_to(x + round_to(block_output * gate[:, None], dtype, PRECISION).to(tl.float32), dtype,
                            PRECISION)
        if row_block == 0:
            tl.store(combined_ptr + tokens.to(tl.int64)[:, None] * (HC * HIDDEN) + columns[None, :], combined,
                     mask=t_mask[:, None] & c_mask[None, :])
        x = combined.to(tl.float32)
    squares = tl.sum(x * x, axis=1)
    acc = _times_rows(tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32), round_to(x * scale[None, :], dtype, PRECISION),
                      w, DOT, PRECISION)
    slice_rows = tokens.to(tl.int64) * SLICES + slice_id
    tl.store(partial_ptr + slice_rows[:, None] * OUT_ROWS + rows[None, :], acc, mask=t_mask[:, None] & r_mask[None, :])
    if UP_FINISH:
        if row_block == 0:
            tl.store(sumsq_ptr + slice_rows, squares, mask=t_mask)
    else:
        row_sumsq_ptr = sumsq_ptr + row_block * n_tokens * SLICES
        tl.store(row_sumsq_ptr + slice_rows, squares, mask=t_mask)
        tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
        arrivals = counter_ptr + token_block * tl.num_programs(1) + row_block
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == SLICES - 1:
            _finish_rows(partial_ptr, row_sumsq_ptr, w_scale_ptr, low_ptr, rstd_ptr, inject_ptr, tokens, t_mask,
                         rows, r_mask, row_block, eps, HIDDEN, HC, SPLIT, LOWRANK, OUT_ROWS, SLICES_P2, INT8, dtype,
                         PRECISION)
            tl.atomic_xchg(arrivals, 0)  # ready for the next launch


@triton.jit
def _finish_rows(partial_ptr, sumsq_ptr, w_scale_ptr, low_ptr, rstd_ptr, inject_ptr, tokens, t_mask, rows, r_mask,
                 row_block, eps, HIDDEN: tl.constexpr, HC: tl.constexpr, SPLIT: tl.constexpr, LOWRANK: tl.constexpr,
                 OUT_ROWS: tl.constexpr, SLICES_P2: tl.constexpr, INT8: tl.constexpr, DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """A row block's last program: every slice's partial in one load and each slice's stream's 1/rms (read
    past L1, .cg: other programs wrote them; row block 0 stores each stream's), then `_projected_rows`,
    silu(. / hc) -> low, 2 sigmoid(. / hc) -> inject."""
    SLICES: tl.constexpr = HC * SPLIT
    slices = tl.arange(0, SLICES_P2)
    partial = _slice_partials(partial_ptr, tokens, t_mask, rows, r_mask, HC, SPLIT, OUT_ROWS, SLICES_P2, ".cg")
    slice_rstd = _stream_rstd(sumsq_ptr, tokens, t_mask, slices // SPLIT, slices < SLICES, eps, HIDDEN, SPLIT, SLICES,
                              ".cg")
    if row_block == 0:  # each stream's first slice
        tl.store(rstd_ptr + tokens.to(tl.int64)[:, None] * HC + (slices // SPLIT)[None, :], slice_rstd,
                 mask=t_mask[:, None] & ((slices % SPLIT == 0) & (slices < SLICES))[None, :])
    if INT8:
        row_scale = tl.load(w_scale_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    else:
        row_scale = None
    scaled = _projected_rows(partial, slice_rstd, row_scale, HC, INT8, DTYPE, PRECISION)
    _store_activations(scaled, low_ptr, inject_ptr, tokens, t_mask, rows, r_mask, LOWRANK, OUT_ROWS, DTYPE,
                       PRECISION)


@triton.jit
def _slice_partials(partial_ptr, tokens, t_mask, rows, r_mask, HC: tl.constexpr, SPLIT: tl.constexpr,
                    OUT_ROWS: tl.constexpr, SLICES_P2: tl.constexpr, CACHE: tl.constexpr):
    """The down launch's fp32 partials [BLOCK_N, SLICES_P2, rows] of `tokens` (0 past the slices and rows),
    in one load."""
    SLICES: tl.constexpr = HC * SPLIT
    slices = tl.arange(0, SLICES_P2)
    slice_rows = tokens.to(tl.int64)[:, None] * SLICES + slices[None, :]  # [BLOCK_N, SLICES_P2]
    ts_mask = t_mask[:, None] & (slices < SLICES)[None, :]
    return tl.load(partial_ptr + slice_rows[:, :, None] * OUT_ROWS + rows[None, None, :],
                   mask=ts_mask[:, :, None] & r_mask[None, None, :], other=0.0, cache_modifier=CACHE)


@triton.jit
def _stream_rstd(sumsq_ptr, tokens, t_mask, streams, s_mask, eps, HIDDEN: tl.constexpr, SPLIT: tl.constexpr,
                 SLICES: tl.constexpr, CACHE: tl.constexpr):
    """1/rms [BLOCK_N, X] of stream `streams[x]` ([X], masked by s_mask) of each token, from the down
    launch's sums of squares per slice (one copy, [N, SLICES]): its SPLIT slices' sums loaded where they
    are needed and added in slice order (loads in the layout wanted: no reduction across threads)."""
    where = tokens.to(tl.int64)[:, None] * SLICES + (streams * SPLIT)[None, :]
    mask = t_mask[:, None] & s_mask[None, :]
    total = tl.load(sumsq_ptr + where, mask=mask, other=0.0, cache_modifier=CACHE)
    for part in tl.static_range(1, SPLIT):
        total += tl.load(sumsq_ptr + where + part, mask=mask, other=0.0, cache_modifier=CACHE)
    return 1.0 / tl.sqrt(total / HIDDEN + eps)


@triton.jit
def _projected_rows(partial, slice_rstd, row_scale, HC: tl.constexpr, INT8: tl.constexpr, DTYPE: tl.constexpr,
                    PRECISION: tl.constexpr):
    """W_down|inj xn / hc [BLOCK_N, rows] in fp32, rounded where the reference rounds: the sum over slices
    of their stream's 1/rms (slice_rstd [BLOCK_N, slices]) times the partial (`_slice_partials`; INT8:
    times each row's scale, row_scale)."""
    projected = tl.sum(partial * slice_rstd[:, :, None], axis=1)
    if INT8:
        projected *= row_scale[None, :]
    projected = round_to(projected, DTYPE, PRECISION).to(tl.float32)  # the linear's output dtype
    return round_to(projected / HC, DTYPE, PRECISION).to(tl.float32)


@triton.jit
def _low(scaled, rows, LOWRANK: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """The mixer's low-rank vector silu(scaled) at `rows` (0 from row LOWRANK: the injection rows)."""
    return tl.where((rows < LOWRANK)[None, :], round_to(scaled * tl.sigmoid(scaled), DTYPE, PRECISION), 0.0)


@triton.jit
def _store_activations(scaled, low_ptr, inject_ptr, tokens, t_mask, rows, r_mask, LOWRANK: tl.constexpr,
                       OUT_ROWS: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """silu(scaled) -> low [N, LOWRANK] at the rows below LOWRANK, and `_store_inject` at the others."""
    tl.store(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + rows[None, :],
             _low(scaled, rows, LOWRANK, DTYPE, PRECISION), mask=t_mask[:, None] & (rows < LOWRANK)[None, :])
    if OUT_ROWS > LOWRANK:
        _store_inject(scaled, inject_ptr, tokens, t_mask, rows, r_mask, LOWRANK, OUT_ROWS, DTYPE, PRECISION)


@triton.jit
def _store_inject(scaled, inject_ptr, tokens, t_mask, rows, r_mask, LOWRANK: tl.constexpr, OUT_ROWS: tl.constexpr,
                  DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """2 sigmoid(scaled) -> inject [N, hc] at the rows from LOWRANK (r_mask: below OUT_ROWS; OUT_ROWS > LOWRANK
    when the mixer has injection rows)."""
    inject = 2.0 * round_to(tl.sigmoid(scaled), DTYPE, PRECISION).to(tl.float32)
    tl.store(inject_ptr + tokens.to(tl.int64)[:, None] * (OUT_ROWS - LOWRANK) + (rows - LOWRANK)[None, :],
             round_to(inject, DTYPE, PRECISION), mask=t_mask[:, None] & ((rows >= LOWRANK) & r_mask)[None, :])


@triton.jit
def _up_weights(up_ptr, up_scale_ptr, norm_ptr, channels, h_mask, ranks, LOWRANK: tl.constexpr,
                BLOCK_R: tl.constexpr, INT8: tl.constexpr):
    """What `_mix_up_kernel` reads of one stream's weights at `channels`: its W_up tile [BLOCK_H, BLOCK_R]
    (INT8: the int32 words [BLOCK_H, BLOCK_R / 4], split later), each row's scale (INT8; else 1) and
    1 + the norm weight, the last two in fp32."""
    if INT8:  # r % 4 == 0 (r = 4 x words)
        word_at = tl.arange(0, BLOCK_R // 4)
        tile = tl.load(up_ptr + channels.to(tl.int64)[:, None] * (LOWRANK // 4) + word_at[None, :],
                       mask=h_mask[:, None] & (word_at < LOWRANK // 4)[None, :], other=0)
        row_scale = tl.load(up_scale_ptr + channels, mask=h_mask, other=0.0).to(tl.float32)
    else:
        tile = tl.load(up_ptr + channels.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                       mask=h_mask[:, None] & (ranks < LOWRANK)[None, :], other=0.0)
        row_scale = tl.full(channels.shape, 1.0, tl.float32)
    norm_scale = 1.0 + tl.load(norm_ptr + channels, mask=h_mask, other=0.0).to(tl.float32)
    return tile, row_scale, norm_scale


@triton.jit
def _stream_columns(x_ptr, stride_x, tokens, t_mask, channels, h_mask):
    """The streams' values [tokens, channels] (0 outside the masks)."""
    return tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + channels[None, :],
                   mask=t_mask[:, None] & h_mask[None, :], other=0.0)


@triton.jit
def _mix_up_kernel(x_ptr, stride_x, norm_ptr, up_ptr, up_scale_ptr, low_ptr, rstd_ptr, out_ptr, partial_ptr, sumsq_ptr,
                   w_scale_ptr, inject_ptr, n_tokens, eps, HIDDEN: tl.constexpr, HC: tl.constexpr,
                   HC_P2: tl.constexpr, LOWRANK: tl.constexpr, SPLIT: tl.constexpr, OUT_ROWS: tl.constexpr,
                   SLICES_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                   INT8: tl.constexpr, DOWN_INT8: tl.constexpr, DOT: tl.constexpr, UP_FINISH: tl.constexpr,
                   PRELOADED: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (column block, token block): block input [tokens, columns] = mean over streams s of
    sigmoid(W_up[s*H + columns] . low) * normed stream s at those columns. The GEMV form reads every
    stream's rows of W_up as one tile [hc x BLOCK_H, BLOCK_R] (stream-major; loaded before
    `wait_for_inputs`, PDL), loads all its inputs right after the wait, and makes every product and gate
    at once (one sum over the low rank, not one a stream), the mean over streams a sum within each
    thread's rows. The tl.dot form walks the streams, each one's rows a tile [BLOCK_H, BLOCK_R] (the
    first PRELOADED streams' loaded before the wait). INT8: W_up's signed values, each row's dot product
    times its scale (up_scale_ptr). UP_FINISH (GEMV form, BLOCK_R >= OUT_ROWS): low and the streams' 1/rms
    come from the down launch's partials and sums of squares (`_projected_rows`, DOWN_INT8: times
    W_down|inj's row scales, w_scale_ptr), and column block 0's programs store the injection gates; else
    they are loaded (`_finish_rows` stored them)."""
    allow_dependents(PDL)
    column_block, token_block = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    ranks = tl.arange(0, BLOCK_R)
    columns = column_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = columns < HIDDEN
    if DOT:
        preloaded = ()
        for stream in tl.static_range(PRELOADED):
            preloaded += (_up_weights(up_ptr, up_scale_ptr, norm_ptr, stream * HIDDEN + columns, h_mask, ranks,
                                      LOWRANK, BLOCK_R, INT8),)
    else:  # rows: stream-major, hc x BLOCK_H (HC_P2: the tile's power of 2)
        rows = tl.arange(0, HC_P2 * BLOCK_H)
        row_stream = rows // BLOCK_H
        row_columns = column_block * BLOCK_H + rows % BLOCK_H
        row_mask = (row_stream < HC) & (row_columns < HIDDEN)
        row_channels = row_stream * HIDDEN + row_columns
        tile, row_scale, norm_scale = _up_weights(up_ptr, up_scale_ptr, norm_ptr, row_channels, row_mask, ranks,
                                                  LOWRANK, BLOCK_R, INT8)
    if UP_FINISH and DOWN_INT8:
        down_scale = tl.load(w_scale_ptr + ranks, mask=ranks < OUT_ROWS, other=0.0).to(tl.float32)
    else:
        down_scale = None
    wait_for_inputs(PDL)
    if DOT:
        low = tl.load(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                      mask=t_mask[:, None] & (ranks < LOWRANK)[None, :], other=0.0)
        total = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
        for stream in tl.static_range(HC):
            channels = stream * HIDDEN + columns
            if stream < PRELOADED:
                tile, row_scale, norm_scale = preloaded[stream]
            else:
                tile, row_scale, norm_scale = _up_weights(up_ptr, up_scale_ptr, norm_ptr, channels, h_mask, ranks,
                                                          LOWRANK, BLOCK_R, INT8)
            x = _stream_columns(x_ptr, stride_x, tokens, t_mask, channels, h_mask)
            rstd = tl.load(rstd_ptr + tokens * HC + stream, mask=t_mask, other=0.0)
            total += _gated_rows(low, tile, row_scale, norm_scale, x, rstd[:, None], BLOCK_H, BLOCK_R, INT8, True,
                                 dtype, PRECISION)
    else:
        if UP_FINISH:
            SLICES: tl.constexpr = HC * SPLIT
            slices = tl.arange(0, SLICES_P2)
            partial = _slice_partials(partial_ptr, tokens, t_mask, ranks, ranks < OUT_ROWS, HC, SPLIT, OUT_ROWS,
                                      SLICES_P2, "")
            slice_rstd = _stream_rstd(sumsq_ptr, tokens, t_mask, slices // SPLIT, slices < SLICES, eps, HIDDEN, SPLIT,
                                      SLICES, "")
            rstd = _stream_rstd(sumsq_ptr, tokens, t_mask, row_stream, row_stream < HC, eps, HIDDEN, SPLIT, SLICES,
                                "")
        else:
            low = tl.load(low_ptr + tokens.to(tl.int64)[:, None] * LOWRANK + ranks[None, :],
                          mask=t_mask[:, None] & (ranks < LOWRANK)[None, :], other=0.0)
            rstd = tl.load(rstd_ptr + tokens[:, None] * HC + row_stream[None, :],
                           mask=t_mask[:, None] & (row_stream < HC)[None, :], other=0.0)
        x = _stream_columns(x_ptr, stride_x, tokens, t_mask, row_channels, row_mask)
        if UP_FINISH:
            scaled = _projected_rows(partial, slice_rstd, down_scale, HC, DOWN_INT8, dtype, PRECISION)
            low = _low(scaled, ranks, LOWRANK, dtype, PRECISION)
            if OUT_ROWS > LOWRANK and column_block == 0:  # column block 0's programs store the injection gates
                _store_inject(scaled, inject_ptr, tokens, t_mask, ranks, ranks < OUT_ROWS, LOWRANK, OUT_ROWS, dtype,
                              PRECISION)
        gated = _gated_rows(low, tile, row_scale, norm_scale, x, rstd, HC_P2 * BLOCK_H, BLOCK_R, INT8, False, dtype,
                            PRECISION)
        total = tl.sum(tl.reshape(gated, (BLOCK_N, HC_P2, BLOCK_H)), axis=1)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * HIDDEN + columns[None, :],
             round_to(total / HC, dtype, PRECISION), mask=t_mask[:, None] & h_mask[None, :])


@triton.jit
def _gated_rows(low, tile, row_scale, norm_scale, x, rstd, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                INT8: tl.constexpr, DOT: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """sigmoid(W_up rows . low) * the normed streams at those rows [BLOCK_N, ROWS], each rounded as the
    reference rounds, in fp32: x [BLOCK_N, ROWS] the streams there, rstd their 1/rms (broadcast)."""
    if INT8:
        w = _int8_values(tile, ROWS, BLOCK_R // 4, DTYPE)
    else:
        w = tile
    acc = _times_rows(tl.zeros((low.shape[0], ROWS), dtype=tl.float32), low, w, DOT, PRECISION)
    if INT8:
        acc *= row_scale[None, :]
    gate = round_to(tl.sigmoid(round_to(acc, DTYPE, PRECISION).to(tl.float32)), DTYPE, PRECISION).to(tl.float32)
    normed = round_to(x.to(tl.float32) * rstd * norm_scale[None, :], DTYPE, PRECISION).to(tl.float32)
    return round_to(gate * normed, DTYPE, PRECISION).to(tl.float32)


@triton.jit
def _combine_kernel(x_ptr, stride_x, block_ptr, stride_block, inject_ptr, stride_inject, out_ptr,
                    HIDDEN: tl.constexpr, HC: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr):
    """Program (token, column block): every stream's columns + inject[s] * block output there (the streams
    unrolled: their loads all in flight together). No weights: it waits first (PDL)."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    token, column_block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    columns = column_block * BLOCK + tl.arange(0, BLOCK)
    mask = columns < HIDDEN
    block_output = tl.load(block_ptr + token * stride_block + columns, mask=mask, other=0.0).to(tl.float32)
    for stream in tl.static_range(HC):
        inject = tl.load(inject_ptr + token * stride_inject + stream).to(tl.float32)
        x = tl.load(x_ptr + token * stride_x + stream * HIDDEN + columns, mask=mask, other=0.0).to(tl.float32)
        added = round_to(block_output * inject, dtype, PRECISION).to(tl.float32)
        tl.store(out_ptr + token * (HC * HIDDEN) + stream * HIDDEN + columns, round_to(x + added, dtype, PRECISION),
                 mask=mask)


def mix_tiles(n_tokens: int) -> MixTiles:
    """MIX_TILES' tiles for a batch of n_tokens."""
    return next(tiles for bound, tiles in MIX_TILES if n_tokens <= bound)


@functools.cache
def check_tiles(tiles: MixTiles, int8: bool) -> None:
    """A clear error for tiles the kernels cannot take (see MixTiles)."""
    powers = all(v > 0 and v & (v - 1) == 0 for v in tiles[:6])
    dot_fits = tiles.block_n < DOT_MIN or (min(tiles.block_j, tiles.block_h, tiles.block_k) >= DOT_MIN
                                           and not tiles.up_finish)
    if not powers or not dot_fits or (int8 and tiles.block_k < 4):
        raise ValueError(f"hyper-connection kernel: tiles {tiles} must be powers of 2, with block_j, block_h and "
                         f"block_k at least {DOT_MIN} and no up_finish when block_n is (tl.dot), block_k at least 4 "
                         f"for INT8 weights (INT8 here: {int8})")


def mix(
    streams: torch.Tensor, norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
    hc_count: int, eps: float, down_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `naive.mix`, for up to MAX_TOKENS tokens, in two launches (tiles: MIX_TILES); INT8 weights (given
    with their scales) are read packed, in place."""
    return _mix(streams, None, norm_weight, down_weight, up_weight, hc_count, eps, down_scale, up_scale)[1:]


def combine_and_mix(
    streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor, norm_weight: torch.Tensor,
    down_weight: torch.Tensor, up_weight: torch.Tensor, hc_count: int, eps: float,
    down_scale: torch.Tensor | None = None, up_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As `naive.combine_and_mix`, in mix's two launches (the combine's launch saved): the down programs add
    the block output to the streams as they read them, and row block 0's store the new streams."""
    check_combine_args(streams, block_output, inject)
    return _mix(streams, (block_output, inject), norm_weight, down_weight, up_weight, hc_count, eps, down_scale,
                up_scale)


def _mix(streams, residual, norm_weight, down_weight, up_weight, hc_count, eps, down_scale, up_scale):
    """(the streams the mix read: combined with `residual` = (block output, gates) when given, else
    `streams` itself; block input; injection gates or None)."""
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
    mixed = streams if residual is None else streams.new_empty(n, width)
    if n == 0:
        return mixed, block_input, inject
    if streams.stride(1) != 1:
        raise ValueError("hyper-connection kernel: the streams' last dimension must be contiguous")
    tiles = mix_tiles(n)
    check_tiles(tiles, down_int8 or up_int8)
    down_weight, up_weight, norm_weight = down_weight.contiguous(), up_weight.contiguous(), norm_weight.contiguous()
    down_scale = down_scale.contiguous() if down_int8 else down_weight  # (a dense weight's is never read)
    up_scale = up_scale.contiguous() if up_int8 else up_weight
    block_output, gates = residual if residual is not None else (streams, streams)  # (read only with COMBINE)
    dot = tiles.block_n >= DOT_MIN
    split = triton.cdiv(hidden, tiles.block_k)
    row_blocks, token_blocks = triton.cdiv(out_rows, tiles.block_j), triton.cdiv(n, tiles.block_n)
    f32 = {"dtype": torch.float32, "device": streams.device}
    partial = torch.empty(n, hc_count * split, out_rows, **f32)
    sumsq = torch.empty(1 if tiles.up_finish else row_blocks, n, hc_count * split, **f32)
    if tiles.up_finish:  # the up programs finish the rows: no low-rank vector, 1/rms or arrivals in memory
        low = rstd = counters = partial  # (pointers the kernels never read at this constexpr)
    else:
        low, rstd = streams.new_empty(n, lowrank), torch.empty(n, hc_count, **f32)
        counters = arrival_counters("hyper_connection", streams.device, token_blocks * row_blocks)
    precision = dot_precision(streams)
    _mix_down_kernel[(hc_count * split, row_blocks, token_blocks)](
        streams, streams.stride(0), block_output, block_output.stride(0), gates, gates.stride(0), mixed, norm_weight,
        down_weight, down_scale, partial, sumsq, counters, low, rstd, inject if with_inject else low, n, eps,
        HIDDEN=hidden, HC=hc_count, SPLIT=split, LOWRANK=lowrank, OUT_ROWS=out_rows, BLOCK_N=tiles.block_n,
        BLOCK_J=tiles.block_j, BLOCK_K=tiles.block_k, SLICES_P2=triton.next_power_of_2(hc_count * split),
        INT8=down_int8, DOT=dot, COMBINE=residual is not None, UP_FINISH=tiles.up_finish, PRECISION=precision,
        num_warps=tiles.down_warps, **launch_options(streams.device),
    )
    # the whole low rank in one tile (with up_finish, every row of the down projection)
    block_r = max(triton.next_power_of_2(out_rows if tiles.up_finish else lowrank), DOT_MIN if dot else 1)
    _mix_up_kernel[(triton.cdiv(hidden, tiles.block_h), token_blocks)](
        mixed, mixed.stride(0), norm_weight, up_weight, up_scale, low, rstd, block_input, partial, sumsq, down_scale,
        inject if with_inject else low, n, eps, HIDDEN=hidden, HC=hc_count, HC_P2=triton.next_power_of_2(hc_count),
        LOWRANK=lowrank, SPLIT=split,
        OUT_ROWS=out_rows, SLICES_P2=triton.next_power_of_2(hc_count * split), BLOCK_N=tiles.block_n,
        BLOCK_H=tiles.block_h, BLOCK_R=block_r, INT8=up_int8, DOWN_INT8=down_int8, DOT=dot,
        UP_FINISH=tiles.up_finish, PRELOADED=DOT_PRELOADED_STREAMS, PRECISION=precision,
        num_warps=tiles.up_warps, **launch_options(streams.device),
    )
    return mixed, block_input, inject


def combine(streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """As `naive.combine`, in one launch."""
    check_combine_args(streams, block_output, inject)
    n, width = streams.shape
    hc_count = inject.shape[1]
    hidden = width // hc_count
    out = torch.empty(n, width, dtype=streams.dtype, device=streams.device)
    if n:
        _combine_kernel[(n, triton.cdiv(hidden, COMBINE_BLOCK))](
            streams, streams.stride(0), block_output, block_output.stride(0), inject, inject.stride(0), out,
            HIDDEN=hidden, HC=hc_count, BLOCK=COMBINE_BLOCK, PRECISION=dot_precision(streams), num_warps=4,
            **launch_options(streams.device),
        )
    return out


def check_combine_args(streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor) -> None:
    """A clear error for combine's inputs that do not fit together or are not contiguous in their last dimension."""
    n, width = streams.shape
    hc_count = inject.shape[1] if inject.dim() == 2 else 1
    hidden = width // hc_count
    if block_output.shape != (n, hidden) or inject.shape != (n, hc_count) or width != hc_count * hidden:
        raise ValueError(f"hyper-connection combine: streams {tuple(streams.shape)}, block output "
                         f"{tuple(block_output.shape)} and inject {tuple(inject.shape)} do not fit together")
    if streams.stride(1) != 1 or block_output.stride(1) != 1 or inject.stride(1) != 1:
        raise ValueError("hyper-connection combine: every input's last dimension must be contiguous")
