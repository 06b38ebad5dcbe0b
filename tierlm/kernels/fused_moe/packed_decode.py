"""The decode form of `fused_moe` (a few tokens) for experts packed in 4 or 8 bits (`quant_linear.packing`):
three launches that read the selected experts' words in place, built so that INT4 weights stream at memory
speed at 1-4 tokens, where the work is too small to hide a long chain of dependent loads per program.

  - Every program is one tile: its loads (words, scales, x) depend on nothing but the expert id and are
    all written before its first product, and the products' sum over K is split over programs
    (split-K: gate_up over H, down over I), so many programs each wait on memory about once. The fp32
    partial sums go to a workspace; the last program to arrive for an output tile (arrival counters,
    `kernels/split_reduce`) adds them in a fixed order (one [parts, columns] tile summed: deterministic;
    down's parts in top-k slot order, then the shared expert's) and finishes the tile in the same
    launch: gate_up's SiLU-and-mul, down's top-k sum and rounding.
  - Two instructions a value: a field masked in place (bits [p, p + BITS) of the word, p < 24: the high
    fields from the word shifted right by 8, once per word) *is* a float, the denormal q * 2^(p - 149)
    (a bit pattern below 2^24 weighs its integer value times 2^-149, across the denormal/normal edge).
    It meets x's value stored times 2^(149 - E - p) (`_split_x_kernel`), so one FMA adds q * x * 2^-E to
    the word's sum, which starts at -2^(BITS-1) * 2^-E * (the sum of the word's x values): the bias of
    every field removed at once, per word, not per value. A word's sum is then scaled by its group scale,
    and the row's sum by 2^E (so the weights are q * scale exactly, not rounded to x's dtype first as
    `naive` does). E = PRODUCT_EXPONENT keeps x's scaled copy and every product in the normal range for
    |x| in [2^-62, 2^43]. (The older form: the field ORed into the mantissa of a power of two,
    the power and bias subtracted, then the FMA: three instructions a value.)
  - x is read in its *split* layout: xs[t, j, w] = x[t, w * values_per_word + j] times plane j's factor,
    so value j of every word of a tile meets a [BLOCK_W] vector of x loaded straight into the words'
    layout (no shared memory, no barrier); `_split_x_kernel` writes it and the per-word bias sums for
    the tokens, gate_up's finishing programs write the activations the same way for down.
Launches: `_split_x_kernel` over (token, block of words); `_packed_decode_kernel` PHASE "gate_up" over
(row, column block, K split), rows being the tokens' shared expert (with one) then the (token, expert)
pairs; PHASE "down" over (token, column block of H, partial), the partials being each top-k slot's K
splits then the shared expert's. The shared expert takes its own format (INT6 in int4-mixed) through
`quant_linear.triton.gemv_loop`, one K tile of its own per program (its own split counts), so its work
spreads over programs like an expert's: it costs its bytes, not a long tail (the looped-tile form before
this one fused it at 0.74x of running it apart at batch 1 on an H200). Tiles: `PackedDecodeTiles`.

Early weights (PDL, `dependent_launch`; v1 at every group, v2 from PACKED_V2_EARLY_MIN_GROUP values a group,
as measured; TIERLM_NO_EARLY_EXPERT_WEIGHTS=1 turns it off): `_split_x_kernel` lets
gate_up start only once its own wait has returned, that is once the router has finished; so a routed item
of gate_up, and of down (which starts after gate_up has), reads its expert id and issues its first weight
loads before it waits for its inputs. gate_up's weights then stream in while split x runs, and down's
while gate_up's last items finish, where each launch otherwise began with a round trip to memory after
the kernel before it had ended. The shared expert's items, and items past a row's width, wait first.

Two K loops for the routed INT4 experts (`packed_variant`: by group size, as measured;
TIERLM_PACKED_MOE_VARIANT=v1|v2 forces one; everything else is shared):
  - v1: one [rows, words] tile a program (`_tile_sums`), a scale loaded per group (per word where the
    tile's words and the group's do not nest), each group's products summed, then scaled; its gate_up
    tiles (32 columns: 64 rows x 64 words on 4 warps) give a thread 8 rows x 4 words against 32 registers
    of x's planes.
  - v2 (`_looped_tile_sums`): tall tiles of whole groups, [rows, groups, words of a group], a thread one
    16-byte vector of each of its 8 rows (so the planes of x it holds serve 8 rows, not 4), one scale a
    group applied to the group's sum (not a product a value), and CHUNKS such tiles a program with the
    next one's loads issued before the current one's products (two tiles in flight a program, and the
    arrival round trip paid once per CHUNKS tiles). Ideas from public W4A16 GEMVs: gemlite's M = 1
    GEMVs (wide in N, thin in K a program: its H100 default 256 columns x 16 values, 2 warps; its
    revsplitK form two K steps a program, the second's loads issued after the first's math, partial
    sums added by atomics, which we keep out for a fixed order), and the W4A16 fused MoE kernels of
    vLLM / SGLang (`use_int4_w4a16`: the scale read once per group along K, fp32 accumulation; they pad
    M to a tl.dot tile, nothing to take for one row). Its tiles: `fused_moe.triton.PACKED_V2_TILES`.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import (
    allow_dependents,
    allow_dependents_once_waited,
    launch_options,
    wait_for_inputs,
)
from tierlm.kernels.fused_moe.decode_parts import (
    DTYPE_NAMES,
    SharedArgs,
    SharedShape,
    early_weights,
    round_as,
)
from tierlm.kernels.quant_linear.triton import dot_precision, gemv_loop, gemv_sum, gemv_zeros, round_to
from tierlm.kernels.split_reduce import arrival_counters

PRODUCT_EXPONENT = tl.constexpr(64)  # E: each product is q * x * 2^-E (module docstring)
SPLIT_X_BLOCK_W = 64  # words per `_split_x_kernel` program
VARIANTS = ("v1", "v2")  # TIERLM_PACKED_MOE_VARIANT (`packed_variant`)
# early weights (module docstring) for v2 from groups of this many values: on an H100 (session 18,
# bench/results/moe_decode_kernel_early_nvidia-h100.txt, each against the same K loop without), g128 1.06x (v1) and
# 1.09x (v2) at 1 token, 1.02-1.04x at 4, 1.00x at 16; g32 1.00-1.05x at 1 token, 0.97-0.99x at 4, 0.93-0.97x
# at 16 (v1 g32's gate_up then held 94 registers a thread against 64: fewer programs an SM), and in the
# real-width int4-mixed stack (g32) 0.996x at 1 token, 0.997x at 4 (decode_roofline_nvidia-h100_int4-mixed_s18early.txt).
# v1 at every group since its scales are loaded per group (session 20, H100,
# bench/results/moe_decode_kernel_group_scales_nvidia-h100.txt, v1 early over late): g32 1.08x at 1 token, 1.05x at 2,
# 1.02x at 4, 1.01x at 8, 1.00x at 16; g128 1.07x, 1.04x, 1.00x, 0.98x, 1.00x (where v2 is the default)
PACKED_V2_EARLY_MIN_GROUP = 128


# the INT4 group sizes where v1 is the default at every token count: since v1 scales per group, on an H100
# (session 20, `bench/moe_decode_kernel.py --formats int4-g32 int4-g128 --batches 1 2 4 8 16 --no-reference
# --packed-variants v1:early=0 v1:early=1 v2:early=0 v2:early=1`, bench/results/moe_decode_kernel_group_scales_nvidia-h100.txt),
# v1 (early weights) over v2 (late, as shipped at g32): g32 1.40x at 1 token, 1.30x at 2, 1.25x at 4, 1.20x at 8,
# 1.16x at 16; g128 v2 (early) over v1 (early): 1.07x, 1.06x, 1.14x, 1.21x, 1.23x (g64 not measured: v2)
PACKED_V1_GROUPS = frozenset({32})


def packed_variant(bits: int, group: int, v2_tiles: PackedDecodeTiles) -> str:
    """The routed experts' K loop for experts packed in `bits` in groups of `group` (at any number of tokens):
    TIERLM_PACKED_MOE_VARIANT, "v1" (one tile of words a program, `_tile_sums`) or "v2"
    (INT4 only, INT8 keeps v1: several tiles a program, double-buffered, one scale a group,
    `_looped_tile_sums`). Unset: v2 for INT4 where `v2_tiles` hold whole groups (`v2_misfit`), except at the
    groups where v1 measured faster (PACKED_V1_GROUPS); v1 otherwise."""
    variant = os.environ.get("TIERLM_PACKED_MOE_VARIANT")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"TIERLM_PACKED_MOE_VARIANT={variant!r}: choose one of {', '.join(VARIANTS)}")
    if bits != 4:
        return "v1"
    if variant is None:
        fits = v2_misfit(v2_tiles, bits, group) is None
        return "v2" if fits and group not in PACKED_V1_GROUPS else "v1"
    return variant


def packed_early(variant: str, group: int) -> bool:
    """Whether the routed items of `variant` at groups of `group` load their first weights before their wait
    ("Early weights" above; `early_weights`: TIERLM_NO_EARLY_EXPERT_WEIGHTS)."""
    return early_weights() and (variant == "v1" or group >= PACKED_V2_EARLY_MIN_GROUP)


class PackedDecodeTiles(NamedTuple):
    """The packed decode form's launch shape (module constant in `fused_moe.triton.DECODE_TILES`); each
    program reads one [rows, words] tile."""
    gate_up_block_n: int  # of the expert's I columns per gate_up program (rows: gate and up, 2x); a
    #                       multiple of the values per word (its activations' word sums are its own)
    gate_up_block_w: int  # packed words of H per gate_up program (H split over cdiv(H / values, this))
    gate_up_warps: int
    down_block_n: int  # of the H output rows per down program
    down_block_w: int  # packed words of I per down program (I split over cdiv(I / values, this))
    down_warps: int
    # the shared expert's K tile per program, in values (its own format: `gemv_loop`; INT6 accumulates per
    # run of 16 values, so the tile costs few registers: sm_90, triton 3.9, v1's tiles, 72 / 64 registers a
    # thread at 32 / 16 and at 128 / 64 alike, `bench/packed_decode_registers.py`); it takes the routed
    # programs' rows
    shared_gate_up_block_k: int = 32
    shared_down_block_k: int = 16
    # "v2" only (`packed_variant`): a program loops over this many tiles of *_block_w words, the next
    # tile's loads issued before the current one's products (v1 reads one tile a program)
    gate_up_chunks: int = 1
    down_chunks: int = 1


@triton.jit
def _plane_factor(j, BITS: tl.constexpr):
    """2^(149 - E - p) for fields j (int32 tensor): p, the bit where field j is read (`_field`)."""
    p = j * BITS
    p = tl.where(p + BITS > 24, p - 8, p)
    return ((-p + (127 + 149 - PRODUCT_EXPONENT)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _field(words, high, j: tl.constexpr, BITS: tl.constexpr):
    """Field j of each word as the denormal float q * 2^(p - 149) (p: its bit in `words`, or, for a field
    that reaches bit 24, in `high` = words >> 8)."""
    if (j + 1) * BITS <= 24:
        field = words & (((1 << BITS) - 1) << (j * BITS))
    else:
        field = high & (((1 << BITS) - 1) << (j * BITS - 8))
    return field.to(tl.float32, bitcast=True)


@triton.jit
def _split_x_kernel(x_ptr, xs_ptr, bias_ptr, stride_xt, bias_scale, WORDS: tl.constexpr, BITS: tl.constexpr,
                    BLOCK_W: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """x [T, H] -> xs [T, values, WORDS] (fp32, plane j times `_plane_factor`) and bias [T, WORDS] (the
    word's x values summed, times bias_scale = 2^(BITS-1) * 2^-E). Program (token, block of words).
    (Under PDL it waits first: it reads nothing but x. EARLY: it lets gate_up start only once its wait has
    returned, so gate_up may read the router's output before its own wait.)"""
    if EARLY:
        wait_for_inputs(PDL)
        allow_dependents_once_waited(PDL)
    else:
        allow_dependents(PDL)
        wait_for_inputs(PDL)
    VALUES: tl.constexpr = 32 // BITS
    token = tl.program_id(0).to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    j = tl.arange(0, VALUES)
    mask = (offs_w < WORDS)[None, :]
    x = tl.load(x_ptr + token * stride_xt + offs_w[None, :] * VALUES + j[:, None], mask=mask, other=0.0)
    x = x.to(tl.float32)
    tl.store(xs_ptr + token * (VALUES * WORDS) + j[:, None] * WORDS + offs_w[None, :],
             x * _plane_factor(j, BITS)[:, None], mask=mask)
    tl.store(bias_ptr + token * WORDS + offs_w, tl.sum(x, axis=0) * bias_scale, mask=offs_w < WORDS)


@triton.jit
def _plane(ptr, j: tl.constexpr, offs_w, inside, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Plane j of a split row (values j of words offs_w, [BLOCK_W]), 0 past the row's words."""
    if WORDS % BLOCK_W == 0:
        plane = tl.load(ptr + j * WORDS + offs_w)
    else:
        plane = tl.load(ptr + j * WORDS + offs_w, mask=inside, other=0.0)
    return plane


@triton.jit
def _tile_words(split, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):
    """(the words [BLOCK_W] of K split `split`, which of them lie inside the row)."""
    offs_w = split * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_w = tl.max_contiguous(tl.multiple_of(offs_w, BLOCK_W), BLOCK_W)
    return offs_w, offs_w < WORDS


@triton.jit
def _tile_planes(xs_ptr, bias_ptr, offs_w, inside, WORDS: tl.constexpr, BITS: tl.constexpr, BLOCK_W: tl.constexpr):
    """One row of split x at words offs_w: (its word sums, its planes x0..x7 ([BLOCK_W] each; with 4 values
    a word, x4..x7 repeat x0: not multiplied)), loaded in program order (ptxas then issues them up front: a
    loop over the planes left most of them between the products: sm_90, triton 3.9)."""
    x0 = _plane(xs_ptr, 0, offs_w, inside, WORDS, BLOCK_W)
    x1 = _plane(xs_ptr, 1, offs_w, inside, WORDS, BLOCK_W)
    x2 = _plane(xs_ptr, 2, offs_w, inside, WORDS, BLOCK_W)
    x3 = _plane(xs_ptr, 3, offs_w, inside, WORDS, BLOCK_W)
    x4, x5, x6, x7 = x0, x0, x0, x0
    if BITS == 4:
        x4 = _plane(xs_ptr, 4, offs_w, inside, WORDS, BLOCK_W)
        x5 = _plane(xs_ptr, 5, offs_w, inside, WORDS, BLOCK_W)
        x6 = _plane(xs_ptr, 6, offs_w, inside, WORDS, BLOCK_W)
        x7 = _plane(xs_ptr, 7, offs_w, inside, WORDS, BLOCK_W)
    word_bias = _plane(bias_ptr, 0, offs_w, inside, WORDS, BLOCK_W)
    return word_bias, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _tile_weights(w_ptr, s_ptr, rows, split, offs_w, inside, WORDS: tl.constexpr, BITS: tl.constexpr,
                  GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    """The words [R, BLOCK_W] of weight rows `rows` ([R] int64, in range) at offs_w (K split `split`), and
    their group scales (fp32) [R, G]: one a group where the tile holds whole groups (G = BLOCK_W / words a
    group) or lies inside one (G = 1), else one a word (G = BLOCK_W); the weights' rows
    WORDS words long, their scales' WORDS / words per group: contiguous, so every offset is a constant."""
    VALUES: tl.constexpr = 32 // BITS
    GROUP_WORDS: tl.constexpr = GROUP_SIZE // VALUES
    stride_wn: tl.constexpr = WORDS
    stride_sn: tl.constexpr = WORDS // GROUP_WORDS
    word_ptrs = w_ptr + rows[:, None] * stride_wn + offs_w[None, :]
    if BLOCK_W % GROUP_WORDS == 0 or GROUP_WORDS % BLOCK_W == 0:  # a tile holds whole groups or lies in one
        offs_g = (split * BLOCK_W) // GROUP_WORDS + tl.arange(0, max(BLOCK_W // GROUP_WORDS, 1))
        scale_mask = offs_g < stride_sn
    else:
        offs_g = offs_w // GROUP_WORDS
        scale_mask = inside
    scale_ptrs = s_ptr + rows[:, None] * stride_sn + offs_g[None, :]
    if WORDS % BLOCK_W == 0:
        words = tl.load(word_ptrs).to(tl.uint32, bitcast=True)
        scale = tl.load(scale_ptrs).to(tl.float32)
    else:
        words = tl.load(word_ptrs, mask=inside[None, :], other=0).to(tl.uint32, bitcast=True)
        scale = tl.load(scale_ptrs, mask=scale_mask[None, :], other=0.0).to(tl.float32)
    return words, scale


@triton.jit
def _tile_products(words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7, BITS: tl.constexpr):
    """Each row's sum (times 2^-E) of one tile: each word's fields multiplied in place against x's planes,
    the bias taken off per word, then the words of each of scale's G groups summed and each group's sum
    times its scale (one product a group, not a word: with G = BLOCK_W, a word's sum times its scale)."""
    high = words >> 8
    acc = _field(words, high, 0, BITS) * x0[None, :] - word_bias[None, :]
    acc += _field(words, high, 1, BITS) * x1[None, :]
    acc += _field(words, high, 2, BITS) * x2[None, :]
    acc += _field(words, high, 3, BITS) * x3[None, :]
    if BITS == 4:
        acc += _field(words, high, 4, BITS) * x4[None, :]
        acc += _field(words, high, 5, BITS) * x5[None, :]
        acc += _field(words, high, 6, BITS) * x6[None, :]
        acc += _field(words, high, 7, BITS) * x7[None, :]
    ROWS: tl.constexpr = acc.shape[0]
    GROUPS: tl.constexpr = scale.shape[1]
    if GROUPS == acc.shape[1]:
        sums = tl.sum(acc * scale, axis=1)
    else:
        sums = tl.sum(tl.sum(tl.reshape(acc, (ROWS, GROUPS, acc.shape[1] // GROUPS)), axis=2) * scale, axis=1)
    return sums


@triton.jit
def _tile_sums(w_ptr, s_ptr, rows, xs_ptr, bias_ptr, split, WORDS: tl.constexpr, BITS: tl.constexpr,
               GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """Each row's sum, times 2^-E, over words [split * BLOCK_W, +BLOCK_W) of weight rows `rows` against one
    row of split x (planes at xs_ptr, word sums at bias_ptr): [R] fp32. The words, their scales and x are
    loaded together, then each word's fields are multiplied in place. EARLY: the weights are loaded
    first, then the program waits for its inputs, then x; else x's planes first (they need
    no expert id; ptxas still issues some of the words after the first products at 4 rows a thread:
    other programs on the SM cover that wait)."""
    offs_w, inside = _tile_words(split, WORDS, BLOCK_W)
    if EARLY:
        words, scale = _tile_weights(w_ptr, s_ptr, rows, split, offs_w, inside, WORDS, BITS, GROUP_SIZE, BLOCK_W)
        wait_for_inputs(PDL)
        word_bias, x0, x1, x2, x3, x4, x5, x6, x7 = _tile_planes(xs_ptr, bias_ptr, offs_w, inside, WORDS, BITS,
                                                                 BLOCK_W)
    else:
        word_bias, x0, x1, x2, x3, x4, x5, x6, x7 = _tile_planes(xs_ptr, bias_ptr, offs_w, inside, WORDS, BITS,
                                                                 BLOCK_W)
        words, scale = _tile_weights(w_ptr, s_ptr, rows, split, offs_w, inside, WORDS, BITS, GROUP_SIZE, BLOCK_W)
    return _tile_products(words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7, BITS)


@triton.jit
def _early_wait(EARLY: tl.constexpr, PDL: tl.constexpr):
    """Where an EARLY program waits for its inputs (its weights already loading); the others waited first."""
    if EARLY:
        wait_for_inputs(PDL)


@triton.jit
def _chunk_words(first_word, WORDS: tl.constexpr, GROUP_WORDS: tl.constexpr, BLOCK_G: tl.constexpr):
    """v2: one chunk's BLOCK_G whole groups of GROUP_WORDS words from word first_word (a multiple of
    GROUP_WORDS): (the groups [BLOCK_G], their words [BLOCK_G, GROUP_WORDS], which words lie inside the row)."""
    offs_g = first_word // GROUP_WORDS + tl.arange(0, BLOCK_G)
    offs_w = offs_g[:, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, :]
    return offs_g, offs_w, offs_w < WORDS


@triton.jit
def _chunk_planes(xs_ptr, bias_ptr, offs_w, inside, WORDS: tl.constexpr):
    """v2: x's word sums and eight planes at one chunk's words [BLOCK_G, GROUP_WORDS] (0 past the row)."""
    x0 = tl.load(xs_ptr + 0 * WORDS + offs_w, mask=inside, other=0.0)
    x1 = tl.load(xs_ptr + 1 * WORDS + offs_w, mask=inside, other=0.0)
    x2 = tl.load(xs_ptr + 2 * WORDS + offs_w, mask=inside, other=0.0)
    x3 = tl.load(xs_ptr + 3 * WORDS + offs_w, mask=inside, other=0.0)
    x4 = tl.load(xs_ptr + 4 * WORDS + offs_w, mask=inside, other=0.0)
    x5 = tl.load(xs_ptr + 5 * WORDS + offs_w, mask=inside, other=0.0)
    x6 = tl.load(xs_ptr + 6 * WORDS + offs_w, mask=inside, other=0.0)
    x7 = tl.load(xs_ptr + 7 * WORDS + offs_w, mask=inside, other=0.0)
    word_bias = tl.load(bias_ptr + offs_w, mask=inside, other=0.0)
    return word_bias, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _chunk_weights(w_ptr, s_ptr, rows, offs_g, offs_w, inside, WORDS: tl.constexpr, GROUP_WORDS: tl.constexpr):
    """v2: one chunk's words [R, BLOCK_G, GROUP_WORDS] (each row's group a run of whole 16-byte vectors) and
    one scale a group [R, BLOCK_G]. Masked past the row (every group is whole: a run of words never
    straddles it)."""
    words = tl.load(w_ptr + rows[:, None, None] * WORDS + offs_w[None, :, :], mask=inside[None, :, :],
                    other=0).to(tl.uint32, bitcast=True)
    scale = tl.load(s_ptr + rows[:, None] * (WORDS // GROUP_WORDS) + offs_g[None, :],
                    mask=(offs_g < WORDS // GROUP_WORDS)[None, :], other=0.0)
    return words, scale


@triton.jit
def _chunk_loads(w_ptr, s_ptr, rows, xs_ptr, bias_ptr, first_word, WORDS: tl.constexpr, GROUP_WORDS: tl.constexpr,
                 BLOCK_G: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """v2: one chunk's loads, INT4 (`_chunk_words`): x's planes and word sums, then the words and scales;
    EARLY: the words and scales first, then the wait for the inputs (the first chunk's only), then x's."""
    offs_g, offs_w, inside = _chunk_words(first_word, WORDS, GROUP_WORDS, BLOCK_G)
    if EARLY:
        words, scale = _chunk_weights(w_ptr, s_ptr, rows, offs_g, offs_w, inside, WORDS, GROUP_WORDS)
        wait_for_inputs(PDL)
        word_bias, x0, x1, x2, x3, x4, x5, x6, x7 = _chunk_planes(xs_ptr, bias_ptr, offs_w, inside, WORDS)
    else:
        word_bias, x0, x1, x2, x3, x4, x5, x6, x7 = _chunk_planes(xs_ptr, bias_ptr, offs_w, inside, WORDS)
        words, scale = _chunk_weights(w_ptr, s_ptr, rows, offs_g, offs_w, inside, WORDS, GROUP_WORDS)
    return words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _chunk_sums(words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7):
    """v2: one chunk's group sums [R, BLOCK_G] (times 2^-E): each word's eight fields against x's planes
    (`_field`: the fields are the products' operands as they lie), the bias taken off per word, the
    group's words summed within the thread that loaded them, then one product by the group's scale."""
    high = words >> 8
    acc = _field(words, high, 0, 4) * x0[None, :, :] - word_bias[None, :, :]
    acc += _field(words, high, 1, 4) * x1[None, :, :]
    acc += _field(words, high, 2, 4) * x2[None, :, :]
    acc += _field(words, high, 3, 4) * x3[None, :, :]
    acc += _field(words, high, 4, 4) * x4[None, :, :]
    acc += _field(words, high, 5, 4) * x5[None, :, :]
    acc += _field(words, high, 6, 4) * x6[None, :, :]
    acc += _field(words, high, 7, 4) * x7[None, :, :]
    return tl.sum(acc, axis=2) * scale.to(tl.float32)


@triton.jit
def _looped_tile_sums(w_ptr, s_ptr, rows, xs_ptr, bias_ptr, split, WORDS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      BLOCK_W: tl.constexpr, CHUNKS: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """v2 (INT4): what `_tile_sums` returns, over words [split * BLOCK_W * CHUNKS, +BLOCK_W * CHUNKS) in
    CHUNKS chunks of BLOCK_W: each chunk's loads are issued before the chunk before it is multiplied
    (registers double-buffered: two chunks in flight a program all through its run, where a one-tile
    program has one, then waits on its arrival round trip with nothing loading); fp32 group sums
    accumulate over the chunks and are summed across the tile once, at the end. EARLY: the first chunk's
    weights are loaded before the wait for the inputs (`_chunk_loads`)."""
    GROUP_WORDS: tl.constexpr = GROUP_SIZE // 8
    BLOCK_G: tl.constexpr = BLOCK_W // GROUP_WORDS
    first = split * (BLOCK_W * CHUNKS)
    words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7 = _chunk_loads(
        w_ptr, s_ptr, rows, xs_ptr, bias_ptr, first, WORDS, GROUP_WORDS, BLOCK_G, EARLY, PDL)
    acc = tl.zeros(scale.shape, dtype=tl.float32)
    for chunk in range(1, CHUNKS):
        n_words, n_scale, n_bias, n0, n1, n2, n3, n4, n5, n6, n7 = _chunk_loads(
            w_ptr, s_ptr, rows, xs_ptr, bias_ptr, first + chunk * BLOCK_W, WORDS, GROUP_WORDS, BLOCK_G, False, PDL)
        acc += _chunk_sums(words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7)
        words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7 = (
            n_words, n_scale, n_bias, n0, n1, n2, n3, n4, n5, n6, n7)
    acc += _chunk_sums(words, scale, word_bias, x0, x1, x2, x3, x4, x5, x6, x7)
    return tl.sum(acc, axis=1)


@triton.jit
def _split_sums(w_ptr, s_ptr, rows, xs_ptr, bias_ptr, split, WORDS: tl.constexpr, BITS: tl.constexpr,
                GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, CHUNKS: tl.constexpr, VARIANT: tl.constexpr,
                EARLY: tl.constexpr, PDL: tl.constexpr):
    """The rows' sums (times 2^-E) over K split `split`: v1 one tile (`_tile_sums`), v2 CHUNKS tiles
    (`_looped_tile_sums`). EARLY: the program waits for its inputs in here, its first weights loading."""
    if VARIANT == "v2":
        sums = _looped_tile_sums(w_ptr, s_ptr, rows, xs_ptr, bias_ptr, split, WORDS, GROUP_SIZE, BLOCK_W, CHUNKS,
                                 EARLY, PDL)
    else:
        sums = _tile_sums(w_ptr, s_ptr, rows, xs_ptr, bias_ptr, split, WORDS, BITS, GROUP_SIZE, BLOCK_W, EARLY, PDL)
    return sums


@triton.jit
def _arrive(result, partial_ptr, counter_ptr, tile, part, PARTS: tl.constexpr, PARTS_P2: tl.constexpr,
            SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    """Part `part` of PARTS of output tile `tile` ([WIDTH] fp32 `result`): stored at partial[tile, part]
    (SLOTS >= PARTS parts a tile), then the program counts itself in; returns (whether it arrived last, the
    parts summed in order: valid for the last one only, which also sets the tile's counter back to zero)."""
    offs = tl.arange(0, WIDTH)
    base = partial_ptr + tile.to(tl.int64) * (SLOTS * WIDTH)
    tl.store(base + part * WIDTH + offs, result)
    tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
    last = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == PARTS - 1
    parts = tl.arange(0, PARTS_P2)
    total = tl.zeros((WIDTH,), dtype=tl.float32)
    if last:
        tile_parts = tl.load(base + parts[:, None] * WIDTH + offs[None, :], mask=(parts < PARTS)[:, None], other=0.0,
                             cache_modifier=".cg")
        total = tl.sum(tile_parts, axis=0)
        tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch
    return last, total


@triton.jit
def _gate_up_finish(total, row, pid_n, num_shared, act_ptr, act_bias_ptr, shared_act_ptr, S, bias_scale,
                    stride_sap, I: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
                    PRECISION: tl.constexpr):
    """total [2 * BLOCK_N]: row's gate sums then its up sums at columns [pid_n * BLOCK_N, +BLOCK_N).
    A pair's activations (rounded to x's dtype) go to act in the split layout, times the plane factors,
    with their word sums times bias_scale; the shared expert's to shared_act in x's dtype."""
    VALUES: tl.constexpr = 32 // BITS
    gate, up = tl.split(tl.trans(tl.reshape(total, (2, BLOCK_N))))
    act = round_as(gate / (1.0 + tl.exp(-gate)) * up, DTYPE, PRECISION)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pair = row - num_shared
    if pair >= 0:
        plane = offs_n % VALUES
        tl.store(act_ptr + pair.to(tl.int64) * I + plane * (I // VALUES) + offs_n // VALUES,
                 act * _plane_factor(plane, BITS), mask=offs_n < I)
        word_sums = tl.sum(tl.reshape(act, (BLOCK_N // VALUES, VALUES)), axis=1) * bias_scale
        offs_w = pid_n * (BLOCK_N // VALUES) + tl.arange(0, BLOCK_N // VALUES)
        tl.store(act_bias_ptr + pair.to(tl.int64) * (I // VALUES) + offs_w, word_sums, mask=offs_w < I // VALUES)
    else:
        tl.store(shared_act_ptr + row.to(tl.int64) * stride_sap + offs_n,
                 round_to(act, shared_act_ptr.dtype.element_ty, PRECISION), mask=offs_n < S)


@triton.jit
def _gate_up_end(sums, row, pid_n, split, num_shared, act_ptr, act_bias_ptr, shared_act_ptr, partial_ptr, counter_ptr,
                 S, bias_scale, stride_sap, I: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 N_BLOCKS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, SLOTS: tl.constexpr,
                 DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """A gate_up item's end: its sums are split `split` of SPLITS of row's column block pid_n; one split
    finishes the columns itself, several through `_arrive` (the last to arrive finishes them)."""
    if SPLITS == 1:
        _gate_up_finish(sums, row, pid_n, num_shared, act_ptr, act_bias_ptr, shared_act_ptr, S, bias_scale, stride_sap,
                        I, BITS, BLOCK_N, DTYPE, PRECISION)
    else:
        last, total = _arrive(sums, partial_ptr, counter_ptr, row * N_BLOCKS + pid_n, split, SPLITS, SPLITS_P2, SLOTS,
                              2 * BLOCK_N)
        if last:
            _gate_up_finish(total, row, pid_n, num_shared, act_ptr, act_bias_ptr, shared_act_ptr, S, bias_scale,
                            stride_sap, I, BITS, BLOCK_N, DTYPE, PRECISION)


@triton.jit
def _gate_up_program(
    row, pid_n, split, x_ptr, xs_ptr, x_bias_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, act_bias_ptr, shared_w_ptr,
    shared_s_ptr, shared_act_ptr, partial_ptr, counter_ptr, num_shared, S, product_scale, bias_scale, stride_xt,
    stride_swn, stride_ssn, stride_sap,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr, BLOCK_W: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr, SHARED_SPLITS: tl.constexpr, SHARED_SPLITS_P2: tl.constexpr, SLOTS: tl.constexpr,
    DTYPE: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr, SHARED_GROUP_SIZE: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, SHARED_EVEN_K: tl.constexpr, PRECISION: tl.constexpr, CHUNKS: tl.constexpr,
    VARIANT: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):
    """gate_up's item (row, pid_n, split): the gate and up sums of columns [pid_n * BLOCK_N, +BLOCK_N) over
    one K split. Rows below num_shared (T with a shared expert, else 0) are the tokens' shared expert: its
    own format, x read in place, `gemv_loop` over H's values [split * SHARED_BLOCK_K, +SHARED_BLOCK_K) (of
    SHARED_SPLITS); the others are pairs (pair = row - num_shared: token pair // TOP_K, expert ids[pair]):
    gate and up rows in one [2 * BLOCK_N, BLOCK_W] tile of H's words [split * BLOCK_W, +BLOCK_W) (of
    SPLITS). SLOTS: partials a column block holds (the larger split count). The split that arrives last
    finishes the columns (`_gate_up_end`). EARLY: a pair's item loads its expert id and weights before it
    waits for its inputs (`_split_sums`); every other path waits first (`_early_wait`)."""
    VALUES: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = H // VALUES
    pair = row - num_shared
    width = tl.where(pair >= 0, I, S)
    if pid_n * BLOCK_N < width:
        both = tl.arange(0, 2 * BLOCK_N)
        n = pid_n * BLOCK_N + both % BLOCK_N
        if pair >= 0:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            token = (pair // TOP_K).to(tl.int64)
            rows = n + (both >= BLOCK_N).to(tl.int32) * I
            if I % BLOCK_N != 0:
                rows = tl.where(n < I, rows, 0)  # clamped
            sums = _split_sums(w_ptr + expert * (2 * I * WORDS), s_ptr + expert * (2 * I * (H // GROUP_SIZE)),
                               rows.to(tl.int64), xs_ptr + token * H, x_bias_ptr + token * WORDS, split, WORDS, BITS,
                               GROUP_SIZE, BLOCK_W, CHUNKS, VARIANT, EARLY, PDL) * product_scale
            _gate_up_end(sums, row, pid_n, split, num_shared, act_ptr, act_bias_ptr, shared_act_ptr, partial_ptr,
                         counter_ptr, S, bias_scale, stride_sap, I, BITS, BLOCK_N, N_BLOCKS, SPLITS, SPLITS_P2, SLOTS,
                         DTYPE, PRECISION)
        else:
            _early_wait(EARLY, PDL)
            if HAS_SHARED:
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = offs_n < S
                x_rows = row.to(tl.int64) * stride_xt + tl.zeros((1,), dtype=tl.int64)
                one_row = tl.full((1,), 1, tl.int1)
                k_start = split * SHARED_BLOCK_K
                gate = gemv_loop(gemv_zeros(1, BLOCK_N, SHARED_BLOCK_K, SHARED_BITS), x_ptr, x_rows, one_row,
                                 shared_w_ptr, shared_s_ptr, k_start, k_start + SHARED_BLOCK_K, offs_n, n_mask,
                                 stride_swn, stride_ssn, H, SHARED_BITS, SHARED_GROUP_SIZE, SHARED_BLOCK_K,
                                 SHARED_EVEN_K, PRECISION)
                gate_sum = tl.reshape(gemv_sum(gate, SHARED_BITS), (BLOCK_N,))
                up = gemv_loop(gemv_zeros(1, BLOCK_N, SHARED_BLOCK_K, SHARED_BITS), x_ptr, x_rows, one_row,
                               shared_w_ptr + S * stride_swn, shared_s_ptr + S * stride_ssn, k_start,
                               k_start + SHARED_BLOCK_K, offs_n, n_mask, stride_swn, stride_ssn, H, SHARED_BITS,
                               SHARED_GROUP_SIZE, SHARED_BLOCK_K, SHARED_EVEN_K, PRECISION)
                up_sum = tl.reshape(gemv_sum(up, SHARED_BITS), (BLOCK_N,))
                sums = tl.reshape(tl.trans(tl.join(gate_sum, up_sum)), (2 * BLOCK_N,))
                _gate_up_end(sums, row, pid_n, split, num_shared, act_ptr, act_bias_ptr, shared_act_ptr, partial_ptr,
                             counter_ptr, S, bias_scale, stride_sap, I, BITS, BLOCK_N, N_BLOCKS, SHARED_SPLITS,
                             SHARED_SPLITS_P2, SLOTS, DTYPE, PRECISION)
    else:
        _early_wait(EARLY, PDL)  # (an item past its row's width: it reads and writes nothing)


@triton.jit
def _down_program(
    pid_n, token, part, act_ptr, act_bias_ptr, w_ptr, s_ptr, routing_ptr, ids_ptr, shared_act_ptr, shared_w_ptr,
    shared_s_ptr, shared_gate_ptr, out_ptr, partial_ptr, counter_ptr, S, product_scale, stride_sap, stride_swn,
    stride_ssn,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr, BLOCK_W: tl.constexpr, SPLITS: tl.constexpr, SHARED_SPLITS: tl.constexpr,
    PARTS_P2: tl.constexpr, DTYPE: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr, SHARED_GROUP_SIZE: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, SHARED_EVEN_K: tl.constexpr, PRECISION: tl.constexpr, CHUNKS: tl.constexpr,
    VARIANT: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):
    """down's item (pid_n, token (int64), part): rows [pid_n * BLOCK_N, +BLOCK_N) of H for one token. Parts
    below TOP_K * SPLITS are slot part // SPLITS's expert over I's words [(part % SPLITS) * BLOCK_W,
    +BLOCK_W), times its routing weight (rounded to x's dtype); the rest the shared expert's K ranges of
    S, times its gate (`gemv_loop`, its own format). The token's part that arrives last adds all parts in
    order and rounds out[token] once. EARLY: a slot's item loads its expert id, routing weight and weights
    before it waits for its inputs (`_split_sums`); the shared expert's items wait first (`_early_wait`)."""
    VALUES: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = I // VALUES
    PARTS: tl.constexpr = TOP_K * SPLITS + HAS_SHARED * SHARED_SPLITS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    rows = offs_n
    if H % BLOCK_N != 0:
        rows = tl.where(n_mask, offs_n, 0)  # clamped
    result = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if part < TOP_K * SPLITS:
        pair = token * TOP_K + part // SPLITS
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        routing = round_as(tl.load(routing_ptr + pair).to(tl.float32), DTYPE, PRECISION)
        result = _split_sums(w_ptr + expert * (H * WORDS), s_ptr + expert * (H * (I // GROUP_SIZE)),
                             rows.to(tl.int64), act_ptr + pair * I, act_bias_ptr + pair * WORDS, part % SPLITS, WORDS,
                             BITS, GROUP_SIZE, BLOCK_W, CHUNKS, VARIANT, EARLY, PDL) * (routing * product_scale)
    else:
        _early_wait(EARLY, PDL)
        if HAS_SHARED:
            k_start = (part - TOP_K * SPLITS) * SHARED_BLOCK_K
            acc = gemv_loop(gemv_zeros(1, BLOCK_N, SHARED_BLOCK_K, SHARED_BITS), shared_act_ptr,
                            token * stride_sap + tl.zeros((1,), dtype=tl.int64), tl.full((1,), 1, tl.int1),
                            shared_w_ptr, shared_s_ptr, k_start, k_start + SHARED_BLOCK_K, offs_n,
                            n_mask, stride_swn, stride_ssn, S, SHARED_BITS, SHARED_GROUP_SIZE, SHARED_BLOCK_K,
                            SHARED_EVEN_K, PRECISION)
            gate = round_as(tl.load(shared_gate_ptr + token).to(tl.float32), DTYPE, PRECISION)
            result = tl.reshape(gemv_sum(acc, SHARED_BITS), (BLOCK_N,)) * gate
    if PARTS == 1:
        tl.store(out_ptr + token * H + offs_n, round_to(result, out_ptr.dtype.element_ty, PRECISION), mask=n_mask)
    else:
        last, total = _arrive(result, partial_ptr, counter_ptr, token * N_BLOCKS + pid_n, part, PARTS, PARTS_P2,
                              PARTS, BLOCK_N)
        if last:
            tl.store(out_ptr + token * H + offs_n, round_to(total, out_ptr.dtype.element_ty, PRECISION), mask=n_mask)


@triton.jit
def _packed_decode_kernel(
    x_ptr, xs_ptr, x_bias_ptr, gu_w_ptr, gu_s_ptr, ids_ptr, act_ptr, act_bias_ptr, gu_shared_w_ptr, gu_shared_s_ptr,
    shared_act_ptr, gu_partial_ptr, gu_counter_ptr, dn_w_ptr, dn_s_ptr, routing_ptr, dn_shared_w_ptr, dn_shared_s_ptr,
    shared_gate_ptr, out_ptr, dn_partial_ptr, dn_counter_ptr, S, num_shared, product_scale, bias_scale, stride_xt,
    gu_stride_swn, gu_stride_ssn, stride_sap, dn_stride_swn, dn_stride_ssn,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    GU_BLOCK_N: tl.constexpr, GU_BLOCKS: tl.constexpr, GU_BLOCK_W: tl.constexpr, GU_SPLITS: tl.constexpr,
    GU_SPLITS_P2: tl.constexpr, GU_SHARED_SPLITS: tl.constexpr, GU_SHARED_SPLITS_P2: tl.constexpr,
    DN_BLOCK_N: tl.constexpr, DN_BLOCKS: tl.constexpr, DN_BLOCK_W: tl.constexpr, DN_SPLITS: tl.constexpr, DN_SHARED_SPLITS: tl.constexpr,
    DN_PARTS_P2: tl.constexpr, DTYPE: tl.constexpr,
    HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr, GU_SHARED_GROUP_SIZE: tl.constexpr,
    GU_SHARED_BLOCK_K: tl.constexpr, GU_SHARED_EVEN_K: tl.constexpr, DN_SHARED_GROUP_SIZE: tl.constexpr,
    DN_SHARED_BLOCK_K: tl.constexpr, DN_SHARED_EVEN_K: tl.constexpr, PHASE: tl.constexpr,
    PRECISION: tl.constexpr, GU_CHUNKS: tl.constexpr, DN_CHUNKS: tl.constexpr, VARIANT: tl.constexpr,
    EARLY: tl.constexpr, PDL: tl.constexpr,
):
    """PHASE "gate_up": program i is gate_up's item (split i % GU_SPLITS, column block (i // GU_SPLITS) %
    GU_BLOCKS, row i // (GU_SPLITS * GU_BLOCKS)); "down": down's item (part i % parts, column block
    (i // parts) % DN_BLOCKS, token i // (parts * DN_BLOCKS)): a tile's splits are neighbours. The experts'
    weights and scales are contiguous: their strides are constants. Under PDL every program waits for its
    inputs first, or with EARLY once its expert's first weights are loading (the module docstring says
    why it may read the router's output before its wait)."""
    allow_dependents(PDL)
    if not EARLY:
        wait_for_inputs(PDL)
    index = tl.program_id(0)
    if PHASE == "gate_up":
        row_items = GU_BLOCKS * GU_SPLITS  # the items of a pair's row; a shared expert's row has its own count
        first_pair, first = 0, 0
        if HAS_SHARED:
            first_pair, first = num_shared, num_shared * (GU_BLOCKS * GU_SHARED_SPLITS)
            if index < first:
                row_items = GU_BLOCKS * GU_SHARED_SPLITS
        if index < first:
            row, item = index // row_items, index % row_items
        else:
            row, item = first_pair + (index - first) // row_items, (index - first) % row_items
        splits = row_items // GU_BLOCKS
        _gate_up_program(
            row, item // splits, item % splits, x_ptr, xs_ptr, x_bias_ptr, gu_w_ptr, gu_s_ptr, ids_ptr, act_ptr,
            act_bias_ptr, gu_shared_w_ptr, gu_shared_s_ptr, shared_act_ptr, gu_partial_ptr, gu_counter_ptr, num_shared,
            S, product_scale, bias_scale, stride_xt, gu_stride_swn, gu_stride_ssn, stride_sap, H, I, TOP_K, BITS,
            GROUP_SIZE, GU_BLOCK_N, GU_BLOCKS, GU_BLOCK_W, GU_SPLITS, GU_SPLITS_P2, GU_SHARED_SPLITS,
            GU_SHARED_SPLITS_P2, max(GU_SPLITS, GU_SHARED_SPLITS), DTYPE, HAS_SHARED, SHARED_BITS,
            GU_SHARED_GROUP_SIZE, GU_SHARED_BLOCK_K, GU_SHARED_EVEN_K, PRECISION, GU_CHUNKS, VARIANT, EARLY, PDL)
    else:
        PARTS: tl.constexpr = TOP_K * DN_SPLITS + HAS_SHARED * DN_SHARED_SPLITS
        _down_program(
            (index // PARTS) % DN_BLOCKS, (index // (PARTS * DN_BLOCKS)).to(tl.int64), index % PARTS, act_ptr,
            act_bias_ptr, dn_w_ptr, dn_s_ptr, routing_ptr, ids_ptr, shared_act_ptr, dn_shared_w_ptr, dn_shared_s_ptr,
            shared_gate_ptr, out_ptr, dn_partial_ptr, dn_counter_ptr, S, product_scale, stride_sap, dn_stride_swn,
            dn_stride_ssn, H, I, TOP_K, BITS, GROUP_SIZE, DN_BLOCK_N, DN_BLOCKS, DN_BLOCK_W, DN_SPLITS, DN_SHARED_SPLITS, DN_PARTS_P2, DTYPE,
            HAS_SHARED, SHARED_BITS, DN_SHARED_GROUP_SIZE, DN_SHARED_BLOCK_K, DN_SHARED_EVEN_K, PRECISION, DN_CHUNKS,
            VARIANT, EARLY, PDL)


class PackedLaunch(NamedTuple):
    """The packed decode form's launch shape for one call shape (`_packed_launch`)."""
    buffer_sizes: tuple[int, ...]  # fp32 workspace: xs, x_bias, act, act_bias, gate_up_partial, down_partial
    split_x_grid: tuple[int, int]
    split_x_constants: Mapping
    num_shared: int  # rows of gate_up's items that are the tokens' shared expert (T with one, else 0)
    gate_up_counters: int  # arrival counters each phase needs (for max_tokens tokens)
    down_counters: int
    product_scale: float
    bias_scale: float
    gate_up: tuple[int, int]  # (programs, warps)
    down: tuple[int, int]
    constants: Mapping  # `_packed_decode_kernel`'s compile-time constants (read-only: shared by every call)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def v2_misfit(tiles: PackedDecodeTiles, bits: int, group: int) -> str | None:
    """Why v2 cannot take these tiles at this group size (None: it can). Its tiles are [rows, groups, words of
    a group]: each side a power of two, so each tile's words must be a power of two of whole groups."""
    group_words = group // (32 // bits)
    for name, block_w in (("gate_up_block_w", tiles.gate_up_block_w), ("down_block_w", tiles.down_block_w)):
        groups = block_w // group_words if group_words else 0
        if group_words * groups != block_w or not _power_of_two(group_words) or not _power_of_two(groups):
            return (f"v2: {name} {block_w} must be a power of two of whole groups of {group_words} words "
                    "(a power of two)")
    return None


@functools.cache
def _packed_launch(t: int, h: int, inter: int, top_k: int, bits: int, group: int, tiles: PackedDecodeTiles,
                   max_tokens: int, shared: SharedShape, dtype: str, precision: str, variant: str,
                   early: bool) -> PackedLaunch:
    """The three launches' shapes and constants for T tokens of top-k over experts [H -> I] packed in
    `bits`, worked out once per shape (eager decode calls this every layer of every step); `variant`:
    `packed_variant`'s; `early`: `early_weights`'."""
    values = 32 // bits
    if tiles.gate_up_block_n % values:
        raise ValueError(f"gate_up_block_n {tiles.gate_up_block_n} must be a multiple of {values} (values per word)")
    gate_up_chunks, down_chunks = tiles.gate_up_chunks, tiles.down_chunks
    if variant == "v1" and (gate_up_chunks, down_chunks) != (1, 1):
        raise ValueError(f"v1 reads one tile a program: chunks {gate_up_chunks}, {down_chunks} are v2's")
    if variant == "v2" and (misfit := v2_misfit(tiles, bits, group)) is not None:
        raise ValueError(misfit)
    words_h, words_i = h // values, inter // values
    gate_up_splits = triton.cdiv(words_h, tiles.gate_up_block_w * gate_up_chunks)
    down_splits = triton.cdiv(words_i, tiles.down_block_w * down_chunks)
    # the shared expert: one K tile of its own format per program (`shared.constants` caps the tiles)
    shared_constants = shared.constants(tiles.shared_gate_up_block_k, tiles.shared_down_block_k, h)
    shared_gate_up_splits = triton.cdiv(h, shared_constants["GU_SHARED_BLOCK_K"]) if shared.present else 0
    shared_down_splits = triton.cdiv(shared.width, shared_constants["DN_SHARED_BLOCK_K"]) if shared.present else 0
    num_shared = t * shared.present
    rows = num_shared + t * top_k
    gate_up_blocks = triton.cdiv(max(inter, shared.width), tiles.gate_up_block_n)
    down_blocks = triton.cdiv(h, tiles.down_block_n)
    parts = top_k * down_splits + shared_down_splits
    buffer_sizes = (t * h, t * words_h, t * top_k * inter, t * top_k * words_i,
                    rows * gate_up_blocks * max(gate_up_splits, shared_gate_up_splits) * 2 * tiles.gate_up_block_n,
                    t * down_blocks * parts * tiles.down_block_n)
    most_rows = max(t, max_tokens) * (1 + top_k)  # (as if with a shared expert: one size for both)
    constants = {
        "H": h, "I": inter, "TOP_K": top_k, "BITS": bits, "GROUP_SIZE": group, "GU_BLOCK_N": tiles.gate_up_block_n,
        "GU_BLOCKS": gate_up_blocks, "GU_BLOCK_W": tiles.gate_up_block_w, "GU_SPLITS": gate_up_splits,
        "GU_SPLITS_P2": triton.next_power_of_2(gate_up_splits), "GU_SHARED_SPLITS": shared_gate_up_splits,
        "GU_SHARED_SPLITS_P2": triton.next_power_of_2(shared_gate_up_splits), "DN_BLOCK_N": tiles.down_block_n,
        "DN_BLOCKS": down_blocks, "DN_BLOCK_W": tiles.down_block_w, "DN_SPLITS": down_splits,
        "DN_SHARED_SPLITS": shared_down_splits, "DN_PARTS_P2": triton.next_power_of_2(parts),
        "DTYPE": dtype, "PRECISION": precision, "GU_CHUNKS": gate_up_chunks, "DN_CHUNKS": down_chunks,
        "VARIANT": variant, "EARLY": early, **shared_constants}
    gate_up_items = gate_up_blocks * (num_shared * shared_gate_up_splits + t * top_k * gate_up_splits)
    return PackedLaunch(
        buffer_sizes, (t, triton.cdiv(words_h, SPLIT_X_BLOCK_W)),
        MappingProxyType({"WORDS": words_h, "BITS": bits, "BLOCK_W": SPLIT_X_BLOCK_W, "EARLY": early}), num_shared,
        most_rows * gate_up_blocks, max(t, max_tokens) * down_blocks, 2.0 ** PRODUCT_EXPONENT.value,
        2.0 ** (bits - 1 - PRODUCT_EXPONENT.value), (gate_up_items, tiles.gate_up_warps),
        (t * down_blocks * parts, tiles.down_warps), MappingProxyType(constants))


def packed_decode(x: torch.Tensor, weights: tuple, topk_weights: torch.Tensor, topk_ids: torch.Tensor, bits: int,
                  group: int, inter: int, tiles: PackedDecodeTiles, max_tokens: int, shared: SharedArgs,
                  variant: str = "v1") -> torch.Tensor:
    """The three launches for x [T, H] (contiguous); weights (w_gate_up, gate_up_scales, w_down,
    down_scales) packed in `bits` (4 or 8), contiguous (the kernels take their strides from the shapes),
    groups of whole words; `shared`: the shared expert (or its absence); `variant`: the routed experts'
    K loop (`packed_variant`). Returns [T, H] in x's dtype. max_tokens: the most tokens a call can bring (the
    arrival counters are made for that many once, so a captured graph never sees them remade)."""
    w_gate_up, gate_up_scales, w_down, down_scales = weights
    (t, h), top_k = x.shape, topk_ids.shape[1]
    launch = _packed_launch(t, h, inter, top_k, bits, group, tiles, max_tokens, shared.shape, DTYPE_NAMES[x.dtype],
                            dot_precision(x), variant, packed_early(variant, group))
    workspace = torch.empty(sum(launch.buffer_sizes), dtype=torch.float32, device=x.device)
    xs, x_bias, act, act_bias, gate_up_partial, down_partial = workspace.split(launch.buffer_sizes)
    _split_x_kernel[launch.split_x_grid](x, xs, x_bias, x.stride(0), launch.bias_scale, **launch.split_x_constants,
                                         **launch_options(x.device))
    shared_act = torch.empty((t, shared.width), dtype=x.dtype, device=x.device) if shared.present else x
    out = torch.empty_like(x)
    gate_up_counters = arrival_counters("fused_moe_packed_gate_up", x.device, launch.gate_up_counters)
    down_counters = arrival_counters("fused_moe_packed_down", x.device, launch.down_counters)
    args = (x, xs, x_bias, w_gate_up, gate_up_scales, topk_ids, act, act_bias, shared.w_gate_up, shared.gate_up_scales,
            shared_act, gate_up_partial, gate_up_counters, w_down, down_scales, topk_weights, shared.w_down,
            shared.down_scales, shared.gate, out, down_partial, down_counters, shared.width, launch.num_shared,
            launch.product_scale, launch.bias_scale, x.stride(0), shared.w_gate_up.stride(0),
            shared.gate_up_scales.stride(0), shared_act.stride(0), shared.w_down.stride(0),
            shared.down_scales.stride(0))
    for phase, (programs, warps) in (("gate_up", launch.gate_up), ("down", launch.down)):
        _packed_decode_kernel[(programs,)](*args, PHASE=phase, num_warps=warps, **launch.constants,
                                           **launch_options(x.device))
    return out
