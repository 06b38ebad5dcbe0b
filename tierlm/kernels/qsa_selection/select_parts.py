"""The jit parts both Triton forms of QSA selection share (`triton`: one program a query; `split_triton`:
a query's select split over many programs): score bits, the chosen blocks' entries, the open tail."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_E = tl.constexpr(512)  # entries per tile of `choose_all`


@triton.jit
def rows_of(tokens, ok, tables_row, table_width, scratch_block, BLOCK_SIZE: tl.constexpr):
    """Pool rows of token positions through one query's block table; entries not ok: the scratch row."""
    block = tl.load(tables_row + tl.minimum(tokens // BLOCK_SIZE, table_width - 1), mask=ok, other=0)
    block = tl.where(block < 0, scratch_block, block)
    return tl.where(ok, block * BLOCK_SIZE + tokens % BLOCK_SIZE, scratch_block * BLOCK_SIZE)


@triton.jit
def choose_all(rows_out, valid_out, tables_row, table_width, scratch_block, seen, num_top,
               RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Entries of blocks 0..num_top-1: entry e is token e, valid when its block is seen."""
    for start in range(0, num_top * RATIO, BLOCK_E):
        entries = start + tl.arange(0, BLOCK_E)
        inside = entries < num_top * RATIO
        ok = inside & (entries // RATIO < seen)
        tl.store(rows_out + entries, rows_of(entries, ok, tables_row, table_width, scratch_block, BLOCK_SIZE),
                 mask=inside)
        tl.store(valid_out + entries, ok.to(tl.int8), mask=inside)


@triton.jit
def score_bits(scores_row, groups, inside):
    """A score's bits with the sign cleared (-0.0 ties with 0.0), as `naive.ranking_keys` takes them."""
    return tl.load(scores_row + groups, mask=inside, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def store_chosen(keys, inside, groups, threshold, quota, ties, taken, rows_out, valid_out, tables_row, table_width,
                 scratch_block, RATIO: tl.constexpr, RATIO_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Of these keys (in block order, after `taken` chosen and `ties` at the threshold seen): every one
    above the threshold, and those at it while the quota lasts; their tokens' entries stored at their
    place among the chosen. Returns (ties, taken) past them."""
    tie = (inside & (keys == threshold)).to(tl.int32)
    take = (inside & (keys > threshold)) | ((tie != 0) & (ties + tl.cumsum(tie, axis=0) <= quota))
    take_count = take.to(tl.int32)
    rank = taken + tl.cumsum(take_count, axis=0) - 1  # its place among the chosen, in block order
    in_block = tl.arange(0, RATIO_PAD)
    entries = rank[:, None] * RATIO + in_block[None, :]
    tokens = groups[:, None] * RATIO + in_block[None, :]
    ok = take[:, None] & (in_block < RATIO)[None, :]
    tl.store(rows_out + entries, rows_of(tokens, ok, tables_row, table_width, scratch_block, BLOCK_SIZE), mask=ok)
    tl.store(valid_out + entries, ok.to(tl.int8), mask=ok)
    return ties + tl.sum(tie, axis=0), taken + tl.sum(take_count, axis=0)


@triton.jit
def store_tail(rows_out, valid_out, tables_row, table_width, scratch_block, position, visible, num_top,
               RATIO: tl.constexpr, RATIO_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The open tail [visible * R, p]: R - 1 entries after the chosen blocks'."""
    in_tail = tl.arange(0, RATIO_PAD)
    tail = in_tail < RATIO - 1
    tokens = visible * RATIO + in_tail
    ok = tail & (tokens <= position)
    tl.store(rows_out + num_top * RATIO + in_tail,
             rows_of(tokens, ok, tables_row, table_width, scratch_block, BLOCK_SIZE), mask=tail)
    tl.store(valid_out + num_top * RATIO + in_tail, ok.to(tl.int8), mask=tail)


@triton.jit
def digit_counts(keys, inside, threshold, shift, WIDTH: tl.constexpr, BINS: tl.constexpr):
    """The BINS-bin histogram of the keys' bits [shift, shift + WIDTH) over the keys (masked by inside)
    whose bits above shift + WIDTH are the threshold's (a pass of the radix select)."""
    match = inside & ((keys >> shift) >> WIDTH == (threshold >> shift) >> WIDTH)
    return tl.histogram((keys >> shift) & ((1 << WIDTH) - 1), BINS, mask=match)


@triton.jit
def pick_digit(counts, digits, above, num_top):
    """A pass's choice from its histogram (`counts` by digit of the keys that match the threshold so far,
    `above` keys above those): the highest digit d with at least num_top keys at or above the threshold
    then d. Returns (d, the keys above the threshold then d, whether exactly num_top are at or above it)."""
    at_or_above = above + tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
    digit = tl.sum((at_or_above >= num_top).to(tl.int32), axis=0) - 1
    chosen = tl.sum(tl.where(digits == digit, at_or_above, 0), axis=0)
    above = chosen - tl.sum(tl.where(digits == digit, counts, 0), axis=0)
    return digit, above, (chosen == num_top).to(tl.int32)
