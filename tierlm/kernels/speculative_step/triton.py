"""The greedy speculative step's index work in one Triton launch each (same signatures as `naive`).

- `step_inputs`: a program per BLOCK_ROWS verify rows: the row's id picked from the candidates, its K/V row
  from its request's block table.
- `accept_drafts`: a program per request, its T verify rows' argmaxes and drafts in registers: the first
  mismatch, the token there, the two row slots, the draft steps' positions and K/V rows.
- `finish_step`: a program per request: the drafts into the readback; with `following`, the row slots
  turned round (a gather within the row's registers), the start, positions and ids of the chained step.
  It reads the row slots, state slot and start it rewrites: every load comes before a barrier, every
  store after it.
Launched with programmatic dependent launch (kernels/dependent_launch): nothing they read is a weight, so
each program waits before any memory access (after `allow_dependents`, which lets the next kernel start
under TIERLM_PDL_TRIGGER=start). Requests are few and rows short: one warp a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.speculative_step.naive import Accepted, NextInputs

BLOCK_ROWS = 128  # verify rows per `step_inputs` program


@triton.jit
def _kv_rows(tables_ptr, table_stride, width, request, positions, mask, scratch_block, BLOCK_SIZE: tl.constexpr):
    """The K/V rows of `positions` in the request's block table (a negative entry, or a column past the
    table: the scratch block)."""
    columns = positions // BLOCK_SIZE
    inside = mask & (columns < width)
    blocks = tl.load(tables_ptr + request * table_stride + columns, mask=inside, other=-1)
    blocks = tl.where(blocks < 0, scratch_block, blocks)
    return blocks * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def _step_inputs_kernel(candidates_ptr, picks_ptr, positions_ptr, tables_ptr, token_ids_ptr, slot_mapping_ptr,
                        rows, table_stride, width, scratch_block, T: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < rows
    picks = tl.load(picks_ptr + offsets, mask=mask, other=0)
    tl.store(token_ids_ptr + offsets, tl.load(candidates_ptr + picks, mask=mask), mask=mask)
    positions = tl.load(positions_ptr + offsets, mask=mask, other=0)
    kv = _kv_rows(tables_ptr, table_stride, width, offsets // T, positions, mask, scratch_block, BLOCK_SIZE)
    tl.store(slot_mapping_ptr + offsets, kv, mask=mask)


@triton.jit
def _accept_kernel(best_ptr, token_ids_ptr, positions_ptr, verify_slots_ptr, tables_ptr, readback_ptr,
                   rows_ptr, kept_ptr, step_slots_ptr, step_positions_ptr, step_kv_ptr, n, verify_stride,
                   table_stride, width, readback_stride, scratch_block, T: tl.constexpr, T_POW2: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    request = tl.program_id(0)
    j = tl.arange(0, T_POW2)
    k = T - 1
    best = tl.load(best_ptr + request * T + j, mask=j < T, other=0)
    drafts = tl.load(token_ids_ptr + request * T + 1 + j, mask=j < k, other=0)  # draft j + 1 against row j
    accepted = tl.min(tl.where((j < k) & (drafts != best), j, k), axis=0)
    row_slots = tl.load(verify_slots_ptr + request * verify_stride + j, mask=j < T, other=0)
    tl.store(readback_ptr + request * readback_stride, accepted.to(tl.int64))
    tl.store(readback_ptr + request * readback_stride + 1, tl.sum(tl.where(j == accepted, best, 0), axis=0))
    tl.store(rows_ptr + request, (request * T + accepted).to(tl.int64))
    tl.store(kept_ptr + request, tl.sum(tl.where(j == accepted, row_slots, 0), axis=0))
    tl.store(step_slots_ptr + request, tl.sum(tl.where(j == (accepted + 1) % T, row_slots, 0), axis=0))
    if T > 2:  # draft steps s = 1 .. K-1, at index s - 1
        steps = j < k - 1
        positions = tl.load(positions_ptr + request * T) + accepted + 1 + j
        kv = _kv_rows(tables_ptr, table_stride, width, request, positions, steps, scratch_block, BLOCK_SIZE)
        tl.store(step_positions_ptr + j * n + request, positions, mask=steps)
        tl.store(step_kv_ptr + j * n + request, kv, mask=steps)


@triton.jit
def _finish_kernel(readback_ptr, drafts_ptr, input_ids_ptr, positions_ptr, context_lens_ptr, slots_ptr,
                   verify_slots_ptr, readback_stride, drafts_stride_k, drafts_stride_n, verify_stride,
                   scratch_slot, T: tl.constexpr, T_POW2: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    request = tl.program_id(0)
    j = tl.arange(0, T_POW2)
    k = T - 1
    drafts = tl.load(drafts_ptr + j * drafts_stride_k + request * drafts_stride_n, mask=j < k, other=0)
    if ADVANCE:
        real = tl.load(slots_ptr + request) != scratch_slot
        accepted = tl.where(real, tl.load(readback_ptr + request * readback_stride), 0)
        final = tl.load(readback_ptr + request * readback_stride + 1)
        row_slots = tl.load(verify_slots_ptr + request * verify_stride + j, mask=j < T, other=0)
        start = tl.load(context_lens_ptr + request) + (1 + accepted) * real
        # the chained step's ids: the token after the accepted drafts, then the K new drafts
        previous = tl.load(drafts_ptr + (j - 1) * drafts_stride_k + request * drafts_stride_n,
                           mask=(j >= 1) & (j < T), other=0)
        ids = tl.where(j == 0, final, previous) * real
        # row slot j of the chained step: slot (a + 1 + j) % T of this one, picked within the registers
        source = (accepted + 1 + j) % T
        turned = tl.sum(tl.where(j[None, :] == source[:, None], row_slots[None, :], 0), axis=1)
        state_slot = tl.sum(tl.where(j == T - 1, turned, 0), axis=0)
        tl.debug_barrier()  # all of this program's loads of what it rewrites are done before any store
        tl.store(verify_slots_ptr + request * verify_stride + j, turned, mask=j < T)
        tl.store(slots_ptr + request, state_slot)
        tl.store(context_lens_ptr + request, start)
        tl.store(positions_ptr + request * T + j, (start + j) * real, mask=j < T)
        tl.store(input_ids_ptr + request * T + j, ids, mask=j < T)
    tl.store(readback_ptr + request * readback_stride + 2 + j, drafts, mask=j < k)


def _check(name: str, **tensors: torch.Tensor) -> None:
    for label, tensor in tensors.items():
        if tensor.dtype != torch.int64:
            raise ValueError(f"{name}: {label} must be int64, got {tensor.dtype}")


def step_inputs(
    candidates: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
    block_size: int, scratch_block: int, token_ids: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    _check("step_inputs", candidates=candidates, picks=picks, positions=positions, block_tables=block_tables,
           token_ids=token_ids, slot_mapping=slot_mapping)
    rows, n = positions.shape[0], block_tables.shape[0]
    if block_tables.stride(1) != 1 or not all(t.is_contiguous() for t in (candidates, picks, positions, token_ids,
                                                                          slot_mapping)):
        raise ValueError("step_inputs kernel: contiguous vectors and block-table rows")
    if rows:
        _step_inputs_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            candidates, picks, positions, block_tables, token_ids, slot_mapping, rows, block_tables.stride(0),
            block_tables.shape[1], scratch_block, T=rows // n, BLOCK_SIZE=block_size, BLOCK=BLOCK_ROWS,
            num_warps=4, **launch_options(positions.device))


def accept_drafts(
    best: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, verify_slots: torch.Tensor,
    block_tables: torch.Tensor, block_size: int, scratch_block: int, readback: torch.Tensor,
) -> Accepted:
    _check("accept_drafts", best=best, token_ids=token_ids, positions=positions, verify_slots=verify_slots,
           block_tables=block_tables, readback=readback)
    n, width = best.shape
    if (not best.is_contiguous() or not token_ids.is_contiguous() or not positions.is_contiguous()
            or verify_slots.stride(1) != 1 or block_tables.stride(1) != 1 or readback.stride(1) != 1):
        raise ValueError("accept_drafts kernel: contiguous best, ids and positions; rows of the others")
    as_long = {"dtype": torch.int64, "device": best.device}
    rows, kept, step_slots = (torch.empty(n, **as_long) for _ in range(3))
    step_positions, step_kv_rows = (torch.empty(width - 2, n, **as_long) for _ in range(2))
    if n:
        _accept_kernel[(n,)](
            best, token_ids, positions, verify_slots, block_tables, readback, rows, kept, step_slots,
            step_positions, step_kv_rows, n, verify_slots.stride(0), block_tables.stride(0), block_tables.shape[1],
            readback.stride(0), scratch_block, T=width, T_POW2=triton.next_power_of_2(width), BLOCK_SIZE=block_size, num_warps=1, **launch_options(best.device))
    return Accepted(rows, kept, step_slots, step_positions, step_kv_rows)


def finish_step(readback: torch.Tensor, drafts: torch.Tensor, following: NextInputs | None) -> None:
    _check("finish_step", readback=readback, drafts=drafts)
    n, width = readback.shape[0], drafts.shape[0] + 1
    if readback.stride(1) != 1:
        raise ValueError("finish_step kernel: the readback's rows must be contiguous")
    buffers = (None,) * 5 if following is None else (
        following.input_ids, following.positions, following.context_lens, following.slots, following.verify_slots)
    if following is not None:
        _check("finish_step", input_ids=buffers[0], positions=buffers[1], context_lens=buffers[2], slots=buffers[3],
               verify_slots=buffers[4])
        if not all(t.is_contiguous() for t in buffers[:4]) or buffers[4].stride(1) != 1:
            raise ValueError("finish_step kernel: contiguous input buffers, row slots by rows")
    if n:
        _finish_kernel[(n,)](
            readback, drafts, *buffers, readback.stride(0), drafts.stride(0), drafts.stride(1),
            0 if following is None else following.verify_slots.stride(0),
            0 if following is None else following.scratch_slot, T=width, T_POW2=triton.next_power_of_2(width),
            ADVANCE=following is not None, num_warps=1, **launch_options(readback.device))
