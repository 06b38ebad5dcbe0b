"""The decode form of `fused_moe` (a few tokens) for experts packed in 4 or 8 bits (`quant_linear.packing`):
two GEMV launches that read the selected experts' words in place, built so that INT4 weights can stream
at memory speed rather than at the speed of their unpacking. What it is built on (checked in the sm_90
SASS that triton 3.9 compiles; timed on a GPU by bench/moe_decode_kernel.py --packed-sweep):
  - x is read in its *split* layout, x_split[t, j, w] = x[t, w * values_per_word + j] in fp32 (one copy
    launch for the tokens; the down launch reads `act`, which gate_up writes split already). Value j of
    every word of a tile then meets x_split[t, j, words] loaded as one [BLOCK_W] vector, which Triton
    loads straight into the layout the words are in: no shared memory, no barrier, no layout conversion
    in the loop (the older packed GEMV split x in registers, through shared memory, 8 barriers a tile).
    split_x=False reads x as it is, each value gathered (more load instructions, one launch fewer);
  - the words are a [rows, BLOCK_W] tile, 16-byte loads (4 consecutive words per thread), each tile
    loaded while the one before is computed, or (unroll) every tile's loads issued up front;
  - a value costs 3 instructions: its field masked into a float's mantissa, the bias subtracted (both in
    `quant_linear.triton.word_value`), one FMA with x; a word's sum is then scaled once (so the weights
    are q * scale exactly, not rounded to x's dtype first as `naive` does: as the older packed GEMV);
    with loads and addresses about 3.9 a value at gate_up 8 x 64 words (the older form: 5.6);
  - the down launch folds each expert's routing weight into its scales, so one reduction over threads
    ends a program, not one per expert.
Launches: (split copy), `_packed_gate_up_kernel` over (pair, block of I), `_packed_down_kernel` over
(block of H, token, group of `down_ranks` experts); with fewer than top-k experts per down program the
last program to finish a token's columns adds the groups' fp32 partials in the same launch (arrival
counters: `kernels/split_reduce`, `decode_parts.finish_down`). A shared expert is one more row of
gate_up per token (x read in place) and one more split of down, in its own format (INT6 in int4-mixed)
through `decode_parts`' `gemv_loop` helpers, with its own K tiles. gate_up and down are phases of one
kernel (`_packed_decode_kernel`). Tiles: `PackedDecodeTiles`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tierlm.kernels.fused_moe.decode_parts import (
    SharedArgs,
    down_columns,
    expert_ranks,
    finish_down,
    swiglu_columns,
)
from tierlm.kernels.quant_linear.triton import FLOAT_ONE_BITS, dot_precision, round_to, word_value
from tierlm.kernels.split_reduce import arrival_counters


class PackedDecodeTiles(NamedTuple):
    """The packed decode form's launch shape (module constant in `fused_moe.triton.DECODE_TILES`)."""
    gate_up_block_n: int  # of the expert's I columns per gate_up program (gate and up rows each)
    gate_up_block_w: int  # packed words of K per step (x 32 / bits input columns)
    gate_up_warps: int
    down_block_n: int  # of the H output columns per down program
    down_block_w: int
    down_warps: int
    down_ranks: int  # of a token's top-k experts per down program (fewer: fp32 partials, summed by the last)
    split_x: bool  # x read split (one copy launch first) or gathered in place
    unroll: bool  # each program's K tiles unrolled (all loads issued up front, as registers allow) or a loop
    # the shared expert's K tiles, in values (its format may differ from the routed experts':
    # `decode_parts`; it takes their BLOCK_N). INT6 beside INT4 at 8 x 64 and 32 x 32 adds no registers
    # to the routed programs (80 and 48 for sm_90, triton 3.9: 96 at 128 for gate_up, 128 at 64 for down)
    shared_gate_up_block_k: int = 64
    shared_down_block_k: int = 32


@triton.jit
def _round_as(x, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 x rounded to x's dtype ("bf16", "fp16" or "fp32"; the split copies hold fp32), kept in fp32."""
    if DTYPE == "bf16":
        x = round_to(x, tl.bfloat16, PRECISION).to(tl.float32)
    elif DTYPE == "fp16":
        x = round_to(x, tl.float16, PRECISION).to(tl.float32)
    return x


@triton.jit
def _x_values(x_ptr, row, offs_w, WORDS: tl.constexpr, j: tl.constexpr, VALUES: tl.constexpr,
              SPLIT: tl.constexpr, EVEN_W: tl.constexpr):
    """x's values at position j of words offs_w ([BLOCK_W]) of one row (int64 offset `row`), as fp32:
    from the split layout (plane j: contiguous) or gathered from x itself; 0 past the row's words."""
    if SPLIT:
        ptrs = x_ptr + row + j * WORDS + offs_w
    else:
        ptrs = x_ptr + row + offs_w * VALUES + j
    if EVEN_W:
        values = tl.load(ptrs)
    else:
        values = tl.load(ptrs, mask=offs_w < WORDS, other=0.0)
    return values.to(tl.float32)


@triton.jit
def _tile_dot(words, x_ptr, row, offs_w, one_bits, WORDS: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr,
              EVEN_W: tl.constexpr):
    """For each word of the tile ([rows, BLOCK_W] uint32, at words offs_w), the sum over its values of
    value j (bias removed) times x's column of it: [rows, BLOCK_W] fp32, not yet scaled."""
    VALUES: tl.constexpr = 32 // BITS
    high = words >> 16
    x_0 = _x_values(x_ptr, row, offs_w, WORDS, 0, VALUES, SPLIT, EVEN_W)
    per_word = word_value(words, high, 0, BITS, one_bits) * x_0[None, :]
    for j in tl.static_range(1, VALUES):
        x_j = _x_values(x_ptr, row, offs_w, WORDS, j, VALUES, SPLIT, EVEN_W)
        per_word += word_value(words, high, j, BITS, one_bits) * x_j[None, :]
    return per_word


@triton.jit
def _load_tile(w_ptr, s_ptr, rows, w0, WORDS: tl.constexpr, stride_wn, stride_sn, BITS: tl.constexpr,
               GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_W: tl.constexpr):
    """(words [R, BLOCK_W] as uint32, each word's group scale [R, BLOCK_W] in fp32) of weight rows `rows`
    ([R, 1] int64, in range) at words [w0, w0 + BLOCK_W) (w0 a multiple of BLOCK_W); 0 past the row."""
    offs_w = tl.max_contiguous(tl.multiple_of(w0 + tl.arange(0, BLOCK_W), BLOCK_W), BLOCK_W)
    group = offs_w // (GROUP_SIZE // (32 // BITS))  # groups hold whole words
    if EVEN_W:
        words = tl.load(w_ptr + rows * stride_wn + offs_w[None, :])
        scale = tl.load(s_ptr + rows * stride_sn + group[None, :])
    else:
        inside = (offs_w < WORDS)[None, :]
        words = tl.load(w_ptr + rows * stride_wn + offs_w[None, :], mask=inside, other=0)
        scale = tl.load(s_ptr + rows * stride_sn + group[None, :], mask=inside, other=0.0)
    return words.to(tl.uint32, bitcast=True), scale.to(tl.float32)


@triton.jit
def _rows_dot(acc, w_ptr, s_ptr, rows, x_ptr, x_row, stride_wn, stride_sn, one_bits, WORDS: tl.constexpr,
              BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_X: tl.constexpr,
              UNROLL: tl.constexpr, SCALE_BY):
    """acc [R, BLOCK_W] + per word, over all of the rows' WORDS words, x's row (at x_ptr + x_row) times the
    weight rows `rows` ([R, 1] int64, in range), each word's sum times its group scale times SCALE_BY.
    UNROLL: the tiles unrolled (the compiler issues every tile's loads before the first is computed, as
    registers allow: the most bytes in flight); else a loop, each tile loaded one tile ahead (the last
    one twice)."""
    EVEN_W: tl.constexpr = WORDS % BLOCK_W == 0
    if UNROLL:
        for w0 in tl.static_range(0, WORDS, BLOCK_W):
            words, scale = _load_tile(w_ptr, s_ptr, rows, w0, WORDS, stride_wn, stride_sn, BITS, GROUP_SIZE, BLOCK_W,
                                      EVEN_W)
            offs_w = w0 + tl.arange(0, BLOCK_W)
            acc += _tile_dot(words, x_ptr, x_row, offs_w, one_bits, WORDS, BITS, SPLIT_X, EVEN_W) * (scale * SCALE_BY)
    else:
        LAST: tl.constexpr = (WORDS - 1) // BLOCK_W * BLOCK_W
        words, scale = _load_tile(w_ptr, s_ptr, rows, 0, WORDS, stride_wn, stride_sn, BITS, GROUP_SIZE, BLOCK_W,
                                  EVEN_W)
        for w0 in range(0, WORDS, BLOCK_W):
            next_words, next_scale = _load_tile(w_ptr, s_ptr, rows, tl.minimum(w0 + BLOCK_W, LAST), WORDS, stride_wn,
                                                stride_sn, BITS, GROUP_SIZE, BLOCK_W, EVEN_W)
            offs_w = w0 + tl.arange(0, BLOCK_W)
            acc += _tile_dot(words, x_ptr, x_row, offs_w, one_bits, WORDS, BITS, SPLIT_X, EVEN_W) * (scale * SCALE_BY)
            words, scale = next_words, next_scale
    return acc


@triton.jit
def _packed_gate_up_program(
    row, pid_n, x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr, x_in_place_ptr, shared_w_ptr, shared_s_ptr, shared_act_ptr, S,
    num_shared, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ap, stride_x_in_place, stride_swn,
    stride_ssn, stride_sap, one_bits,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_X: tl.constexpr, UNROLL: tl.constexpr, DTYPE: tl.constexpr,
    HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr, SHARED_GROUP_SIZE: tl.constexpr,
    SHARED_BLOCK_K: tl.constexpr, SHARED_EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """gate_up's work item (row, pid_n): columns [pid_n * BLOCK_N, +BLOCK_N) of row `row`. Rows below
    num_shared (T with a shared expert, else 0) are the tokens' shared expert, in its own format
    (`decode_parts.swiglu_columns` on x in place): shared_act[token, n] = silu(gate) * up of its S columns,
    in x's dtype. The others are pairs (pair = row - num_shared: token pair // TOP_K, expert ids[pair]),
    the gate rows and the up rows as one tile of 2 * BLOCK_N rows: act[pair] = silu(gate) * up rounded to
    x's dtype (DTYPE), stored split in fp32 (column n at [n % values per word, n // values per word])."""
    VALUES: tl.constexpr = 32 // BITS
    pair = row - num_shared
    if pair >= 0:
        if pid_n * BLOCK_N < I:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            both = tl.arange(0, 2 * BLOCK_N)
            n = pid_n * BLOCK_N + both % BLOCK_N
            rows = tl.where(n < I, tl.where(both < BLOCK_N, n, I + n), 0)[:, None].to(tl.int64)  # clamped
            acc = _rows_dot(tl.zeros((2 * BLOCK_N, BLOCK_W), dtype=tl.float32), w_ptr + expert * stride_we,
                            s_ptr + expert * stride_se, rows, x_ptr, (pair // TOP_K).to(tl.int64) * stride_xt,
                            stride_wn, stride_sn, one_bits, H // VALUES, BITS, GROUP_SIZE, BLOCK_W, SPLIT_X, UNROLL,
                            1.0)
            sums = tl.sum(acc, axis=1)  # [2 * BLOCK_N]
            gate, up = tl.split(tl.trans(tl.reshape(sums, (2, BLOCK_N))))
            act = _round_as(gate / (1.0 + tl.exp(-gate)) * up, DTYPE, PRECISION)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(act_ptr + pair.to(tl.int64) * stride_ap + (offs_n % VALUES) * (I // VALUES) + offs_n // VALUES,
                     act, mask=offs_n < I)
    else:
        if HAS_SHARED:  # noqa: SIM102 - a constexpr: without a shared expert its branch is not compiled
            if pid_n * BLOCK_N < S:
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                act = swiglu_columns(x_in_place_ptr, row.to(tl.int64) * stride_x_in_place, shared_w_ptr,
                                     shared_s_ptr, S, offs_n, stride_swn, stride_ssn, H, SHARED_BITS,
                                     SHARED_GROUP_SIZE, BLOCK_N, SHARED_BLOCK_K, SHARED_EVEN_K, PRECISION)
                tl.store(shared_act_ptr + row.to(tl.int64) * stride_sap + offs_n[None, :],
                         round_to(act, shared_act_ptr.dtype.element_ty, PRECISION), mask=(offs_n < S)[None, :])


@triton.jit
def _packed_down_program(
    pid_n, token, split, n_blocks, act_ptr, w_ptr, s_ptr, routing_ptr, ids_ptr, shared_act_ptr, shared_w_ptr,
    shared_s_ptr, shared_gate_ptr, out_ptr, partial_ptr, counter_ptr, S, stride_ap, stride_we, stride_wn, stride_se,
    stride_sn, stride_sap, stride_swn, stride_ssn, one_bits,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, RANKS: tl.constexpr,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    UNROLL: tl.constexpr, DTYPE: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr,
    SHARED_GROUP_SIZE: tl.constexpr, SHARED_BLOCK_K: tl.constexpr, SHARED_EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """down's work item (pid_n, token, split) of n_blocks column blocks: columns [pid_n * BLOCK_N,
    +BLOCK_N) of H for token `token` (int64). With a shared expert split 0 is it: gate x
    (shared_act[token] W_shared_down[h]) in its own format (`decode_parts.down_columns`). The other
    splits (all of them without one) take the token's experts of ranks [routed split * RANKS, +RANKS)
    (those below TOP_K) in ascending id (SLOTS: TOP_K rounded up to a power of 2): the sum over those
    experts of routing x (act[pair] W_down[e, h]) in fp32 (each expert's routing weight, rounded to x's
    dtype, folded into its scales). The splits' results end in `decode_parts.finish_down`: out[token]
    rounded once, by the item itself (one split) or by the token's last item to arrive for these
    columns."""
    VALUES: tl.constexpr = 32 // BITS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    result = tl.zeros((BLOCK_N,), dtype=tl.float32)
    routed_split = split - HAS_SHARED
    if routed_split >= 0:
        slots, valid, rank = expert_ranks(ids_ptr, token, TOP_K, SLOTS)
        rows = tl.where(n_mask, offs_n, 0)[:, None].to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
        for r in tl.static_range(RANKS):
            if routed_split * RANKS + r < TOP_K:
                slot = tl.sum(tl.where(valid & (rank == routed_split * RANKS + r), slots, 0), axis=0)
                pair = token * TOP_K + slot
                expert = tl.load(ids_ptr + pair).to(tl.int64)
                routing = _round_as(tl.load(routing_ptr + pair).to(tl.float32), DTYPE, PRECISION)
                acc = _rows_dot(acc, w_ptr + expert * stride_we, s_ptr + expert * stride_se, rows, act_ptr,
                                pair * stride_ap, stride_wn, stride_sn, one_bits, I // VALUES, BITS, GROUP_SIZE,
                                BLOCK_W, True, UNROLL, routing)
        result += tl.sum(acc, axis=1)
    else:
        if HAS_SHARED:
            gate = _round_as(tl.load(shared_gate_ptr + token).to(tl.float32), DTYPE, PRECISION)
            result += gate * down_columns(shared_act_ptr, token * stride_sap, shared_w_ptr, shared_s_ptr, offs_n,
                                          n_mask, stride_swn, stride_ssn, S, SHARED_BITS, SHARED_GROUP_SIZE, BLOCK_N,
                                          SHARED_BLOCK_K, SHARED_EVEN_K, PRECISION)
    finish_down(result, out_ptr, partial_ptr, counter_ptr, token, pid_n, n_blocks, split, offs_n, n_mask, H,
                HAS_SHARED + (TOP_K + RANKS - 1) // RANKS, PRECISION)


@triton.jit
def _packed_decode_kernel(
    x_ptr, gu_w_ptr, gu_s_ptr, act_ptr, ids_ptr, x_in_place_ptr, gu_shared_w_ptr, gu_shared_s_ptr, shared_act_ptr,
    dn_w_ptr, dn_s_ptr, routing_ptr, dn_shared_w_ptr, dn_shared_s_ptr, shared_gate_ptr, out_ptr, partial_ptr,
    counter_ptr, T, S, num_shared, gate_up_blocks, down_blocks,
    stride_xt, gu_stride_we, gu_stride_wn, gu_stride_se, gu_stride_sn, stride_ap, stride_x_in_place, gu_stride_swn,
    gu_stride_ssn, stride_sap, dn_stride_we, dn_stride_wn, dn_stride_se, dn_stride_sn, dn_stride_swn, dn_stride_ssn,
    one_bits,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, RANKS: tl.constexpr,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, GU_BLOCK_N: tl.constexpr, GU_BLOCK_W: tl.constexpr,
    DN_BLOCK_N: tl.constexpr, DN_BLOCK_W: tl.constexpr, SPLIT_X: tl.constexpr, UNROLL: tl.constexpr,
    DTYPE: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_BITS: tl.constexpr, GU_SHARED_GROUP_SIZE: tl.constexpr,
    GU_SHARED_BLOCK_K: tl.constexpr, GU_SHARED_EVEN_K: tl.constexpr, DN_SHARED_GROUP_SIZE: tl.constexpr,
    DN_SHARED_BLOCK_K: tl.constexpr, DN_SHARED_EVEN_K: tl.constexpr, PHASE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """PHASE "gate_up": program i is gate_up's item (row i % rows, block i // rows; rows: num_shared + T *
    TOP_K); "down": down's item (block i % down_blocks, token (i // down_blocks) % T, split
    i // (down_blocks * T)) (a constexpr: each phase compiles only its own items' code)."""
    index = tl.program_id(0)
    if PHASE == "gate_up":
        rows = num_shared + T * TOP_K
        _packed_gate_up_program(
            index % rows, index // rows, x_ptr, gu_w_ptr, gu_s_ptr, act_ptr, ids_ptr, x_in_place_ptr, gu_shared_w_ptr,
            gu_shared_s_ptr, shared_act_ptr, S, num_shared, stride_xt, gu_stride_we, gu_stride_wn, gu_stride_se,
            gu_stride_sn, stride_ap, stride_x_in_place, gu_stride_swn, gu_stride_ssn, stride_sap, one_bits, H, I,
            TOP_K, BITS, GROUP_SIZE, GU_BLOCK_N, GU_BLOCK_W, SPLIT_X, UNROLL, DTYPE, HAS_SHARED, SHARED_BITS,
            GU_SHARED_GROUP_SIZE, GU_SHARED_BLOCK_K, GU_SHARED_EVEN_K, PRECISION)
    else:
        _packed_down_program(
            index % down_blocks, ((index // down_blocks) % T).to(tl.int64), index // (down_blocks * T), down_blocks,
            act_ptr, dn_w_ptr, dn_s_ptr, routing_ptr, ids_ptr, shared_act_ptr, dn_shared_w_ptr, dn_shared_s_ptr,
            shared_gate_ptr, out_ptr, partial_ptr, counter_ptr, S, stride_ap, dn_stride_we, dn_stride_wn,
            dn_stride_se, dn_stride_sn, stride_sap, dn_stride_swn, dn_stride_ssn, one_bits, H, I, TOP_K, SLOTS, RANKS,
            BITS, GROUP_SIZE, DN_BLOCK_N, DN_BLOCK_W, UNROLL, DTYPE, HAS_SHARED, SHARED_BITS, DN_SHARED_GROUP_SIZE,
            DN_SHARED_BLOCK_K, DN_SHARED_EVEN_K, PRECISION)


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def packed_decode(x: torch.Tensor, weights: tuple, topk_weights: torch.Tensor, topk_ids: torch.Tensor, bits: int,
                  group: int, inter: int, tiles: PackedDecodeTiles, max_tokens: int, shared: SharedArgs
                  ) -> torch.Tensor:
    """The two launches (plus the split copy with `split_x`) for x [T, H]
    (contiguous); weights (w_gate_up, gate_up_scales, w_down, down_scales) packed in `bits` (4 or 8),
    contiguous; `shared`: the shared expert (or its absence), one more row of gate_up and one more split
    of down per token. Returns [T, H] in x's dtype. max_tokens: the most tokens a call can bring (the arrival counters are made for that
    many once, so a captured graph never sees them remade)."""
    w_gate_up, gate_up_scales, w_down, down_scales = weights
    (t, h), top_k = x.shape, topk_ids.shape[1]
    values = 32 // bits
    precision, dtype = dot_precision(x), DTYPE_NAMES[x.dtype]
    ranks = min(tiles.down_ranks, top_k)
    splits = shared.present + triton.cdiv(top_k, ranks)
    # one fp32 workspace: x split (when asked), act split, the down partials (when several splits)
    x_numel = t * h if tiles.split_x else 0
    act_numel = t * top_k * inter
    partial_numel = t * splits * h if splits > 1 else 0
    workspace = torch.empty(x_numel + act_numel + partial_numel, dtype=torch.float32, device=x.device)
    if tiles.split_x:
        x_in = workspace[:x_numel].view(t, values, h // values)
        x_in.copy_(x.view(t, h // values, values).transpose(1, 2))
    else:
        x_in = x
    act = workspace[x_numel:x_numel + act_numel].view(t * top_k, inter)
    shared_act = torch.empty((t, shared.width), dtype=x.dtype, device=x.device) if shared.present else x
    shared_gate_up_k, shared_gate_up_even, shared_down_k, shared_down_even = shared.k_tiles(
        tiles.shared_gate_up_block_k, tiles.shared_down_block_k, h)
    out = torch.empty_like(x)
    num_shared = t * shared.present  # rows of gate_up's items that are the tokens' shared expert
    gate_up_blocks = triton.cdiv(max(inter, shared.width), tiles.gate_up_block_n)
    down_blocks = triton.cdiv(h, tiles.down_block_n)
    counters = arrival_counters("fused_moe_packed_down", x.device, max(t, max_tokens) * down_blocks)
    partial = workspace[x_numel + act_numel:] if splits > 1 else out  # (unused with one split)
    args = (x_in, w_gate_up, gate_up_scales, act, topk_ids, x, shared.w_gate_up, shared.gate_up_scales, shared_act,
            w_down, down_scales, topk_weights, shared.w_down, shared.down_scales, shared.gate, out, partial, counters,
            t, shared.width, num_shared, gate_up_blocks, down_blocks, x_in.stride(0), w_gate_up.stride(0),
            w_gate_up.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1), act.stride(0), x.stride(0),
            shared.w_gate_up.stride(0), shared.gate_up_scales.stride(0), shared_act.stride(0), w_down.stride(0),
            w_down.stride(1), down_scales.stride(0), down_scales.stride(1), shared.w_down.stride(0),
            shared.down_scales.stride(0), FLOAT_ONE_BITS.value)
    constants = {
        "H": h, "I": inter, "TOP_K": top_k, "SLOTS": triton.next_power_of_2(top_k), "RANKS": ranks, "BITS": bits,
        "GROUP_SIZE": group, "GU_BLOCK_N": tiles.gate_up_block_n, "GU_BLOCK_W": tiles.gate_up_block_w,
        "DN_BLOCK_N": tiles.down_block_n, "DN_BLOCK_W": tiles.down_block_w, "SPLIT_X": tiles.split_x,
        "UNROLL": tiles.unroll, "DTYPE": dtype, "HAS_SHARED": shared.present, "SHARED_BITS": shared.bits,
        "GU_SHARED_GROUP_SIZE": shared.gate_up_group, "GU_SHARED_BLOCK_K": shared_gate_up_k,
        "GU_SHARED_EVEN_K": shared_gate_up_even, "DN_SHARED_GROUP_SIZE": shared.down_group,
        "DN_SHARED_BLOCK_K": shared_down_k, "DN_SHARED_EVEN_K": shared_down_even,
        "PRECISION": precision}
    gate_up_items = (num_shared + t * top_k) * gate_up_blocks
    down_items = down_blocks * t * splits
    _packed_decode_kernel[(gate_up_items,)](*args, PHASE="gate_up", num_warps=tiles.gate_up_warps, **constants)
    _packed_decode_kernel[(down_items,)](*args, PHASE="down", num_warps=tiles.down_warps, **constants)
    return out
