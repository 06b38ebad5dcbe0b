"""`quant_linear` as Triton kernels (same signature as `naive`), with the weight format a compile-time
variant: unquantized (bf16 / fp16 / fp32) or packed INT4 / INT6 / INT8 with group scales (see `packing`).

Each program computes a [BLOCK_M, BLOCK_N] tile of y over a range of K. The weight tile is read in
place and, when packed, dequantized in registers: for 4 and 8 bits each int32 word is loaded once and
split into its 8 or 4 values; for 6 bits each value's word is gathered (and the next one where the value
straddles two); shifted and masked, the 2^(bits-1) bias removed, multiplied by its group's scale in fp32,
then rounded to x's dtype: the same rounded weight `naive` builds, so the two differ only in summation
order (products accumulate in fp32 here).
  - decode (M <= GEMV_MAX_ROWS), `_gemv_kernel`: no tensor-core dot (it would pad M to 16); each
    product lands in its own fp32 accumulator (`gemv_loop`) and the sum over K is taken once at
    the end (no reduction per tile); packed 4/8-bit weights take every row of x in each program and keep
    every tensor in the packed words' own 2-D shape, so nothing changes threads inside the loop; 6-bit
    ones the same by runs of 16 values (their 3 words: `six_bit_tile`, `six_bit_accumulate`) where K is
    a whole number of tiles and groups hold whole runs (`launch_config` picks a K tile that divides K). K is
    split over several programs when N alone gives too few programs to keep the device's memory system
    busy; the fp32 partials are summed in the same launch by the last program of each output tile to
    finish (`split_reduce.arrival_counters`), so a split GEMV is one kernel, not three (partials, their
    sum, the cast: INT6 shared expert's gate_up at decode).
  - prefill chunks, `_gemm_kernel`: tl.dot tiles (fp32 in IEEE precision, so fp32 results match the
    reference closely).
Both are launched with programmatic dependent launch where the device has it (`dependent_launch`): a
GEMV program loads its first tile of weights (and scales) before it waits for the kernel before it
(`gemv_weights`, then `gemv_step`), so W must be a tensor no kernel of the step writes (a layer's
weight); the GEMM waits first.
`gemv_loop`, `accumulate_tile`, `word_value` and `round_to` are shared with the fused MoE kernels
(kernels/fused_moe). On the CPU the kernels run in Triton's interpreter, which needs two workarounds
(PRECISION "interpreter": see `round_to` and `accumulate_tile`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.quant_linear.naive import check_weight
from tierlm.kernels.quant_linear.packing import check_packed
from tierlm.kernels.split_reduce import arrival_counters

# Tile sizes, chosen on an H200 by bench/quant_linear_kernel.py --sweep (module constants so it can sweep them)
GEMV_MAX_ROWS = 4  # up to this many rows, the GEMV form (no padding of M to 16 for tensor cores)
GEMV_BLOCK_N, GEMV_NUM_WARPS = 8, 4  # output columns per program (few: the accumulators are per product)
GEMV_BLOCK_K = {1: 512, 2: 512, 4: 256}  # input columns per step, by rows per program
# unquantized weights at one row (the model's dense bf16 decode projections, `DenseFormat.kernel_linear`) have
# their own tiles, from --sweep-dense on an H200 (bench/results/quant_linear_kernel_dense_sweep_nvidia-h200.txt,
# at 528 programs; us at 16384x2560, 12800x2560, 2560x6144): (BLOCK_N 4, BLOCK_K 512, 4 warps) 25.1, 20.2,
# 12.9 and (4, 1024, 4) 26.8, 21.7, 10.3, against 24.8, 20.7, 14.1 for the shared (8, 512, 4) (at 264
# programs (4, 512, 4) gives 24.8, 20.3, 12.8: K 2560 is a tie within noise); so BLOCK_K 1024 from K 4096
DENSE_GEMV_BLOCK_N, DENSE_GEMV_NUM_WARPS = 4, 4
DENSE_GEMV_BLOCK_K, DENSE_GEMV_LONG_K, DENSE_GEMV_LONG_BLOCK_K = 512, 4096, 1024  # BLOCK_K below / from LONG_K
# unquantized weights: a program whose split of K is whole tiles holding at most this many values loads them
# all before it waits for x (`LaunchConfig.up_front_tiles`): at one row, K 2560 (5 tiles of 4 x 512: 122
# registers a thread for sm_90, against 48 for the loop); K 6144's 6 tiles of 4 x 1024 took 255, so those keep the loop.
# H200, real-width stack, bf16 (bench/results/decode_roofline_nvidia-h200_s12upfront.json, --variants base
# TIERLM_NO_GEMV_UP_FRONT=1): one stream 1.007x tok/s at ctx 8192 (every round), 1.001x at 512; 4 streams 1.000x
DENSE_GEMV_UP_FRONT_MAX_VALUES = 4 * 2560
# packed 4/8-bit weights: every row of x (up to 4) in each program, each word's values taken out once for all
# of them, accumulators per word and row. By rows per program (1, 2, 4): H200, bench/quant_linear_kernel.py
# --sweep --formats int8 --shapes 248320x2560 --batches 1 2 4 (the INT8 lm_head; session 12,
# bench/results/quant_linear_kernel_int8_sweep_nvidia_h200.json): 91.3% / 67.0% / 39.7% of the copy
# bandwidth at 1 / 2 / 4 rows, against 80.6% / - / 24.5% for the earlier (16, 512, 4) tiles with one row of
# x per program (the 4 rows' programs each read and unpacked the whole weight). 4 rows' (32, 512) tiles take 255
# registers and spill 288 bytes for sm_90 (bench/quant_linear_registers.py) and still led: (32, 256) 36.5%
# Above PACKED_GEMV_MAX_ROWS rows, a packed weight whose output rows fill PACKED_GEMM_MIN_N_TILES of the GEMM's
# BLOCK_N tiles takes the tl.dot GEMM instead (one program a tile: it has no K split, so a narrower output
# leaves SMs idle; 132 SMs on an H200). H200, `bench/quant_linear_kernel.py --sweep --formats int8 int4-g128
# --batches 2 4` (bench/results/quant_linear_kernel_packed_rows_nvidia-h200.txt), % of the copy bandwidth at
# 4 rows, GEMV / GEMM (128, 64, 4) on 10240 x 2560 (80 tiles of N), 248320 x 2560 (1940), 2560 x 6144 (20):
# INT8 19.4 / 19.6, 39.2 / 49.1, 22.5 / 5.7; INT4 g128 11.9 / 11.8, 19.4 / 29.1, 10.0 / 3.1; at 2 rows the
# GEMV led everywhere (INT8 lm_head 66.1 / 48.2). The int4-mixed stack at 4 streams: 3,319 tok/s against
# 3,086 with the GEMV up to 4 rows and 3,314 with every packed weight on the GEMM above 2 rows
# (bench/results/decode_roofline_nvidia-h200_int4-mixed_s14.txt)
PACKED_GEMV_MAX_ROWS = 2
PACKED_GEMM_MIN_N_TILES = 132
PACKED_GEMV_BLOCK_N = {1: 32, 2: 32, 4: 32}
PACKED_GEMV_BLOCK_K = {1: 256, 2: 256, 4: 512}
PACKED_GEMV_NUM_WARPS = {1: 4, 2: 4, 4: 4}
# 6-bit weights: one row of x per program (the rows of a batch are neighbouring programs, so a weight tile
# read for one is in L2 for the others)
SIX_BIT_GEMV_BLOCK_N, SIX_BIT_GEMV_BLOCK_K, SIX_BIT_GEMV_NUM_WARPS = 16, 512, 4
GEMV_TARGET_PROGRAMS = 528  # decode: split K until about this many programs run (4 per SM on an H200)
GEMV_MIN_TILES_PER_SPLIT = 2  # ... but give each split at least this many tiles of K
GEMM_MAX_BLOCK_M = 64
GEMM_TILES = {0: (32, 128, 4), 4: (128, 64, 4), 6: (128, 64, 4), 8: (128, 64, 4)}  # bits: BLOCK_N, BLOCK_K, warps
FLOAT_ONE_BITS = tl.constexpr(0x3F800000)  # the bits of 1.0f (`word_value`)


class LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    splits: int  # programs along K
    k_per_split: int  # a multiple of block_k
    num_warps: int
    up_front_tiles: int  # the GEMV's K tiles a program loads before it waits for x (the rest in `gemv_loop`)


def launch_config(m: int, n: int, k: int, bits: int | None = None, itemsize: int = 2) -> LaunchConfig:
    """Tiles for y [m, n] = x [m, k] W^T (W packed in `bits`, or unquantized; x's elements `itemsize`
    bytes): the GEMV form up to GEMV_MAX_ROWS rows (packed 4/8 bits whose output fills
    PACKED_GEMM_MIN_N_TILES GEMM tiles: PACKED_GEMV_MAX_ROWS; one row of an unquantized W: the DENSE_GEMV
    tiles), else tl.dot tiles (GEMM_TILES' K is for 2-byte x: fp32 takes half
    as many columns per step, or its pipelined tiles outgrow shared memory). A GEMV program of an
    unquantized W whose splits are whole tiles holding at most DENSE_GEMV_UP_FRONT_MAX_VALUES loads all of
    its split before it waits (TIERLM_NO_GEMV_UP_FRONT=1: one tile, as every other GEMV)."""
    packed = bits in (4, 8)
    gemv_rows = GEMV_MAX_ROWS
    if packed and triton.cdiv(n, GEMM_TILES[bits][0]) >= PACKED_GEMM_MIN_N_TILES:
        gemv_rows = min(PACKED_GEMV_MAX_ROWS, GEMV_MAX_ROWS)
    if m > gemv_rows:
        block_m = min(GEMM_MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
        (block_n, block_k, warps), use_dot = GEMM_TILES[bits or 0], True
        block_k = max(16, block_k * 2 // itemsize)
    elif packed:  # every row in each program
        block_m, use_dot = triton.next_power_of_2(m), False
        block_n, block_k = PACKED_GEMV_BLOCK_N[block_m], PACKED_GEMV_BLOCK_K[block_m]
        warps = PACKED_GEMV_NUM_WARPS[block_m]
    elif bits == 6:  # one row a program
        block_m, block_n, block_k, use_dot = 1, SIX_BIT_GEMV_BLOCK_N, SIX_BIT_GEMV_BLOCK_K, False
        warps = SIX_BIT_GEMV_NUM_WARPS
    elif m == 1:
        block_m, block_n, use_dot, warps = 1, DENSE_GEMV_BLOCK_N, False, DENSE_GEMV_NUM_WARPS
        block_k = DENSE_GEMV_LONG_BLOCK_K if k >= DENSE_GEMV_LONG_K else DENSE_GEMV_BLOCK_K
    else:
        block_m = triton.next_power_of_2(m)
        block_n, block_k, use_dot, warps = GEMV_BLOCK_N, GEMV_BLOCK_K[block_m], False, GEMV_NUM_WARPS
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    while bits == 6 and k % block_k and block_k > 16:  # whole tiles take the 6-bit runs' form (`six_bit_tile`)
        block_k //= 2
    k_tiles = triton.cdiv(k, block_k)
    splits = 1
    if not use_dot:
        tiles_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        splits = max(1, min(k_tiles // GEMV_MIN_TILES_PER_SPLIT, GEMV_TARGET_PROGRAMS // tiles_mn))
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    up_front = 1
    if (not bits and not use_dot and k % k_per_split == 0 and block_n * k_per_split <= DENSE_GEMV_UP_FRONT_MAX_VALUES
            and os.environ.get("TIERLM_NO_GEMV_UP_FRONT", "0") in ("", "0")):
        up_front = k_per_split // block_k
    return LaunchConfig(block_m, block_n, block_k, use_dot, triton.cdiv(k, k_per_split), k_per_split, warps, up_front)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 x rounded to DTYPE, to nearest even. The CPU interpreter (PRECISION "interpreter") truncates
    fp32 -> bf16 (triton 3.9), so there the rounding is done on the bits (finite values)."""
    if PRECISION == "interpreter" and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        result = bits.to(tl.float32, bitcast=True).to(DTYPE)  # exact: the low bits are zero
    else:
        result = x.to(DTYPE)
    return result


@triton.jit
def column_mask(columns, K, EVEN_K: tl.constexpr):
    """columns < K; all true when K is a whole number of tiles (EVEN_K), so loads need no mask (and can
    be vectorized)."""
    if EVEN_K:
        mask = tl.full(columns.shape, 1, tl.int1)
    else:
        mask = columns < K
    return mask


@triton.jit
def load_group_scales(s_ptr, rows, columns, k0, mask, stride_sn, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales of weight rows `rows` at input columns `columns` (broadcastable index tensors), masked.
    When the tile [k0, k0 + BLOCK_K) lies in one group, one scale per row (shape of `rows`)."""
    if GROUP_SIZE % BLOCK_K == 0:
        scale = tl.load(s_ptr + rows * stride_sn + k0 // GROUP_SIZE)
    else:
        scale = tl.load(s_ptr + rows * stride_sn + columns // GROUP_SIZE, mask=mask, other=0.0)
    return scale.to(tl.float32)


@triton.jit
def dequantize_words(w_ptr, s_ptr, k0, rows, stride_wn, stride_sn, K, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """4 and 8 bits: the packed tile of rows `rows` ([BLOCK_N, 1] int64, in range) at input columns
    [k0, k0 + BLOCK_K), dequantized and rounded to DTYPE, held as fp32 [BLOCK_N, words, values per word]
    (value j of word i is column k0 + i * 32/BITS + j; out-of-range columns 0). Each word is loaded once
    ([BLOCK_N, BLOCK_K / values per word]: 16-byte loads), split in registers by shifts, and scaled
    there (one scale per word when groups hold whole words)."""
    # (constexpr arithmetic inline: arange needs constexpr bounds, a plain local loses that in the
    # interpreter)
    offs_w = tl.multiple_of(k0 // (32 // BITS), BLOCK_K // (32 // BITS)) + tl.arange(0, BLOCK_K // (32 // BITS))
    if EVEN_K:
        words = tl.load(w_ptr + rows * stride_wn + offs_w[None, :])
    else:
        words = tl.load(w_ptr + rows * stride_wn + offs_w[None, :],
                        mask=(offs_w < tl.cdiv(K * BITS, 32))[None, :], other=0)
    within_word = tl.arange(0, 32 // BITS)
    q = (words.to(tl.uint32, bitcast=True)[:, :, None] >> (within_word * BITS).to(tl.uint32)[None, None, :])
    q = (q & ((1 << BITS) - 1)).to(tl.int32) - (1 << (BITS - 1))  # [BLOCK_N, words, values per word]
    columns = offs_w[None, :, None] * (32 // BITS) + within_word[None, None, :]
    inside = column_mask(columns, K, EVEN_K)
    if GROUP_SIZE % (32 // BITS) == 0:  # groups hold whole words: one scale per word
        first = offs_w[None, :, None] * (32 // BITS)  # [1, words, 1]
        scale = load_group_scales(s_ptr, rows[:, :, None], first, k0, column_mask(first, K, EVEN_K), stride_sn,
                                  GROUP_SIZE, BLOCK_K)
    else:
        scale = load_group_scales(s_ptr, rows[:, :, None], columns, k0, inside, stride_sn, GROUP_SIZE, BLOCK_K)
    w = tl.where(inside, q.to(tl.float32) * scale, 0.0)
    return round_to(w, DTYPE, PRECISION).to(tl.float32)


@triton.jit
def load_weight_rows(w_ptr, s_ptr, k0, offs_n, n_mask, stride_wn, stride_sn, K, BITS: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Tile [BLOCK_N, BLOCK_K] of W (rows offs_n, columns [k0, k0 + BLOCK_K), k0 a multiple of BLOCK_K) in
    DTYPE, out-of-range columns 0 (out-of-range rows: whatever row 0..N-1 clamps to; callers mask them
    out). BITS 0: w_ptr is W [N, K] itself (row stride stride_wn); else the packed words
    [N, ceil(K * BITS / 32)] and s_ptr the scales [N, K / GROUP_SIZE] (row stride stride_sn).
    4 and 8 bits: `dequantize_words`, flattened; 6 bits: each value's word (and the next, where it
    straddles) is gathered."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = column_mask(offs_k, K, EVEN_K)
    rows = tl.where(n_mask, offs_n, 0)[:, None].to(tl.int64)  # clamped: loads need no row mask
    if BITS == 0:
        tile = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=k_mask[None, :], other=0.0).to(DTYPE)
    elif 32 % BITS == 0:  # whole values in a word
        w = dequantize_words(w_ptr, s_ptr, k0, rows, stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_K, EVEN_K,
                             DTYPE, PRECISION)
        tile = tl.reshape(w.to(DTYPE), (BLOCK_N, BLOCK_K))  # value j of word i: i * 32/BITS + j
    else:  # values straddle words
        tile = load_straddling_values(w_ptr, s_ptr, k0, offs_k, k_mask, rows, stride_wn, stride_sn, BITS, GROUP_SIZE,
                                      BLOCK_K, DTYPE, PRECISION)
    return tile


@triton.jit
def load_straddling_values(w_ptr, s_ptr, k0, offs_k, k_mask, rows, stride_wn, stride_sn, BITS: tl.constexpr,
                           GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                           PRECISION: tl.constexpr):
    """6 bits: [BLOCK_N, BLOCK_K] of W in DTYPE at rows `rows` ([BLOCK_N, 1]) and columns offs_k (masked
    by k_mask, k0 the first); each value's word is gathered, and the next one where the value straddles two."""
    position = offs_k * BITS  # bit position of value k in its row
    word_ptr = w_ptr + rows * stride_wn + (position // 32)[None, :]
    shift = (position % 32).to(tl.uint32)[None, :]
    value = tl.load(word_ptr, mask=k_mask[None, :], other=0).to(tl.uint32, bitcast=True) >> shift
    straddles = (shift + BITS) > 32  # the value's high bits start the next word
    high = tl.load(word_ptr + 1, mask=k_mask[None, :] & straddles, other=0).to(tl.uint32, bitcast=True)
    value = value | (high << tl.where(straddles, 32 - shift, 0))
    q = (value & ((1 << BITS) - 1)).to(tl.int32) - (1 << (BITS - 1))
    scale = load_group_scales(s_ptr, rows, offs_k[None, :], k0, k_mask[None, :], stride_sn, GROUP_SIZE, BLOCK_K)
    return round_to(tl.where(k_mask[None, :], q.to(tl.float32) * scale, 0.0), DTYPE, PRECISION)


@triton.jit
def gemv_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """The fp32 accumulator of `gemv_loop` (the sum over K is taken once, by `gemv_sum`, not per
    tile): for 4 and 8 bits one per packed word of the tile and row of x, [BLOCK_N, words] (2 rows:
    [BLOCK_N, words, 2]; 4: [BLOCK_N, words, 2, 2], `packed_gemv_accumulate`), for 6 bits one per run of
    16 values, [BLOCK_N, BLOCK_K / 16] (one row of x: BLOCK_M must be 1), else one per product,
    [BLOCK_M, BLOCK_N, BLOCK_K]."""
    if BITS != 0 and 32 % BITS == 0:
        tl.static_assert(BLOCK_M == 1 or BLOCK_M == 2 or BLOCK_M == 4, "the packed 4/8-bit GEMV takes 1, 2 or 4 rows")
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_N, BLOCK_K // (32 // BITS)), dtype=tl.float32)
        elif BLOCK_M == 2:
            acc = tl.zeros((BLOCK_N, BLOCK_K // (32 // BITS), 2), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K // (32 // BITS), 2, 2), dtype=tl.float32)
    elif BITS == 6:
        tl.static_assert(BLOCK_M == 1, "the 6-bit GEMV takes one row of x per program")
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc


@triton.jit
def gemv_sum(acc, BITS: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: a `gemv_zeros` accumulator summed over K."""
    if BITS != 0 and 32 % BITS == 0 and len(acc.shape) > 2:  # packed, 2 or 4 rows side by side
        total = tl.sum(acc, axis=1)
        if len(total.shape) == 3:  # 4 rows: row 2i + j at [..., i, j], row-major as the reshape reads them
            total = tl.reshape(total, (total.shape[0], 4))
        total = tl.trans(total)
    elif BITS != 0 and (32 % BITS == 0 or BITS == 6):
        total = tl.sum(acc, axis=1)[None, :]
    else:
        total = tl.sum(acc, axis=2)
    return total


@triton.jit
def word_value(words, high, j: tl.constexpr, BITS: tl.constexpr, one_bits):
    """Value j of each packed word (bits [j * BITS, (j + 1) * BITS) of `words`, uint32) as fp32 with the
    2^(BITS-1) bias removed, exactly, in the words' own shape and layout, in two instructions: the field
    masked in place and ORed into the mantissa of the power of two 2^E whose last mantissa bit weighs as
    the field's lowest bit (the float 2^E + q), then 2^E plus the bias subtracted. No shift and no
    integer-to-float conversion (a quarter-rate instruction). A field that reaches the exponent (bit 23)
    is taken from `high` (the words shifted right by 16) instead. one_bits: the bits of 1.0f
    (FLOAT_ONE_BITS); a kernel that passes them at run time keeps each field's exponent in a register (as
    a constant, ptxas rematerialises it with a move before every use: one more instruction per value)."""
    if (j + 1) * BITS <= 23:
        field = words & (((1 << BITS) - 1) << (j * BITS))
        power = 23 - j * BITS  # E: the float 2^E has its last mantissa bit at 2^(E - 23) = 2^-(j * BITS)
    else:
        field = high & (((1 << BITS) - 1) << (j * BITS - 16))
        power = 39 - j * BITS
    return (field | (one_bits + (power << 23))).to(tl.float32, bitcast=True) - ((1 << power) + (1 << (BITS - 1)))


@triton.jit
def even_odd(t, N: tl.constexpr, P: tl.constexpr):
    """[N, P] -> its even and its odd columns, [N, P / 2] each ([N] when P is 2), in registers."""
    if P == 2:
        even, odd = tl.split(t)
    else:
        even, odd = tl.split(tl.reshape(t, (N, P // 2, 2)))
    return even, odd


@triton.jit
def gemv_loop(acc, x_ptr, x_rows, m_mask, w_ptr, s_ptr, k_start, k_end, offs_n, n_mask, stride_wn, stride_sn, K,
              BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              PRECISION: tl.constexpr):
    """The GEMV form (a few rows of x; no tensor cores): acc (`gemv_zeros`) + x's rows (x_rows: [BLOCK_M]
    int64 offsets of each row from x_ptr, masked by m_mask) at input columns [k_start, k_end) (k_start a
    multiple of BLOCK_K) times the weight rows offs_n, in fp32, tile by tile: `gemv_weights` loads a
    tile, `gemv_step` computes it. No reduction across threads here: the sum over K is taken once at the
    end (`gemv_sum`). (Packed 4 and 8 bits: loading each tile one tile ahead measured no better on an
    H200: the INT8 lm_head GEMV 83% of the copy bandwidth without it, 74% with it.)
    Under PDL a kernel loads its first tile before `wait_for_inputs` (`gemv_weights` reads no x), steps
    it after, and loops over the rest from k_start + BLOCK_K."""
    for k0 in range(k_start, k_end, BLOCK_K):
        tile, scale = gemv_weights(w_ptr, s_ptr, k0, offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_K,
                                   EVEN_K, x_ptr.dtype.element_ty, PRECISION)
        acc = gemv_step(acc, tile, scale, x_ptr, x_rows, m_mask, k0, K, BITS, GROUP_SIZE, BLOCK_K, EVEN_K)
    return acc


@triton.jit
def gemv_weights(w_ptr, s_ptr, k0, offs_n, n_mask, stride_wn, stride_sn, K, BITS: tl.constexpr,
                 GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One K tile of `gemv_loop`'s weights (rows offs_n, masked by n_mask; input columns [k0, k0 + BLOCK_K)),
    as `gemv_step` takes it: packed 4 and 8 bits (the words, their group scales) (`packed_tile`); 6 bits
    in whole runs (K a whole number of tiles, groups of whole runs: each run's three words, its group scale;
    `six_bit_tile`);
    unquantized (the tile [BLOCK_N, BLOCK_K] as stored, a stand-in scale); other 6-bit tiles (dequantized
    as `load_weight_rows`, rounded to DTYPE: x's dtype, a stand-in scale). It reads the weights alone."""
    rows = tl.where(n_mask, offs_n, 0)[:, None].to(tl.int64)  # clamped: loads need no row mask
    if BITS != 0 and 32 % BITS == 0:
        tile, scale = packed_tile(w_ptr, s_ptr, k0, rows, stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_K, EVEN_K)
    elif BITS == 6 and EVEN_K and GROUP_SIZE % 16 == 0:  # whole runs (K whole tiles, groups whole runs)
        tile, scale = six_bit_tile(w_ptr, s_ptr, k0, rows, stride_wn, stride_sn, GROUP_SIZE, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = column_mask(offs_k, K, EVEN_K)
        if BITS == 0:
            tile = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        else:
            tile = load_straddling_values(w_ptr, s_ptr, k0, offs_k, k_mask, rows, stride_wn, stride_sn, BITS,
                                          GROUP_SIZE, BLOCK_K, DTYPE, PRECISION)
        scale = tl.full((1, 1), 1.0, tl.float32)  # (unused)
    return tile, scale


@triton.jit
def gemv_tiles_ahead(w_ptr, s_ptr, k_start, offs_n, n_mask, stride_wn, stride_sn, K, BITS: tl.constexpr,
                     GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
                     PRECISION: tl.constexpr, COUNT: tl.constexpr):
    """The COUNT `gemv_weights` tiles from input column k_start, as a tuple: what a kernel loads before its
    `wait_for_inputs` (PDL), then steps with `gemv_steps`."""
    tiles = ()
    for t in tl.static_range(COUNT):
        tiles += (gemv_weights(w_ptr, s_ptr, k_start + t * BLOCK_K, offs_n, n_mask, stride_wn, stride_sn, K, BITS,
                               GROUP_SIZE, BLOCK_K, EVEN_K, DTYPE, PRECISION),)
    return tiles


@triton.jit
def gemv_steps(acc, tiles, x_ptr, x_rows, m_mask, k_start, K, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, COUNT: tl.constexpr):
    """acc + x's rows times `gemv_tiles_ahead`'s COUNT tiles from input column k_start (`gemv_step` each)."""
    for t in tl.static_range(COUNT):
        tile, scale = tiles[t]
        acc = gemv_step(acc, tile, scale, x_ptr, x_rows, m_mask, k_start + t * BLOCK_K, K, BITS, GROUP_SIZE, BLOCK_K,
                        EVEN_K)
    return acc


@triton.jit
def gemv_step(acc, tile, scale, x_ptr, x_rows, m_mask, k0, K, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One tile of `gemv_loop`: acc + x's rows at input columns [k0, k0 + BLOCK_K) times a `gemv_weights`
    tile, in fp32: packed 4 and 8 bits by `packed_gemv_accumulate`, 6 bits in whole runs by
    `six_bit_accumulate`; else one fp32 product per accumulator ([BLOCK_M, BLOCK_N, BLOCK_K]; other 6-bit
    tiles: summed per run into the runs' accumulators)."""
    if BITS != 0 and 32 % BITS == 0:
        acc = packed_gemv_accumulate(acc, tile, scale, x_ptr, x_rows, m_mask, k0, K, BITS, BLOCK_K, EVEN_K)
    elif BITS == 6 and EVEN_K and GROUP_SIZE % 16 == 0:  # whole runs (K whole tiles, groups whole runs)
        acc = six_bit_accumulate(acc, tile, scale, x_ptr, x_rows, m_mask, k0, BLOCK_K)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :],
                    mask=m_mask[:, None] & column_mask(offs_k, K, EVEN_K)[None, :], other=0.0)
        products = a.to(tl.float32)[:, None, :] * tile.to(tl.float32)[None, :, :]
        if BITS == 6:
            acc += tl.sum(tl.reshape(products, (acc.shape[0], acc.shape[1], 16)), axis=2)
        else:
            acc += products
    return acc


@triton.jit
def six_bit_tile(w_ptr, s_ptr, k0, rows, stride_wn, stride_sn, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """6 bits, a tile of whole runs (k0 a multiple of BLOCK_K, the tile inside K): a row's bit stream holds 16
    values in every 3 words, so ((the runs' first, second and third words, each [BLOCK_N, runs] uint32),
    each run's group scale in fp32, [BLOCK_N, runs] or [BLOCK_N, 1]) of rows `rows` ([BLOCK_N, 1] int64,
    in range). Three loads of 4-byte words 12 bytes apart (a warp's together cover its words once)."""
    RUNS: tl.constexpr = BLOCK_K // 16
    run = tl.arange(0, RUNS)
    first = rows * stride_wn + (k0 // 16 * 3 + 3 * run)[None, :]
    w0 = tl.load(w_ptr + first).to(tl.uint32, bitcast=True)
    w1 = tl.load(w_ptr + first + 1).to(tl.uint32, bitcast=True)
    w2 = tl.load(w_ptr + first + 2).to(tl.uint32, bitcast=True)
    columns = (k0 + 16 * run)[None, :]  # each run's first column: its group (groups hold whole runs)
    scale = load_group_scales(s_ptr, rows, columns, k0, tl.full(columns.shape, 1, tl.int1), stride_sn, GROUP_SIZE,
                              BLOCK_K)
    return (w0, w1, w2), scale


@triton.jit
def _six_bit_value(w0, w1, w2, j: tl.constexpr, one_bits):
    """Value j (0-15) of each run (its words w0, w1, w2: bits 6j to 6j + 5 of the three, LSB first) as fp32
    with the bias 32 removed, by `field_value`: a field that reaches bit 23 is taken from its word shifted
    right by 16, the two that straddle words (bits 30-35, 60-65) are put together first."""
    if j == 5:
        value = field_value((w0 >> 30) | ((w1 & 0xF) << 2), 0, one_bits)
    elif j == 10:
        value = field_value((w1 >> 28) | ((w2 & 0x3) << 4), 0, one_bits)
    else:
        WORD: tl.constexpr = 6 * j // 32
        AT: tl.constexpr = 6 * j % 32
        word = w0 if WORD == 0 else (w1 if WORD == 1 else w2)
        if AT + 6 <= 23:
            value = field_value(word, AT, one_bits)
        else:
            value = field_value(word >> 16, AT - 16, one_bits)
    return value


@triton.jit
def field_value(source, AT: tl.constexpr, one_bits):
    """The 6-bit field at bits [AT, AT + 6) of `source` (uint32, AT + 6 <= 23) as fp32 with the bias 32
    removed, as `word_value` takes a value out: masked in place, ORed into the mantissa of the power of two
    whose last mantissa bit weighs as the field's lowest bit, then that power plus the bias subtracted."""
    POWER: tl.constexpr = 23 - AT
    field = source & (0x3F << AT)
    return (field | (one_bits + (POWER << 23))).to(tl.float32, bitcast=True) - ((1 << POWER) + 32)


@triton.jit
def six_bit_accumulate(acc, words, scale, x_ptr, x_rows, m_mask, k0, BLOCK_K: tl.constexpr):
    """6 bits, one row of x: acc [BLOCK_N, runs] + per run, x's columns [k0, k0 + BLOCK_K) times the tile's
    runs (`six_bit_tile`), in fp32. As `packed_gemv_accumulate` takes 4 and 8 bits: the weights stay in the
    words' own shape, value j of every run taken out in place (`_six_bit_value`) and multiplied by x's
    column j of that run (x's tile loaded once as [runs, 16] and split into one [runs] vector per j); a
    run's products summed in fp32 and multiplied by its group scale (the weights q * scale exactly)."""
    RUNS: tl.constexpr = BLOCK_K // 16
    w0, w1, w2 = words
    columns = (k0 + 16 * tl.arange(0, RUNS))[:, None] + tl.arange(0, 16)[None, :]
    a = tl.load(x_ptr + x_rows[:, None] + columns, mask=m_mask[:, None], other=0.0).to(tl.float32)
    even, odd = even_odd(a, RUNS, 16)
    c0, c2 = even_odd(even, RUNS, 8)  # columns 0, 4, 8, 12 / 2, 6, 10, 14
    c1, c3 = even_odd(odd, RUNS, 8)  # 1, 5, 9, 13 / 3, 7, 11, 15
    d0, d4 = even_odd(c0, RUNS, 4)  # 0, 8 / 4, 12
    d2, d6 = even_odd(c2, RUNS, 4)  # 2, 10 / 6, 14
    d1, d5 = even_odd(c1, RUNS, 4)  # 1, 9 / 5, 13
    d3, d7 = even_odd(c3, RUNS, 4)  # 3, 11 / 7, 15
    x0, x8 = even_odd(d0, RUNS, 2)
    x4, x12 = even_odd(d4, RUNS, 2)
    x2, x10 = even_odd(d2, RUNS, 2)
    x6, x14 = even_odd(d6, RUNS, 2)
    x1, x9 = even_odd(d1, RUNS, 2)
    x5, x13 = even_odd(d5, RUNS, 2)
    x3, x11 = even_odd(d3, RUNS, 2)
    x7, x15 = even_odd(d7, RUNS, 2)
    per_run = _six_bit_value(w0, w1, w2, 0, FLOAT_ONE_BITS) * x0[None, :]
    per_run += _six_bit_value(w0, w1, w2, 1, FLOAT_ONE_BITS) * x1[None, :]
    per_run += _six_bit_value(w0, w1, w2, 2, FLOAT_ONE_BITS) * x2[None, :]
    per_run += _six_bit_value(w0, w1, w2, 3, FLOAT_ONE_BITS) * x3[None, :]
    per_run += _six_bit_value(w0, w1, w2, 4, FLOAT_ONE_BITS) * x4[None, :]
    per_run += _six_bit_value(w0, w1, w2, 5, FLOAT_ONE_BITS) * x5[None, :]
    per_run += _six_bit_value(w0, w1, w2, 6, FLOAT_ONE_BITS) * x6[None, :]
    per_run += _six_bit_value(w0, w1, w2, 7, FLOAT_ONE_BITS) * x7[None, :]
    per_run += _six_bit_value(w0, w1, w2, 8, FLOAT_ONE_BITS) * x8[None, :]
    per_run += _six_bit_value(w0, w1, w2, 9, FLOAT_ONE_BITS) * x9[None, :]
    per_run += _six_bit_value(w0, w1, w2, 10, FLOAT_ONE_BITS) * x10[None, :]
    per_run += _six_bit_value(w0, w1, w2, 11, FLOAT_ONE_BITS) * x11[None, :]
    per_run += _six_bit_value(w0, w1, w2, 12, FLOAT_ONE_BITS) * x12[None, :]
    per_run += _six_bit_value(w0, w1, w2, 13, FLOAT_ONE_BITS) * x13[None, :]
    per_run += _six_bit_value(w0, w1, w2, 14, FLOAT_ONE_BITS) * x14[None, :]
    per_run += _six_bit_value(w0, w1, w2, 15, FLOAT_ONE_BITS) * x15[None, :]
    return acc + per_run * scale


@triton.jit
def packed_tile(w_ptr, s_ptr, k0, rows, stride_wn, stride_sn, K, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """4 and 8 bits: (the packed words [BLOCK_N, BLOCK_K * BITS / 32] as uint32, each word's group scale
    in fp32, same shape or [BLOCK_N, 1]) of weight rows `rows` ([BLOCK_N, 1] int64, in range) at input
    columns [k0, k0 + BLOCK_K); words past K are 0. Each word is loaded once (16-byte loads)."""
    offs_w = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))  # k0: a multiple of BLOCK_K
    offs_w = tl.max_contiguous(tl.multiple_of(offs_w, BLOCK_K // (32 // BITS)), BLOCK_K // (32 // BITS))
    if EVEN_K:
        words = tl.load(w_ptr + rows * stride_wn + offs_w[None, :])
    else:
        words = tl.load(w_ptr + rows * stride_wn + offs_w[None, :], mask=(offs_w < tl.cdiv(K * BITS, 32))[None, :],
                        other=0)
    first = offs_w[None, :] * (32 // BITS)  # each word's first column: its group (groups hold whole words)
    scale = load_group_scales(s_ptr, rows, first, k0, column_mask(first, K, EVEN_K), stride_sn, GROUP_SIZE, BLOCK_K)
    return words.to(tl.uint32, bitcast=True), scale


@triton.jit
def packed_gemv_accumulate(acc, words, scale, x_ptr, x_rows, m_mask, k0, K, BITS: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """4 and 8 bits, BLOCK_M (x_rows' length: 1, 2 or 4) rows of x: acc (`gemv_zeros`: [BLOCK_N, words] a
    row, the rows side by side in the last dims) + per word, x's columns [k0, k0 + BLOCK_K) times the tile's
    words (`packed_tile`), in fp32. The weights stay in the packed words' own shape (no value of them moves
    between threads): value j of every word is taken out in place (`word_value`), once for all the rows,
    and multiplied by each row's column j of that word. A row of x's tile is loaded once as [words, values
    per word] (contiguous) and split into one [words] vector per j (`packed_columns`). A word's products are
    summed in fp32 and multiplied by the word's group scale: the weights are q * scale exactly, not rounded
    to x's dtype first as `naive` and the GEMM form do (in bf16 a difference well under the output's own
    rounding; in fp32 at fp32 roundoff)."""
    BLOCK_M: tl.constexpr = x_rows.shape[0]
    VALUES: tl.constexpr = 32 // BITS
    index = tl.arange(0, BLOCK_M)
    columns = ()  # per row, its VALUES column vectors [words]
    for r in tl.static_range(BLOCK_M):
        offset = tl.sum(tl.where(index == r, x_rows, 0))
        ok = tl.sum(tl.where(index == r, m_mask.to(tl.int32), 0))
        columns += (packed_columns(x_ptr + offset, ok, k0, K, BITS, BLOCK_K, EVEN_K),)
    high = words >> 16
    sums = ()
    for j in tl.static_range(VALUES):
        value = word_value(words, high, j, BITS, FLOAT_ONE_BITS)
        summed = ()
        for r in tl.static_range(BLOCK_M):
            product = value * columns[r][j][None, :]
            summed += (product if j == 0 else sums[r] + product,)
        sums = summed
    if BLOCK_M == 1:
        per_word = sums[0]
    elif BLOCK_M == 2:
        per_word = tl.join(sums[0], sums[1])
    else:  # [BLOCK_N, words, 2, 2]: row 2i + j at [..., i, j] (`gemv_sum` flattens it)
        per_word = tl.join(tl.join(sums[0], sums[2]), tl.join(sums[1], sums[3]))
    if BLOCK_M == 2:
        scale = tl.expand_dims(scale, 2)
    elif BLOCK_M == 4:
        scale = tl.expand_dims(tl.expand_dims(scale, 2), 3)
    return acc + per_word * scale


@triton.jit
def packed_columns(x_row_ptr, ok, k0, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One row of x (from x_row_ptr; all 0 unless ok, an int32, is 1) at columns [k0, k0 + BLOCK_K) as 32 / BITS vectors
    [words]: vector j holds column j of each word. Loaded once as [words, values per word] (contiguous)
    and split in registers (`even_odd`; one trip through shared memory per tile brings them into the
    words' layout: x loaded per j instead takes 32 / BITS strided loads per word, many times the weights'
    own L1 traffic)."""
    offs_w = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
    columns = offs_w[:, None] * (32 // BITS) + tl.arange(0, 32 // BITS)[None, :]
    a = tl.load(x_row_ptr + columns, mask=(columns * 0 + ok != 0) & column_mask(columns, K, EVEN_K),
                other=0.0).to(tl.float32)
    even, odd = even_odd(a, BLOCK_K // (32 // BITS), 32 // BITS)
    if BITS == 4:
        even0, even1 = even_odd(even, BLOCK_K // 8, 4)  # positions 0, 4 / 2, 6
        odd0, odd1 = even_odd(odd, BLOCK_K // 8, 4)  # 1, 5 / 3, 7
        a0, a4 = even_odd(even0, BLOCK_K // 8, 2)
        a2, a6 = even_odd(even1, BLOCK_K // 8, 2)
        a1, a5 = even_odd(odd0, BLOCK_K // 8, 2)
        a3, a7 = even_odd(odd1, BLOCK_K // 8, 2)
        parts = (a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        a0, a2 = even_odd(even, BLOCK_K // 4, 2)
        a1, a3 = even_odd(odd, BLOCK_K // 4, 2)
        parts = (a0, a1, a2, a3)
    return parts


@triton.jit
def accumulate_tile(acc, a, w_ptr, s_ptr, k0, offs_n, n_mask, stride_wn, stride_sn, K, BITS: tl.constexpr,
                    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """The GEMM form: acc [M, BLOCK_N] fp32 + a [M, BLOCK_K] @ W[offs_n, k0:k0 + BLOCK_K]^T by tl.dot, the
    weight tile read in place (and dequantized in registers: `load_weight_rows`) in a's dtype.
    PRECISION "interpreter" (the CPU, whose tl.dot multiplies bf16 operands' raw bits in triton 3.9):
    operands widened to fp32 first, the same products (a product of two bf16 or fp16 values is exact in
    fp32) and the same fp32 accumulation."""
    w = load_weight_rows(w_ptr, s_ptr, k0, offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_N,
                         BLOCK_K, EVEN_K, a.dtype, PRECISION)
    if PRECISION == "interpreter":
        result = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        result = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return result


@triton.jit
def sum_splits(result, out_ptrs, partial_ptrs, split_stride, mask, counter_ptr, split, splits,
               PRECISION: tl.constexpr):
    """The end of a program that computed split `split` of `splits` of an output tile's reduction: result
    (fp32) is stored at partial_ptrs + split * split_stride, then the program counts itself in (counter_ptr:
    the tile's counter, `split_reduce.arrival_counters`); the last to arrive adds the splits in order,
    rounds them into out_ptrs once (where mask) and sets the counter back to zero."""
    tl.store(partial_ptrs + split * split_stride, result, mask=mask)
    tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == splits - 1:
        total = tl.zeros_like(result)
        for other in range(splits):
            total += tl.load(partial_ptrs + other * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, round_to(total, out_ptrs.dtype.element_ty, PRECISION), mask=mask)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, partial_ptr, counter_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_sn,
    stride_ym, stride_ps, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, UP_FRONT_TILES: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """One program: rows [pid(0) * BLOCK_M, +BLOCK_M), columns [pid(1) * BLOCK_N, +BLOCK_N), input columns
    [split * k_per_split, +k_per_split) (a multiple of BLOCK_K): its first UP_FRONT_TILES tiles of weights
    loaded before `wait_for_inputs` (PDL; unrolled) and stepped after it, the rest by `gemv_loop`. Writes y;
    split over K (SPLIT), it ends in `sum_splits` (partial_ptr: [splits, M, N], split stride stride_ps; one
    counter per output tile)."""
    allow_dependents(PDL)
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = tl.where(m_mask, offs_m, 0).to(tl.int64) * stride_xm
    k_start = split * k_per_split  # < K: every split has a tile
    tiles = gemv_tiles_ahead(w_ptr, s_ptr, k_start, offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE,
                             BLOCK_K, EVEN_K, x_ptr.dtype.element_ty, PRECISION, UP_FRONT_TILES)
    wait_for_inputs(PDL)
    acc = gemv_steps(gemv_zeros(BLOCK_M, BLOCK_N, BLOCK_K, BITS), tiles, x_ptr, x_rows, m_mask, k_start, K, BITS,
                     GROUP_SIZE, BLOCK_K, EVEN_K, UP_FRONT_TILES)
    acc = gemv_loop(acc, x_ptr, x_rows, m_mask, w_ptr, s_ptr, k_start + UP_FRONT_TILES * BLOCK_K,
                    tl.minimum(k_start + k_per_split, K), offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE,
                    BLOCK_K, EVEN_K, PRECISION)
    offsets, mask = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        sum_splits(gemv_sum(acc, BITS), y_ptr + offsets, partial_ptr + offsets, stride_ps, mask,
                   counter_ptr + pid_m * tl.num_programs(1) + pid_n, split, tl.num_programs(2), PRECISION)
    else:
        tl.store(y_ptr + offsets, round_to(gemv_sum(acc, BITS), y_ptr.dtype.element_ty, PRECISION), mask=mask)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """One program: the [BLOCK_M, BLOCK_N] tile (pid_m, pid_n) of y over all of K, by `accumulate_tile`
    (prefill chunks: under PDL it waits first, a tile's weights are one step of a long loop)."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & column_mask(offs_k, K, EVEN_K)[None, :], other=0.0)
        acc = accumulate_tile(acc, a, w_ptr, s_ptr, k0, offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE,
                              BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty, PRECISION), mask=m_mask[:, None] & n_mask[None, :])


def check_whole_word_groups(bits: int | None, group_size: int) -> None:
    """The GEMV form scales each packed word by one group scale: for 4 and 8 bits a group must hold whole
    words (compressed-tensors' groups of 32 / 64 / 128 and per-channel scales all do)."""
    if bits is not None and 32 % bits == 0 and group_size % (32 // bits):
        raise ValueError(f"group_size {group_size} splits a {bits}-bit word's {32 // bits} values across groups; "
                         f"the kernels need a multiple of {32 // bits}")


def dot_precision(x: torch.Tensor) -> str:
    """The PRECISION constexpr of `accumulate_tile` and `round_to`: fp32 products in IEEE precision
    (not TF32), so fp32 results match the reference; "interpreter" on the CPU (only Triton's interpreter
    runs kernels there: it needs the workarounds those helpers describe)."""
    if x.device.type == "cpu":
        return "interpreter"
    return "ieee" if x.dtype == torch.float32 else "tf32"


def quant_linear(x: torch.Tensor, weight_or_packed: torch.Tensor, *, scales: torch.Tensor | None = None,
                 bits: int | None = None, group_size: int | None = None) -> torch.Tensor:
    """As `naive.quant_linear`: y = x W^T, x [..., K] -> [..., N] in x's dtype, for W [N, K] in x's dtype or
    packed int32 [N, ceil(K * bits / 32)] with scales [N, K / group_size] (or [N, 1]). Under PDL the
    GEMV reads W and the scales before the previous kernel has finished: they must be weights, not a
    tensor the step computes."""
    check_weight(x, weight_or_packed, scales, bits)
    k = x.shape[-1]
    n = weight_or_packed.shape[0]
    if bits is not None:
        group_size = check_packed(weight_or_packed, scales, bits, k, group_size)
        check_whole_word_groups(bits, group_size)
        scales = scales.contiguous()
    weight = weight_or_packed.contiguous()
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out_shape = (*x.shape[:-1], n)
    if m == 0:
        return x.new_empty(out_shape)
    cfg = launch_config(m, n, k, bits, x.element_size())
    s_arg, stride_sn = (scales, scales.stride(0)) if scales is not None else (weight, 0)
    common = {"BITS": bits or 0, "GROUP_SIZE": 0 if bits is None else group_size, "BLOCK_M": cfg.block_m,
              "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "EVEN_K": k % cfg.block_k == 0,
              "PRECISION": dot_precision(x), "num_warps": cfg.num_warps}
    if cfg.use_dot:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        _gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
            x2, weight, s_arg, y, m, n, k, x2.stride(0), weight.stride(0), stride_sn, y.stride(0), **common,
            **launch_options(x.device))
        return y.view(out_shape)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.splits)
    split = cfg.splits > 1
    # (split: at most GEMV_TARGET_PROGRAMS / 2 output tiles, so the counters are made once, at the first call)
    partial = torch.empty((cfg.splits, m, n), dtype=torch.float32, device=x.device) if split else y
    counters = arrival_counters("quant_linear", x.device, grid[0] * grid[1]) if split else y
    _gemv_kernel[grid](x2, weight, s_arg, y, partial, counters, m, n, k, cfg.k_per_split, x2.stride(0),
                       weight.stride(0), stride_sn, y.stride(0), m * n, SPLIT=split,
                       UP_FRONT_TILES=cfg.up_front_tiles, **common, **launch_options(x.device))
    return y.view(out_shape)

