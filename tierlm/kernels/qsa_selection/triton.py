"""QSA selection as one Triton launch (same signature as `naive.selection_rows`): one program per (query,
tile of BLOCK_S entries) decodes each entry's token position from its top key (or its place in the open
tail), reads the block table and writes the row and its validity. No host sync."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_S = 128


@triton.jit
def _selection_kernel(keys_ptr, positions_ptr, tables_ptr, rows_ptr, valid_ptr, num_top, num_entries,
                      keys_stride, table_stride, table_width, scratch_block,
                      RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr):
    query = tl.program_id(0).to(tl.int64)
    entries = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    inside = entries < num_entries
    position = tl.load(positions_ptr + query)
    in_top = entries < num_top * RATIO
    key = tl.load(keys_ptr + query * keys_stride + entries // RATIO, mask=inside & in_top, other=-1)
    top_pos = (0xFFFFFFFF - (key & 0xFFFFFFFF)) * RATIO + entries % RATIO
    tail_pos = (position + 1) // RATIO * RATIO + (entries - num_top * RATIO)
    token_pos = tl.where(in_top, top_pos, tail_pos)
    ok = tl.where(in_top, key >= 0, tail_pos <= position)
    block_index = tl.minimum(token_pos // BLOCK_SIZE, table_width - 1)
    block = tl.load(tables_ptr + query * table_stride + block_index, mask=inside & ok, other=0)
    block = tl.where(block < 0, scratch_block, block)
    row = tl.where(ok, block * BLOCK_SIZE + token_pos % BLOCK_SIZE, scratch_block * BLOCK_SIZE)
    tl.store(rows_ptr + query * num_entries + entries, row, mask=inside)
    tl.store(valid_ptr + query * num_entries + entries, ok.to(tl.int8), mask=inside)


def triton_selection_rows(
    top_keys: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, ratio: int, block_size: int,
    scratch_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `naive.selection_rows`, in one launch."""
    m, k = top_keys.shape
    entries = k * ratio + ratio - 1
    rows = torch.empty(m, entries, dtype=torch.int64, device=top_keys.device)
    valid = torch.empty(m, entries, dtype=torch.int8, device=top_keys.device)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    if m:
        _selection_kernel[(m, triton.cdiv(entries, BLOCK_S))](
            top_keys, positions.contiguous(), tables, rows, valid, k, entries, top_keys.stride(0), tables.stride(0),
            tables.shape[1], scratch_block, RATIO=ratio, BLOCK_SIZE=block_size, BLOCK_S=BLOCK_S,
        )
    return rows, valid.view(torch.bool)
