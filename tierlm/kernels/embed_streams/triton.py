"""`embed_streams` in one Triton launch (same signature as `naive`); CUDA graphs capture it.

A program per (row, BLOCK_H columns of the table): it loads the row's id, then its slice of the table row
once, and stores the slice into each of the row's hc streams. An INT8 table (scales given) is a
compile-time variant: the program loads the slice's int32 words (a quarter of the bf16 bytes) and the
row's scale, and quant_linear's `dequantize_words` splits each word into its 4 values and scales them in
fp32, rounding once to the streams' dtype, which is the reference's arithmetic (the same bits). Ids are not
range-checked on the device (no host read in a decode step); the callers' ids come from the tokenizer or
the sampler. Launched with programmatic dependent launch (`kernels/dependent_launch`): the table row (and
its scale) it reads depends on the id, an input, so it waits first; it still lets the kernel after it
start early.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.embed_streams.naive import check_args
from tierlm.kernels.quant_linear.triton import dequantize_words, dot_precision

BLOCK_H = 1024  # columns per program: 3 programs a row at hidden 2560


@triton.jit
def _embed_streams_kernel(table_ptr, scale_ptr, ids_ptr, out_ptr, table_stride, scale_stride, HIDDEN: tl.constexpr,
                          HC: tl.constexpr, BLOCK: tl.constexpr, INT8: tl.constexpr, PRECISION: tl.constexpr,
                          PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    columns = part * BLOCK + tl.arange(0, BLOCK)
    inside = columns < HIDDEN
    token = tl.load(ids_ptr + row).to(tl.int64)
    if INT8:  # [1, BLOCK / 4 words, 4 values] -> the slice's BLOCK values (column 4 w + j: value j of word w)
        values = dequantize_words(table_ptr, scale_ptr, part * BLOCK, tl.full((1, 1), 0, tl.int64) + token,
                                  table_stride, scale_stride, HIDDEN, 8, HIDDEN, BLOCK, HIDDEN % BLOCK == 0,
                                  out_ptr.dtype.element_ty, PRECISION)
        values = tl.reshape(values, (BLOCK,)).to(out_ptr.dtype.element_ty)  # (exact: already rounded)
    else:
        values = tl.load(table_ptr + token * table_stride + columns, mask=inside)
    streams = out_ptr + row.to(tl.int64) * (HC * HIDDEN)
    for stream in tl.static_range(HC):
        tl.store(streams + stream * HIDDEN + columns, values, mask=inside)


def embed_streams(table: torch.Tensor, ids: torch.Tensor, hc_count: int,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    hidden = check_args(table, ids, hc_count, scales)
    if table.stride(1) != 1 or not ids.is_contiguous():
        raise ValueError("embed_streams kernel: the table's rows and the ids must be contiguous")
    out = torch.empty(ids.shape[0], hc_count * hidden, dtype=table.dtype if scales is None else scales.dtype,
                      device=table.device)
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    if ids.shape[0]:
        int8 = scales is not None
        _embed_streams_kernel[(ids.shape[0], triton.cdiv(hidden, block))](
            table, scales if int8 else table, ids, out, table.stride(0), scales.stride(0) if int8 else 0,
            HIDDEN=hidden, HC=hc_count, BLOCK=block, INT8=int8, PRECISION=dot_precision(out), num_warps=4,
            **launch_options(table.device))
    return out
