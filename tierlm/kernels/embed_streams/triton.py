"""`embed_streams` in one Triton launch (same signature as `naive`); CUDA graphs capture it.

A program per (row, BLOCK_H columns of the table): it loads the row's id, then its slice of the table row
once, and stores the slice into each of the row's hc streams. Ids are not range-checked on the device
(no host read in a decode step); the callers' ids come from the tokenizer or the sampler. Launched with
programmatic dependent launch (`kernels/dependent_launch`): the table row it reads depends on the id, an
input, so it waits first; it still lets the kernel after it start early.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.embed_streams.naive import check_args

BLOCK_H = 1024  # columns per program: 3 programs a row at hidden 2560


@triton.jit
def _embed_streams_kernel(table_ptr, ids_ptr, out_ptr, table_stride, HIDDEN: tl.constexpr, HC: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    columns = part * BLOCK + tl.arange(0, BLOCK)
    inside = columns < HIDDEN
    token = tl.load(ids_ptr + row).to(tl.int64)
    values = tl.load(table_ptr + token * table_stride + columns, mask=inside)
    streams = out_ptr + row.to(tl.int64) * (HC * HIDDEN)
    for stream in tl.static_range(HC):
        tl.store(streams + stream * HIDDEN + columns, values, mask=inside)


def embed_streams(table: torch.Tensor, ids: torch.Tensor, hc_count: int) -> torch.Tensor:
    check_args(table, ids, hc_count)
    if table.stride(1) != 1 or not ids.is_contiguous():
        raise ValueError("embed_streams kernel: the table's rows and the ids must be contiguous")
    hidden = table.shape[1]
    out = table.new_empty(ids.shape[0], hc_count * hidden)
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    if ids.shape[0]:
        _embed_streams_kernel[(ids.shape[0], triton.cdiv(hidden, block))](
            table, ids, out, table.stride(0), HIDDEN=hidden, HC=hc_count, BLOCK=block, num_warps=4,
            **launch_options(table.device))
    return out
