"""QSA selection with each query's select split over many programs (same result as `triton`'s one program
a query, bit for bit): for long contexts, where one program reading a query's whole score row pass after
pass is bound by its own latency. Scores and rows of one query at a 262,144-token context on an H200: one
program 337.5 us, torch's selection 185.0, this 32.4 (`bench/qsa_decode_select.py`,
bench/results/qsa_decode_select_nvidia-h200.txt; the split form leads from 16,384-token contexts).

A query's seen scores are cut into chunks of CHUNK; every launch runs a program per (query, chunk):
  1. `_digits_kernel`, once per pass of the radix select (DIGIT_BITS bits a pass from the top, so
     cdiv(31, DIGIT_BITS) passes over the sign-cleared bits): each program counts its chunk's matching
     keys by their next digit (`select_parts.digit_counts`) and adds its histogram to the query's in
     global memory (integer atomics: the same counts whatever the order); the last program of the query
     to arrive (`split_reduce.arrival_counters`) picks the digit (`select_parts.pick_digit`), stores the
     query's threshold, the count above it, whether it is exact and its shift, and sets the histogram
     back to zero. A query that is exact already skips the later passes (its programs return at once).
  2. `_count_kernel`: each chunk's keys above the final threshold and at it.
  3. `_write_kernel`: each chunk's chosen blocks (`select_parts.store_chosen`), placed after the chosen
     and tied blocks of the chunks before it (a prefix over their counts; ties to the lower block, as the
     reference orders them); chunk 0 also writes a query's open tail, and the entries of a query that
     sees at most K blocks (`select_parts.choose_all`).
The histograms and arrival counters are zeroed buffers the kernels leave at zero (made once, outside any
CUDA graph capture); the state and counts are scratch tensors of the call. No host sync. Launched with
programmatic dependent launch; every program waits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.qsa_selection.select_parts import (
    choose_all,
    digit_counts,
    pick_digit,
    score_bits,
    store_chosen,
    store_tail,
)
from tierlm.kernels.split_reduce import arrival_counters

KEY_BITS = 31  # a ranking key's bits: the score's with the sign cleared
# tiles: `bench/qsa_decode_select.py --sweep-split` on an H200 (bench/results/qsa_decode_select_sweep_split_nvidia-h200.txt,
# the rows kernels alone over 8 and 11 bits, 4 and 8 warps, chunks of 512-4096): 512 x 8 bits x 4 warps the fastest at
# 8k-131k contexts and batches 1-4 (10.9 us at 8k, 16.4 at 131k, one query); 1024 x 8 warps at 262k (23.5 us)
CHUNK = 512  # scores per program
DIGIT_BITS = 8  # bits a pass: 2^DIGIT_BITS bins a histogram
SPLIT_WARPS = 4
STATE = tl.constexpr(4)  # per query: threshold, keys above it, exact, shift


def passes(digit_bits: int) -> int:
    """The radix select's passes (launches of `_digits_kernel`) at digit_bits a pass."""
    return triton.cdiv(KEY_BITS, digit_bits)


def pass_digit(step: int, digit_bits: int) -> tuple[int, int]:
    """(shift, width): pass `step` resolves bits [shift, shift + width) of the key, the highest left."""
    shift = max(KEY_BITS - (step + 1) * digit_bits, 0)
    return shift, KEY_BITS - step * digit_bits - shift


@triton.jit
def _program(positions_ptr, num_groups, RATIO: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Every kernel's start (PDL's wait first): (query, chunk, the query's position, the blocks it sees,
    the chunks they fill)."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    query = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + query)
    seen = tl.minimum((position + 1) // RATIO, num_groups)
    return query, tl.program_id(1), position, seen, tl.cdiv(seen, CHUNK)


@triton.jit
def _digits_kernel(scores_ptr, positions_ptr, state_ptr, histograms_ptr, counters_ptr, num_groups, num_top,
                   scores_stride, PASS: tl.constexpr, PASSES: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
                   BINS: tl.constexpr, RATIO: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Pass PASS of the radix select: the digit of bits [SHIFT, SHIFT + WIDTH) (`pass_digit`)."""
    query, chunk, _, seen, chunks = _program(positions_ptr, num_groups, RATIO, CHUNK, PDL)
    state = state_ptr + query * STATE
    runs = (seen > num_top) & (chunk < chunks)
    threshold, above = 0, 0
    if PASS > 0:
        threshold, above = tl.load(state), tl.load(state + 1)
        runs = runs & (tl.load(state + 2) == 0)  # not exact yet
    if runs:
        groups = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = groups < seen
        keys = score_bits(scores_ptr + query * scores_stride, groups, inside)
        counts = digit_counts(keys, inside, threshold, SHIFT, WIDTH, BINS)
        digits = tl.arange(0, BINS)
        histogram = histograms_ptr + (query * PASSES + PASS) * BINS + digits
        tl.atomic_add(histogram, counts, mask=counts != 0, sem="relaxed")
        tl.debug_barrier()  # every thread's adds are issued before the program counts itself in
        counter = counters_ptr + query * PASSES + PASS
        if tl.atomic_add(counter, 1, sem="acq_rel") == chunks - 1:  # the last: every chunk's counts are in
            counts = tl.load(histogram, cache_modifier=".cg")
            digit, above, exact = pick_digit(counts, digits, above, num_top)
            tl.store(state, threshold + (digit << SHIFT))
            tl.store(state + 1, above)
            tl.store(state + 2, exact)
            tl.store(state + 3, SHIFT)
            tl.store(histogram, tl.zeros([BINS], tl.int32))  # ready for the next launch
            tl.atomic_xchg(counter, 0)


@triton.jit
def _count_kernel(scores_ptr, positions_ptr, state_ptr, counts_ptr, num_groups, num_top, scores_stride, num_chunks,
                  RATIO: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Each chunk's keys above the final threshold and at it (compared on the bits the passes resolved)."""
    query, chunk, _, seen, chunks = _program(positions_ptr, num_groups, RATIO, CHUNK, PDL)
    if (seen > num_top) & (chunk < chunks):
        state = state_ptr + query * STATE
        shift = tl.load(state + 3)
        threshold = tl.load(state) >> shift
        groups = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = groups < seen
        keys = score_bits(scores_ptr + query * scores_stride, groups, inside) >> shift
        counts = counts_ptr + (query * num_chunks + chunk) * 2
        tl.store(counts, tl.sum((inside & (keys > threshold)).to(tl.int32), axis=0))
        tl.store(counts + 1, tl.sum((inside & (keys == threshold)).to(tl.int32), axis=0))


@triton.jit
def _write_chosen(scores_row, state, counts, rows_out, valid_out, tables_row, table_width, scratch_block, seen, chunk,
                  num_top, RATIO: tl.constexpr, RATIO_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
                  CHUNKS_PAD: tl.constexpr):
    """One chunk's chosen blocks, placed after those of the chunks before it (their counts' prefix)."""
    shift = tl.load(state + 3)
    quota = num_top - tl.load(state + 1)  # blocks at the threshold to choose, lowest index first
    before = tl.arange(0, CHUNKS_PAD)
    above_before = tl.sum(tl.load(counts + before * 2, mask=before < chunk, other=0), axis=0)
    ties_before = tl.sum(tl.load(counts + before * 2 + 1, mask=before < chunk, other=0), axis=0)
    groups = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = groups < seen
    store_chosen(score_bits(scores_row, groups, inside) >> shift, inside, groups, tl.load(state) >> shift, quota,
                 ties_before, above_before + tl.minimum(ties_before, quota), rows_out, valid_out, tables_row,
                 table_width, scratch_block, RATIO, RATIO_PAD, BLOCK_SIZE)


@triton.jit
def _write_kernel(scores_ptr, positions_ptr, tables_ptr, state_ptr, counts_ptr, rows_ptr, valid_ptr, num_groups,
                  num_top, num_entries, scores_stride, table_stride, table_width, scratch_block, num_chunks,
                  SCORES: tl.constexpr, RATIO: tl.constexpr, RATIO_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
    query, chunk, position, seen, chunks = _program(positions_ptr, num_groups, RATIO, CHUNK, PDL)
    rows_out, valid_out = rows_ptr + query * num_entries, valid_ptr + query * num_entries
    tables_row = tables_ptr + query * table_stride
    if SCORES:
        if seen > num_top:
            if chunk < chunks:
                _write_chosen(scores_ptr + query * scores_stride, state_ptr + query * STATE,
                              counts_ptr + query * num_chunks * 2, rows_out, valid_out, tables_row, table_width,
                              scratch_block, seen, chunk, num_top, RATIO, RATIO_PAD, BLOCK_SIZE, CHUNK, CHUNKS_PAD)
        elif chunk == 0:
            choose_all(rows_out, valid_out, tables_row, table_width, scratch_block, seen, num_top, RATIO, BLOCK_SIZE)
    elif chunk == 0:
        choose_all(rows_out, valid_out, tables_row, table_width, scratch_block, seen, num_top, RATIO, BLOCK_SIZE)
    if chunk == 0:
        store_tail(rows_out, valid_out, tables_row, table_width, scratch_block, position, (position + 1) // RATIO,
                   num_top, RATIO, RATIO_PAD, BLOCK_SIZE)


def split_selection_rows(scores: torch.Tensor | None, positions: torch.Tensor, tables: torch.Tensor, groups: int,
                         k: int, ratio: int, block_size: int, scratch_block: int, rows: torch.Tensor,
                         valid: torch.Tensor) -> None:
    """Fills rows and valid [M, K * R + R - 1] for the top K = min(top, G) of G = `groups` blocks
    (`triton.triton_selection_rows` checks the arguments and makes them) with PASSES + 2 launches."""
    m, device = positions.shape[0], positions.device
    num_chunks = triton.cdiv(groups, CHUNK)
    positions = positions.contiguous()
    state = counts = rows  # (not read when there are no scores)
    common = dict(RATIO=ratio, CHUNK=CHUNK, num_warps=SPLIT_WARPS, **launch_options(device))
    if scores is not None:
        n = passes(DIGIT_BITS)
        state = torch.empty(m, STATE.value, dtype=torch.int32, device=device)
        histograms = arrival_counters("qsa_selection.histograms", device, m * n << DIGIT_BITS)
        counters = arrival_counters("qsa_selection.passes", device, m * n)
        for p in range(n):
            shift, width = pass_digit(p, DIGIT_BITS)
            _digits_kernel[(m, num_chunks)](scores, positions, state, histograms, counters, groups, k,
                                            scores.stride(0), PASS=p, PASSES=n, SHIFT=shift, WIDTH=width,
                                            BINS=1 << DIGIT_BITS, **common)
        counts = torch.empty(m, num_chunks, 2, dtype=torch.int32, device=device)
        _count_kernel[(m, num_chunks)](scores, positions, state, counts, groups, k, scores.stride(0), num_chunks,
                                       **common)
    _write_kernel[(m, num_chunks if scores is not None else 1)](
        rows if scores is None else scores, positions, tables, state, counts, rows, valid, groups, k, rows.shape[1],
        0 if scores is None else scores.stride(0), tables.stride(0), tables.shape[1], scratch_block, num_chunks,
        SCORES=scores is not None, RATIO_PAD=triton.next_power_of_2(ratio), BLOCK_SIZE=block_size,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks), **common)
