"""`fused_moe` as Triton kernels (same signature as `naive`), the experts' weight format a compile-time
variant (unquantized, or packed INT4 / INT6 / INT8 with group scales: `quant_linear.packing`).

Every launch reads the selected experts' weights in place (no copy of an expert's weights is ever made),
and no launch needs a host sync, so a decode step can be captured in a CUDA graph. Two forms:
  - decode (up to DECODE_MAX_PAIRS (token, expert) pairs): GEMVs, one pair per program row (no tl.dot
    padding M to 16). Experts packed in 4 or 8 bits take `packed_decode` (split-K tiles, x read in a
    split layout: its docstring); unquantized and INT6 ones two launches here (the two phases of
    `_decode_gemv_kernel`), each product in its own fp32 accumulator summed once at the end
    (`quant_linear.triton.gemv_loop`), with no sort or gather first:
      1. "gate_up" (`_gate_up_gemv_program`): item (pair, n block) computes silu(x W_gate^T) *
         (x W_up^T) for `gate_up_block_n` of the expert's I columns, stored in x's dtype as `naive` rounds it;
      2. "down" (`_down_sum_gemv_program`): item (n block, token, split) ranks the token's k experts by id
         in registers and, in ascending id (the reference's order), adds routing weight x (act W_down^T)
         over `down_ranks` of them in fp32; when that is all k (and no shared expert) it rounds the
         token's output once (the top-k sum fused), else it stores its fp32 partial and the token's last
         program to arrive for these columns adds the splits in order (`decode_parts.finish_down`: on
         an H200 the extra programs in flight win, 2 ranks per program; no third launch).
    A shared expert (`SharedExpert`, the MoE block's, in any of the formats, its own width) is one more
    pair per token: the first T rows of gate_up's grid (its act stored apart) and split 0 of down's
    (gate x its down product), by `decode_parts`' helpers, so its gated output joins the same sum and
    the block needs no launch of its own for it. Tiles per weight format: DECODE_TILES.
    Two pairs on one expert read its weights twice, which at 10 of 512 experts per token is rare.
  - prefill: each token's experts sorted by id, then `align_pairs_to_blocks` (vLLM's
    moe_align_block_size, in torch) sorts the pairs by expert into blocks of PREFILL_BLOCK_M rows, each
    expert's run padded to a whole block; `_gate_up_kernel` and `_down_kernel` are a grouped GEMM over
    those blocks (tl.dot), one expert's weights per block, blocks past the end idle; the down products
    times the routing weight are stored per pair in fp32 and `_sum_chunks_kernel` adds each token's k of
    them in ascending expert id, rounding once.
Launches use programmatic dependent launch (`dependent_launch`): gate_up's programs wait for the kernel
before it first, as which expert they read is the router's output; with early weights
(`decode_parts.early_weights`) gate_up lets down start only once its own wait has returned, so down's
routed items read the router's output and load their first EARLY_DOWN_TILES tiles before their wait
(`dependent_launch`'s exception; the packed form does the same for both phases, `packed_decode`). The
decode form's launch shape and constants are worked out once per call shape (`_decode_launch`,
`packed_decode._packed_launch`).
"""

from __future__ import annotations

import functools
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
    SharedArgs,
    SharedShape,
    down_columns,
    early_weights,
    expert_ranks,
    finish_down,
    swiglu_columns,
)
from tierlm.kernels.fused_moe.naive import SharedExpert, check_moe_args
from tierlm.kernels.fused_moe.packed_decode import PackedDecodeTiles, packed_decode, packed_variant
from tierlm.kernels.quant_linear.triton import (
    accumulate_tile,
    check_whole_word_groups,
    column_mask,
    dot_precision,
    round_to,
)
from tierlm.kernels.split_reduce import arrival_counters


class DecodeTiles(NamedTuple):
    """The decode form's launch shape for one weight format."""
    gate_up_block_n: int  # of the expert's I columns per gate_up program (gate and up rows each)
    gate_up_block_k: int  # input columns per step
    gate_up_warps: int
    down_block_n: int  # of the H output columns per down program
    down_block_k: int
    down_warps: int
    down_ranks: int  # of a token's top-k experts per down program: with fewer than top-k, the programs
    #                  store fp32 partials that the token's last program to finish adds (more in flight)
    shared_gate_up_block_k: int = 512  # the shared expert's K tiles (its format may differ from the
    shared_down_block_k: int = 128  # routed experts'; its programs take the routed tiles' BLOCK_N)


# Tile sizes, per weight format (bits; 0 unquantized): module constants so a benchmark can sweep them.
# Chosen on an H200 by bench/moe_decode_kernel.py --sweep (bench/results/moe_decode_kernel_nvidia_h200.json)
# for bf16 (INT6 the same) and INT4 (INT8 the same: the same packed-word GEMV). bf16 since session 11: the
# best of a wider sweep (gate_up 4-16 columns x K 256-1024 x 2-8 warps, down 8-32 x 128-256 x ranks 1-2 x
# 2-8 warps; bench/results/moe_decode_kernel_bf16_sweep_nvidia_h200_s11.txt) taken into the real-width stack,
# interleaved with the earlier (8, 512, 4, 16, 128, 4, 2): 1.018x tok/s at batch 1, 1.010-1.012x at 4 and 16
# (bench/results/decode_roofline_nvidia-h200_s11tiles.txt); INT6 experts keep the earlier tiles (not measured)
DECODE_MAX_PAIRS = 160  # up to this many (token, expert) pairs (16 tokens of top-10), the GEMV form
# (4 and 8 bits: `packed_decode`'s split-K form, its routed tiles below; the shared expert's K tiles, swept by
# bench/moe_decode_kernel.py --shared --shared-sweep: with INT6 read by runs of 16 values (quant_linear's
# `six_bit_tile`, session 11) 128 / 64 at g32 one token, the v1 K loop's case: the MoE block with its INT6
# shared expert in 28.9 us against 35.9 at the earlier 32 / 16 (H200,
# bench/results/moe_decode_kernel_shared_int6_runs_nvidia_h200_s11.txt); v2's keep 32 / 16, unmeasured)
# The v1 K loop's tiles (INT4 g32, INT8) since session 24: gate_up 32 columns (was 16), down 128 rows on 2 warps
# (was 64 on 4), fewer and larger programs. INT4 g32 experts alone (`bench/moe_decode_kernel.py --formats int4-g32
# --batches 1 2 4 --no-reference --packed-variants v1 v1:down_block_n=128,gate_up_block_n=32,down_warps=2 ...`):
# 1.14x / 1.15x / 1.17x over the old at 1 / 2 / 4 tokens on an H200 (34.2% -> 38.9% of the copy bandwidth at one
# token; bench/results/moe_decode_kernel_v1_tiles_nvidia-h200_s24.txt; 16 candidates on an H100 before it:
# ..._v1_tiles_nvidia-h100_s24.txt; at 8 / 16 tokens on an H100 1.18x / 1.19x, 69.8% / 68.5% of the copy bandwidth,
# ..._v1_tiles_b8_16_nvidia-h100_s24.txt); the int4-mixed real-width stack (`tiles_ab.py --quantize int4-mixed
# --variants base PACKED_TILES=...`): 1.004x at batch 1, 1.029x at 4 (decode_roofline_nvidia-h200_int4-mixed_s24tiles.*).
# INT8 experts take the same tiles, unmeasured.
DECODE_TILES = {0: DecodeTiles(4, 512, 4, 16, 128, 2, 1), 6: DecodeTiles(8, 512, 4, 16, 128, 4, 2),
                **dict.fromkeys((4, 8), PackedDecodeTiles(32, 64, 4, 128, 16, 2, shared_gate_up_block_k=128,
                                                          shared_down_block_k=64))}
# INT4's v2 K loop (`packed_decode.packed_variant`: the default but at g32 one token): tall tiles of 16 words (one
# 16-byte vector of each row a thread, 8 rows a thread sharing x's planes): gate_up 128 rows (64 columns)
# on 2 warps looping over 2 tiles (16 KB a program), down 256 rows on 4 warps, one tile. First guesses,
# checked only by compiling for sm_90 without a GPU (triton 3.9, g32 and g128): gate_up 124 registers
# (134 with the INT6 shared expert: its branch takes the routed rows; at 128 columns on 4 warps it takes
# 255), down 96, no spills; to be measured on an H200 by bench/moe_decode_kernel.py --packed-variants
PACKED_V2_TILES = PackedDecodeTiles(64, 16, 2, 256, 16, 4, gate_up_chunks=2, down_chunks=1)
# early weights (`decode_parts.early_weights`): down's K tiles of its first expert a program loads before its
# wait (unquantized and INT6; bf16 at the target: 16 rows x 128 values, 4 KB a tile). bf16 experts at the target
# on an H100 (session 18, `bench/moe_decode_kernel.py --formats bf16 --early-down-tiles 0 1 2 3`,
# bench/results/moe_decode_kernel_early_nvidia-h100.txt): 1, 2 and 3 tiles 1.14-1.15x over none at 1 token
# (51.2 -> 44.7 us: 63.6% -> 72.9% of the copy bandwidth), 1.01x at 4, 1.00x at 16; INT6 experts not measured
EARLY_DOWN_TILES = 2
PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_NUM_WARPS = 32, 64, 64, 4
SUM_BLOCK = 256


@triton.jit
def _gate_up_gemv_program(
    row, pid_n, x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, shared_w_ptr, shared_s_ptr, shared_out_ptr, H, I, S,
    num_shared, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_op, stride_swn, stride_ssn, stride_sop,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr,
    SHARED_GROUP_SIZE: tl.constexpr, SHARED_BLOCK_K: tl.constexpr, SHARED_EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """gate_up's item (row, pid_n): columns [pid_n * BLOCK_N, +BLOCK_N) of row `row`. Rows below
    num_shared (T with a shared expert, else 0) are the tokens' shared expert: shared_out[token, n] =
    silu(gate) * up of the shared expert's S columns; the others are pairs (pair = row - num_shared: token
    pair // TOP_K, expert ids[pair]): out[pair, n] = silu(gate) * up, gate = x W[e, n], up = x W[e, I + n]."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pair = row - num_shared
    if pair >= 0:
        if pid_n * BLOCK_N < I:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            act = swiglu_columns(x_ptr, (pair // TOP_K).to(tl.int64) * stride_xt, w_ptr + expert * stride_we,
                                 s_ptr + expert * stride_se, I, offs_n, stride_wn, stride_sn, H, BITS, GROUP_SIZE,
                                 BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
            tl.store(out_ptr + pair.to(tl.int64) * stride_op + offs_n[None, :],
                     round_to(act, out_ptr.dtype.element_ty, PRECISION), mask=(offs_n < I)[None, :])
    else:
        if HAS_SHARED:  # noqa: SIM102 - a constexpr: without a shared expert its branch is not compiled
            if pid_n * BLOCK_N < S:
                act = swiglu_columns(x_ptr, row.to(tl.int64) * stride_xt, shared_w_ptr, shared_s_ptr, S, offs_n,
                                     stride_swn, stride_ssn, H, SHARED_BITS, SHARED_GROUP_SIZE, BLOCK_N,
                                     SHARED_BLOCK_K, SHARED_EVEN_K, PRECISION)
                tl.store(shared_out_ptr + row.to(tl.int64) * stride_sop + offs_n[None, :],
                         round_to(act, shared_out_ptr.dtype.element_ty, PRECISION), mask=(offs_n < S)[None, :])


@triton.jit
def _down_sum_gemv_program(
    pid_n, token, split, n_blocks, act_ptr, w_ptr, s_ptr, routing_ptr, ids_ptr, shared_act_ptr, shared_w_ptr,
    shared_s_ptr, shared_gate_ptr, out_ptr, partial_ptr, counter_ptr, H, I, S, stride_ap, stride_we, stride_wn,
    stride_se, stride_sn, stride_sap, stride_swn, stride_ssn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, RANKS: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr,
    SHARED_BITS: tl.constexpr, SHARED_GROUP_SIZE: tl.constexpr, SHARED_BLOCK_K: tl.constexpr,
    SHARED_EVEN_K: tl.constexpr, PRECISION: tl.constexpr, EARLY_TILES: tl.constexpr, PDL: tl.constexpr,
):
    """down's item (pid_n of n_blocks, token (int64), split): columns [pid_n * BLOCK_N, +BLOCK_N) of H.
    With a shared expert split 0 is it: gate x (shared_act[token] W_shared_down[h]); the other splits (all
    of them without one) take the token's experts of ranks [routed split * RANKS, +RANKS) (those below
    TOP_K) by ascending id (SLOTS: TOP_K rounded up to a power of 2): the sum over those ranks, in order,
    of routing x (act[pair] W_down[e, h]) in fp32. The splits' results end in `finish_down`: out[token]
    rounded once, by the item itself (one split) or by the token's last item to arrive. EARLY_TILES > 0:
    the program has not waited for its inputs yet; a routed item reads its token's experts and loads its
    first expert's first EARLY_TILES tiles, then waits (`down_columns`), the shared expert's item waits
    first."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    result = tl.zeros((BLOCK_N,), dtype=tl.float32)
    routed_split = split - HAS_SHARED
    if routed_split >= 0:
        slots, valid, rank = expert_ranks(ids_ptr, token, TOP_K, SLOTS)
        for r in tl.static_range(RANKS):
            if routed_split * RANKS + r < TOP_K:
                slot = tl.sum(tl.where(valid & (rank == routed_split * RANKS + r), slots, 0), axis=0)
                pair = token * TOP_K + slot
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                routing = round_to(tl.load(routing_ptr + pair).to(tl.float32), act_ptr.dtype.element_ty, PRECISION)
                result += routing.to(tl.float32) * down_columns(
                    act_ptr, pair * stride_ap, w_ptr + expert * stride_we, s_ptr + expert * stride_se, offs_n,
                    n_mask, stride_wn, stride_sn, I, BITS, GROUP_SIZE, BLOCK_N, BLOCK_K, EVEN_K, PRECISION,
                    EARLY_TILES if r == 0 else 0, PDL)
    else:
        if EARLY_TILES > 0:
            wait_for_inputs(PDL)
        if HAS_SHARED:
            gate = round_to(tl.load(shared_gate_ptr + token).to(tl.float32), act_ptr.dtype.element_ty, PRECISION)
            result += gate.to(tl.float32) * down_columns(
                shared_act_ptr, token * stride_sap, shared_w_ptr, shared_s_ptr, offs_n, n_mask, stride_swn,
                stride_ssn, S, SHARED_BITS, SHARED_GROUP_SIZE, BLOCK_N, SHARED_BLOCK_K, SHARED_EVEN_K, PRECISION, 0,
                PDL)
    finish_down(result, out_ptr, partial_ptr, counter_ptr, token, pid_n, n_blocks, split, offs_n, n_mask, H,
                HAS_SHARED + (TOP_K + RANKS - 1) // RANKS, PRECISION)


@triton.jit
def _decode_gemv_kernel(
    x_ptr, gu_w_ptr, gu_s_ptr, act_ptr, ids_ptr, gu_shared_w_ptr, gu_shared_s_ptr, shared_act_ptr, dn_w_ptr, dn_s_ptr,
    routing_ptr, dn_shared_w_ptr, dn_shared_s_ptr, shared_gate_ptr, out_ptr, partial_ptr, counter_ptr,
    T, H, I, S, num_shared, gate_up_blocks, down_blocks,
    stride_xt, gu_stride_we, gu_stride_wn, gu_stride_se, gu_stride_sn, stride_ap, gu_stride_swn, gu_stride_ssn,
    stride_sap, dn_stride_we, dn_stride_wn, dn_stride_se, dn_stride_sn, dn_stride_swn, dn_stride_ssn,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, RANKS: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    GU_BLOCK_N: tl.constexpr, GU_BLOCK_K: tl.constexpr, GU_EVEN_K: tl.constexpr, DN_BLOCK_N: tl.constexpr,
    DN_BLOCK_K: tl.constexpr, DN_EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr,
    GU_SHARED_GROUP_SIZE: tl.constexpr, GU_SHARED_BLOCK_K: tl.constexpr, GU_SHARED_EVEN_K: tl.constexpr,
    DN_SHARED_GROUP_SIZE: tl.constexpr, DN_SHARED_BLOCK_K: tl.constexpr, DN_SHARED_EVEN_K: tl.constexpr,
    PHASE: tl.constexpr, PRECISION: tl.constexpr, EARLY_TILES: tl.constexpr, PDL: tl.constexpr,
):
    """PHASE "gate_up": program i is gate_up's item (block i % gate_up_blocks, row i // gate_up_blocks);
    "down": down's item (block i % down_blocks, token (i // down_blocks) % T, split i // (down_blocks * T))
    (a constexpr: each phase compiles only its own items' code). Under PDL a program waits first: which
    expert an item reads is the router's output (a shared expert's items, a few of them, wait too); but with
    EARLY_TILES > 0 (early weights), gate_up lets down start only once its own wait has returned
    (`dependent_launch`'s exception), so down's routed items read the router's output and load their
    first weights before they wait (`_down_sum_gemv_program`)."""
    if PHASE == "gate_up" and EARLY_TILES > 0:
        wait_for_inputs(PDL)
        allow_dependents_once_waited(PDL)
    else:
        allow_dependents(PDL)
        if PHASE == "gate_up" or EARLY_TILES == 0:
            wait_for_inputs(PDL)
    index = tl.program_id(0)
    if PHASE == "gate_up":
        _gate_up_gemv_program(
            index // gate_up_blocks, index % gate_up_blocks, x_ptr, gu_w_ptr, gu_s_ptr, act_ptr, ids_ptr,
            gu_shared_w_ptr, gu_shared_s_ptr, shared_act_ptr, H, I, S, num_shared, stride_xt, gu_stride_we,
            gu_stride_wn, gu_stride_se, gu_stride_sn, stride_ap, gu_stride_swn, gu_stride_ssn, stride_sap, TOP_K, BITS,
            GROUP_SIZE, GU_BLOCK_N, GU_BLOCK_K, GU_EVEN_K, HAS_SHARED, SHARED_BITS, GU_SHARED_GROUP_SIZE,
            GU_SHARED_BLOCK_K, GU_SHARED_EVEN_K, PRECISION)
    else:
        _down_sum_gemv_program(
            index % down_blocks, ((index // down_blocks) % T).to(tl.int64), index // (down_blocks * T), down_blocks,
            act_ptr, dn_w_ptr, dn_s_ptr, routing_ptr, ids_ptr, shared_act_ptr, dn_shared_w_ptr, dn_shared_s_ptr,
            shared_gate_ptr, out_ptr, partial_ptr, counter_ptr, H, I, S, stride_ap, dn_stride_we, dn_stride_wn,
            dn_stride_se, dn_stride_sn, stride_sap, dn_stride_swn, dn_stride_ssn, TOP_K, SLOTS, RANKS, BITS,
            GROUP_SIZE, DN_BLOCK_N, DN_BLOCK_K, DN_EVEN_K, HAS_SHARED, SHARED_BITS, DN_SHARED_GROUP_SIZE,
            DN_SHARED_BLOCK_K, DN_SHARED_EVEN_K, PRECISION, EARLY_TILES, PDL)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, H, I,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_op,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """The grouped GEMM's gate_up. One program: the pairs of block pid(0) (all on one expert; ids >= num_pairs are padding), columns
    [pid(1) * BLOCK_N, +BLOCK_N) of I. out[pair, n] = silu(gate) * up, gate = x W[e, n], up = x W[e, I + n].
    (Under PDL it waits first: the blocks' experts are inputs.)"""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    block, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        tokens = (pairs // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        gate_w, gate_s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
        up_w, up_s = gate_w + I * stride_wn, gate_s + I * stride_sn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                        mask=valid[:, None] & column_mask(offs_k, H, EVEN_K)[None, :], other=0.0)
            gate = accumulate_tile(gate, a, gate_w, gate_s, k0, offs_n, n_mask, stride_wn, stride_sn, H, BITS,
                                   GROUP_SIZE, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
            up = accumulate_tile(up, a, up_w, up_s, k0, offs_n, n_mask, stride_wn, stride_sn, H, BITS,
                                 GROUP_SIZE, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        act = gate / (1.0 + tl.exp(-gate)) * up
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_op + offs_n[None, :]
        tl.store(out_ptrs, round_to(act, out_ptr.dtype.element_ty, PRECISION), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, routing_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, H, I,
    stride_ap, stride_we, stride_wn, stride_se, stride_sn, stride_op,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """The grouped GEMM's down. One program: the pairs of block pid(0), columns [pid(1) * BLOCK_N, +BLOCK_N) of H.
    out[pair, h] = routing[pair] * (act[pair] W_down[e, h]), in fp32. (Under PDL it waits first.)"""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    block, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = pairs.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_e, s_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + rows[:, None] * stride_ap + offs_k[None, :],
                        mask=valid[:, None] & column_mask(offs_k, I, EVEN_K)[None, :], other=0.0)
            acc = accumulate_tile(acc, a, w_e, s_e, k0, offs_n, n_mask, stride_wn, stride_sn, I, BITS, GROUP_SIZE,
                                  BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        routing = tl.load(routing_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        routing = round_to(routing, act_ptr.dtype.element_ty, PRECISION).to(tl.float32)
        out_ptrs = out_ptr + rows[:, None] * stride_op + offs_n[None, :]
        tl.store(out_ptrs, acc * routing[:, None], mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _sum_chunks_kernel(partial_ptr, out_ptr, H, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    """out[t, h] = sum over c < CHUNKS, in order, of partial[t * CHUNKS + c, h] (fp32), rounded once."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    token, pid_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = pid_h * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for chunk in range(CHUNKS):
        acc += tl.load(partial_ptr + (token * CHUNKS + chunk) * H + offs, mask=mask, other=0.0)
    tl.store(out_ptr + token * H + offs, round_to(acc, out_ptr.dtype.element_ty, PRECISION), mask=mask)


def align_pairs_to_blocks(expert_of_pair: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the pairs by expert into blocks of block_m rows (vLLM's moe_align_block_size), in torch
    without a host sync. expert_of_pair [P] -> (pair_ids [B * block_m]: pair indices, each expert's run
    padded to whole blocks with P; block_expert [B]: the expert of each block, -1 past the last run).
    B is the bound P + min(E, P) * (block_m - 1) rows in blocks, so no count comes back to the host.
    Within an expert, pairs keep their order (token order)."""
    num_pairs = expert_of_pair.numel()
    device = expert_of_pair.device
    experts = expert_of_pair.to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = torch.sort(experts, stable=True).indices  # pairs grouped by expert
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[(run_ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(run_ends, block_starts, right=True)  # the run holding the block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


# Token counts at which packed (INT4/8) routed experts run the shared expert apart (`SharedArgs.separately`);
# at the others it joins their decode launches. Measured on an H200 (bench/moe_decode_kernel.py --shared,
# session 8, INT4 experts + INT6 shared expert, fused vs apart in one run): fused 1.41x / 1.26x faster at
# 1 token (g128 / g32), 0.70x / 0.63x at 4, 1.66x / 1.64x at 16.
PACKED_SHARED_APART_TOKENS = range(2, 16)


def fuses_shared_expert(topk_ids: torch.Tensor) -> bool:
    """Whether `fused_moe`'s decode form runs these ids (the only form that can take a shared expert
    into its launches): callers check it before building a shared expert's kernel view they would not
    need (`fused_moe` itself decides whether to fuse it or run it apart)."""
    return topk_ids.numel() <= DECODE_MAX_PAIRS


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, format: str = "unquantized", scales=None, group_size: int | None = None,
              shared: SharedExpert | None = None) -> torch.Tensor:
    """As `naive.fused_moe` (see there for shapes and formats). topk_ids must lie in [0, E): they are not
    checked here (that would cost a host sync). A shared expert is one more pair per token in the decode
    form's launches (packed routed experts: outside PACKED_SHARED_APART_TOKENS); otherwise, and in
    the prefill form, it runs beside them (`quant_linear` launches)."""
    bits, inter, group = check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids, format, scales, group_size)
    check_whole_word_groups(bits, group)
    shared_expert = SharedArgs.of(x, shared)
    t, top_k = x.shape[0], topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    gate_up_scales, down_scales = (w_gate_up, w_down) if bits is None else (s.contiguous() for s in scales)
    weights = (w_gate_up, gate_up_scales, w_down, down_scales)
    if num_pairs <= DECODE_MAX_PAIRS:
        packed = bits in (4, 8)
        fused = SharedArgs.of(x, None) if packed and t in PACKED_SHARED_APART_TOKENS else shared_expert
        routed = _decode(x, weights, topk_weights.contiguous(), topk_ids.contiguous(), bits or 0, group, inter,
                         fused)
        return routed if shared is None or fused.present else routed + shared_expert.separately(x)
    routed = _grouped(x, weights, topk_weights, topk_ids, bits or 0, group, inter)
    return routed if shared is None else routed + shared_expert.separately(x)


class DecodeLaunch(NamedTuple):
    """The unquantized / INT6 decode form's launch shape for one call shape (`_decode_launch`)."""
    splits: int  # down's items per (column block, token): the shared expert's, then the routed ranks'
    num_shared: int  # rows of gate_up's items that are the tokens' shared expert (T with one, else 0)
    gate_up_blocks: int
    down_blocks: int
    gate_up: tuple[int, int]  # (programs, warps)
    down: tuple[int, int]
    constants: Mapping  # the kernel's compile-time constants (read-only: shared by every call of the shape)


@functools.cache
def _decode_launch(t: int, h: int, inter: int, top_k: int, bits: int, group: int, tiles: DecodeTiles,
                   shared: SharedShape, precision: str, early: bool) -> DecodeLaunch:
    """The decode form's launch for T tokens of top-k over experts [H -> I] in `bits` (0 or 6), worked
    out once per shape (eager decode calls this every layer of every step); early: `early_weights`'
    (down's first EARLY_DOWN_TILES tiles, at most I's, loaded before its wait)."""
    gate_up_k = min(tiles.gate_up_block_k, triton.next_power_of_2(h))
    down_k = min(tiles.down_block_k, triton.next_power_of_2(inter))
    ranks = min(tiles.down_ranks, top_k)
    splits = shared.present + triton.cdiv(top_k, ranks)
    num_shared = t * shared.present
    gate_up_blocks = triton.cdiv(max(inter, shared.width), tiles.gate_up_block_n)
    down_blocks = triton.cdiv(h, tiles.down_block_n)
    constants = {
        "TOP_K": top_k, "SLOTS": triton.next_power_of_2(top_k), "RANKS": ranks, "BITS": bits, "GROUP_SIZE": group,
        "GU_BLOCK_N": tiles.gate_up_block_n, "GU_BLOCK_K": gate_up_k, "GU_EVEN_K": h % gate_up_k == 0,
        "DN_BLOCK_N": tiles.down_block_n, "DN_BLOCK_K": down_k, "DN_EVEN_K": inter % down_k == 0,
        "PRECISION": precision, "EARLY_TILES": min(EARLY_DOWN_TILES, triton.cdiv(inter, down_k)) if early else 0,
        **shared.constants(tiles.shared_gate_up_block_k, tiles.shared_down_block_k, h)}
    return DecodeLaunch(splits, num_shared, gate_up_blocks, down_blocks,
                        ((num_shared + t * top_k) * gate_up_blocks, tiles.gate_up_warps),
                        (down_blocks * t * splits, tiles.down_warps), MappingProxyType(constants))


def _decode(x, weights, topk_weights, topk_ids, bits: int, group: int, inter: int, shared: SharedArgs
            ) -> torch.Tensor:
    """The GEMV form: two launches, no sort; packed 4/8-bit experts: `packed_decode`."""
    tiles = DECODE_TILES[bits]
    max_tokens = DECODE_MAX_PAIRS // topk_ids.shape[1]
    if bits in (4, 8):
        variant = packed_variant(bits, group, PACKED_V2_TILES)
        return packed_decode(x, weights, topk_weights, topk_ids, bits, group, inter,
                             PACKED_V2_TILES if variant == "v2" else tiles, max_tokens, shared, variant)
    w_gate_up, gate_up_scales, w_down, down_scales = weights
    (t, h), top_k = x.shape, topk_ids.shape[1]
    launch = _decode_launch(t, h, inter, top_k, bits, group, tiles, shared.shape, dot_precision(x), early_weights())
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    shared_act = torch.empty((t, shared.width), dtype=x.dtype, device=x.device) if shared.present else act
    out = torch.empty_like(x)
    partial = torch.empty((t * launch.splits, h), dtype=torch.float32, device=x.device) if launch.splits > 1 else out
    counters = arrival_counters("fused_moe_down", x.device, max(t, max_tokens) * launch.down_blocks)
    args = (x, w_gate_up, gate_up_scales, act, topk_ids, shared.w_gate_up, shared.gate_up_scales, shared_act, w_down,
            down_scales, topk_weights, shared.w_down, shared.down_scales, shared.gate, out, partial, counters, t, h,
            inter, shared.width, launch.num_shared, launch.gate_up_blocks, launch.down_blocks, x.stride(0),
            w_gate_up.stride(0), w_gate_up.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
            act.stride(0), shared.w_gate_up.stride(0), shared.gate_up_scales.stride(0), shared_act.stride(0),
            w_down.stride(0), w_down.stride(1), down_scales.stride(0), down_scales.stride(1), shared.w_down.stride(0),
            shared.down_scales.stride(0))
    for phase, (programs, warps) in (("gate_up", launch.gate_up), ("down", launch.down)):
        _decode_gemv_kernel[(programs,)](*args, PHASE=phase, num_warps=warps, **launch.constants,
                                         **launch_options(x.device))
    return out


def _sum_chunks(partial: torch.Tensor, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """[T * chunks, H] fp32 -> [T, H] in x's dtype, each token's chunks added in order."""
    t, h = x.shape
    out = torch.empty_like(x)
    _sum_chunks_kernel[(t, triton.cdiv(h, SUM_BLOCK))](partial, out, h, CHUNKS=chunks, BLOCK=SUM_BLOCK,
                                                       PRECISION=dot_precision(x), **launch_options(x.device))
    return out


def _grouped(x, weights, topk_weights, topk_ids, bits: int, group: int, inter: int) -> torch.Tensor:
    """The grouped-GEMM form: pairs sorted by expert into blocks, tl.dot tiles, per-pair fp32 outputs
    summed by `_sum_chunks_kernel` in ascending expert id."""
    w_gate_up, gate_up_scales, w_down, down_scales = weights
    (t, h), top_k = x.shape, topk_ids.shape[1]
    num_pairs = t * top_k
    topk_ids, order = topk_ids.sort(dim=1)  # each token's experts in ascending id: the sum's order
    routing = topk_weights.gather(1, order).flatten()
    block_m = PREFILL_BLOCK_M
    pair_ids, block_expert = align_pairs_to_blocks(topk_ids.flatten(), w_gate_up.shape[0], block_m)
    num_blocks = block_expert.numel()
    gate_up_k, down_k = (min(PREFILL_BLOCK_K, max(16, triton.next_power_of_2(k))) for k in (h, inter))
    common = {"BITS": bits, "GROUP_SIZE": group, "BLOCK_M": block_m, "BLOCK_N": PREFILL_BLOCK_N,
              "PRECISION": dot_precision(x), "num_warps": PREFILL_NUM_WARPS}
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, PREFILL_BLOCK_N))](
        x, w_gate_up, gate_up_scales, act, pair_ids, block_expert, num_pairs, h, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        act.stride(0), TOP_K=top_k, BLOCK_K=gate_up_k, EVEN_K=h % gate_up_k == 0, **common, **launch_options(x.device),
    )
    pair_out = torch.empty((num_pairs, h), dtype=torch.float32, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(h, PREFILL_BLOCK_N))](
        act, w_down, down_scales, routing, pair_out, pair_ids, block_expert, num_pairs, h, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), down_scales.stride(0), down_scales.stride(1),
        pair_out.stride(0), BLOCK_K=down_k, EVEN_K=inter % down_k == 0, **common, **launch_options(x.device),
    )
    return _sum_chunks(pair_out, x, top_k)
