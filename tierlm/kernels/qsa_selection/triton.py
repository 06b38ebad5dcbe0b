"""QSA selection as one Triton launch (same signature as `naive.selection_rows`): top-k and rows together,
no sort. One program per query:
- a query that sees at most K blocks chooses all of them: blocks 0..K-1 (those past what it sees
  invalid), no score read;
- else a radix select finds the K-th highest score's bits T (passes of 8 bits over its seen scores, each
  a 256-bin histogram of the next 8 bits of the scores that match T so far, up to four: they stop once
  no tie is left to break);
  every block above T is chosen, and the blocks at T in index order until K are (ties to the lower
  block, as `naive.ranking_keys` orders them);
  a prefix sum over the chosen places each one's R tokens in block order;
then the open tail. Rows through the block table, invalid entries at the scratch row. No host sync.
Bit-identical to the reference (integer work on the scores' bits). Launched with programmatic dependent
launch (`kernels/dependent_launch`); nothing it reads is a constant, so a program waits first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.qsa_selection.naive import table_groups
from tierlm.kernels.qsa_selection.select_parts import (
    choose_all,
    digit_counts,
    pick_digit,
    score_bits,
    store_chosen,
    store_tail,
)
from tierlm.kernels.qsa_selection.split_triton import split_selection_rows

# scores per tile of the select and its warps: H200, `bench/qsa_decode_select.py --sweep` (session 11, passes of
# 4 bits counted against 16 candidate digits, a [16, BLOCK_G] comparison each: at 512 x 4 warps 33 us at an
# 8k-token context, 61 at 16k; 2048 x 8 with the passes' early stop: 13.3 us at 8k, 24 at 16k). Holding the
# whole row in registers instead (no reload a pass) measured 26-38 us at 8k: a row twice the seen scores wide
# (static decode's doubled tables) is twice the work. Session 14, passes of 8 bits (a histogram each),
# `bench/qsa_decode_select.py --baseline` against the 4-bit passes, fused path (scores + rows): 1.04-1.11x at
# 8k, 1.20-1.31x at 32k, 1.21-1.39x at 64k (bench/results/qsa_decode_select_nvidia-h200.txt); the rows
# kernel alone 11.5 us at 8k, where 2048 x 8 stays the best; 4096 x 8 leads by 1.08x at 32k and 64k
# (bench/results/qsa_decode_select_sweep_nvidia-h200.txt). Keeping the first tile's scores in registers
# across the passes (later tiles reloaded) measured 0.95-0.99x of this at 8k-64k (session 14; dropped)
BLOCK_G = 2048
SELECT_WARPS = 8
# wider score rows take `split_triton`'s select, each query's over many programs: on an H200 it leads from tables of
# 8,192 blocks (16k-token contexts: 1.02-1.23x), the one program up to 4,096 (8k: split 0.69-0.97x),
# bench/results/qsa_decode_select_nvidia-h200.txt
SPLIT_FROM_GROUPS = 4096


@triton.jit
def _choose_top(scores_row, rows_out, valid_out, tables_row, table_width, scratch_block, seen, num_top,
                RATIO: tl.constexpr, RATIO_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr):
    """The num_top highest of the seen scores (seen > num_top), their tokens' entries in block order. Each
    pass reads the row again, BLOCK_G scores a tile."""
    # radix select, 8 bits a pass from the top: T is the highest bits value with at least num_top scores at
    # or above it. A pass counts the scores whose bits above shift + 8 are T's by their next 8 bits (a
    # histogram); `above` counts those above T's bits so far, so the scores at or above T's bits plus
    # digit d number above + (the counts of digits >= d). The passes stop once exactly num_top scores have
    # bits >> shift at or above T >> shift (no tie left to break below: in random scores, after 16-24 of
    # the 32 bits); the choice then compares the bits above shift, which picks the same blocks as comparing
    # them all
    threshold = 0
    shift = 32
    exact = 0
    above = 0
    digits = tl.arange(0, 256)
    while (shift > 0) & (exact == 0):
        shift -= 8
        counts = tl.zeros([256], tl.int32)
        for start in range(0, seen, BLOCK_G):
            groups = start + tl.arange(0, BLOCK_G)
            inside = groups < seen
            counts += digit_counts(score_bits(scores_row, groups, inside), inside, threshold, shift, 8, 256)
        digit, above, exact = pick_digit(counts, digits, above, num_top)
        threshold += digit << shift
    key_threshold = threshold >> shift
    quota = num_top - above  # blocks at the threshold still to choose, lowest index first
    taken = 0
    ties = 0
    for start in range(0, seen, BLOCK_G):
        groups = start + tl.arange(0, BLOCK_G)
        inside = groups < seen
        ties, taken = store_chosen(score_bits(scores_row, groups, inside) >> shift, inside, groups, key_threshold,
                                   quota, ties, taken, rows_out, valid_out, tables_row, table_width, scratch_block,
                                   RATIO, RATIO_PAD, BLOCK_SIZE)


@triton.jit
def _selection_kernel(scores_ptr, positions_ptr, tables_ptr, rows_ptr, valid_ptr, num_groups, num_top, num_entries,
                      scores_stride, table_stride, table_width, scratch_block,
                      SCORES: tl.constexpr, RATIO: tl.constexpr, RATIO_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    query = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + query)
    visible = (position + 1) // RATIO
    seen = tl.minimum(visible, num_groups)
    rows_out, valid_out = rows_ptr + query * num_entries, valid_ptr + query * num_entries
    tables_row = tables_ptr + query * table_stride
    if SCORES:
        if seen > num_top:
            _choose_top(scores_ptr + query * scores_stride, rows_out, valid_out, tables_row, table_width,
                        scratch_block, seen, num_top, RATIO, RATIO_PAD, BLOCK_SIZE, BLOCK_G)
        else:
            choose_all(rows_out, valid_out, tables_row, table_width, scratch_block, seen, num_top, RATIO,
                       BLOCK_SIZE)
    else:
        choose_all(rows_out, valid_out, tables_row, table_width, scratch_block, seen, num_top, RATIO, BLOCK_SIZE)
    store_tail(rows_out, valid_out, tables_row, table_width, scratch_block, position, visible, num_top, RATIO,
               RATIO_PAD, BLOCK_SIZE)


def triton_selection_rows(
    scores: torch.Tensor | None, positions: torch.Tensor, tables: torch.Tensor, ratio: int, block_size: int,
    scratch_block: int, top: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `naive.selection_rows`: one launch, or `split_triton`'s for rows wider than SPLIT_FROM_GROUPS. Only
    the scores of queries that see more than K = min(top, G) blocks are read (`triton_block_scores(...,
    skip_up_to=top)` leaves the others out). Scores may cover fewer blocks than the tables hold (G their
    width: a prefill chunk's)."""
    m = positions.shape[0]
    groups = table_groups(scores, tables, ratio, block_size, top)
    if scores is not None:  # (a prefill's scores cover the blocks complete at its chunk's end, <= the table's)
        if scores.dim() != 2 or scores.shape[0] != m or scores.shape[1] > groups or scores.dtype != torch.float32 \
                or scores.stride(1) != 1:
            raise ValueError(f"scores must be fp32 [{m}, G <= {groups}] with a contiguous last dim, got "
                             f"{scores.dtype} {tuple(scores.shape)}")
        groups = scores.shape[1]
    k = min(top, groups)
    entries = k * ratio + ratio - 1
    rows = torch.empty(m, entries, dtype=torch.int64, device=positions.device)
    valid = torch.empty(m, entries, dtype=torch.int8, device=positions.device)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    if m and groups > SPLIT_FROM_GROUPS:
        split_selection_rows(scores, positions, tables, groups, k, ratio, block_size, scratch_block, rows, valid)
    elif m:
        _selection_kernel[(m,)](
            rows if scores is None else scores, positions.contiguous(), tables, rows, valid, groups, k, entries,
            0 if scores is None else scores.stride(0), tables.stride(0), tables.shape[1], scratch_block,
            SCORES=scores is not None, RATIO=ratio, RATIO_PAD=triton.next_power_of_2(ratio), BLOCK_SIZE=block_size,
            BLOCK_G=BLOCK_G, num_warps=SELECT_WARPS, **launch_options(positions.device),
        )
    return rows, valid.view(torch.bool)
