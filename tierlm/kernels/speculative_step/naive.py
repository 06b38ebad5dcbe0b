"""Torch reference of the greedy speculative step's index work (see the package docstring for the signatures)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Accepted:
    """What `accept_drafts` decides beside the readback, per request i with a_i drafts accepted."""

    rows: torch.Tensor  # [n] i T + a_i: the verify row of the last accepted token (the head's logits row)
    kept_slots: torch.Tensor  # [n] verify_slots[i, a_i]: the slot with the state after that row
    step_slots: torch.Tensor  # [n] verify_slots[i, (a_i + 1) % T]: a row slot the request does not keep
    step_positions: torch.Tensor  # [K-1, n] start_i + a_i + s: draft step s's position
    step_kv_rows: torch.Tensor  # [K-1, n] its K/V row


@dataclass
class NextInputs:
    """A fixed-shape runner's input buffers for n requests of T rows, which a step's end rewrites for the step
    chained after it (overlap scheduling)."""

    input_ids: torch.Tensor  # [n T]
    positions: torch.Tensor  # [n T]
    context_lens: torch.Tensor  # [n] each request's start (the position of its row 0)
    slots: torch.Tensor  # [n] each request's state slot (the scratch slot: a padding request)
    verify_slots: torch.Tensor  # [n, T] the slot keeping the state after each row
    scratch_slot: int


def kv_rows(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, scratch_block: int) -> torch.Tensor:
    """The K/V rows of positions [n, P] of the n requests' block tables [n, width]: a negative entry, or a
    column past the table (never a real request's: the scheduler reserves its blocks), is the scratch block."""
    columns = positions // block_size
    inside = columns < block_tables.shape[1]
    blocks = block_tables.gather(1, torch.where(inside, columns, 0))
    blocks = torch.where(inside & (blocks >= 0), blocks, scratch_block)
    return blocks * block_size + positions % block_size


def step_inputs(
    candidates: torch.Tensor, picks: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
    block_size: int, scratch_block: int, token_ids: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    n = block_tables.shape[0]
    torch.index_select(candidates, 0, picks, out=token_ids)
    slot_mapping.copy_(kv_rows(block_tables, positions.view(n, -1), block_size, scratch_block).flatten())


def accept_drafts(
    best: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, verify_slots: torch.Tensor,
    block_tables: torch.Tensor, block_size: int, scratch_block: int, readback: torch.Tensor,
) -> Accepted:
    n, width = best.shape
    k = width - 1
    drafts = token_ids.view(n, width)[:, 1:]  # row 0 holds the last token, then the drafts
    accepted = (drafts == best[:, :k]).cumprod(dim=1).sum(dim=1)
    readback[:, 0] = accepted
    readback[:, 1] = best.gather(1, accepted[:, None])[:, 0]
    slots = verify_slots.gather(1, torch.stack([accepted, (accepted + 1) % width], dim=1))
    rows = torch.arange(0, n * width, width, device=best.device) + accepted
    if k == 1:  # no draft steps
        none = torch.empty(0, n, dtype=torch.int64, device=best.device)
        return Accepted(rows, slots[:, 0], slots[:, 1], none, none)
    step_positions = positions.view(n, width)[:, :1] + accepted[:, None] + torch.arange(1, k, device=best.device)
    return Accepted(rows, slots[:, 0], slots[:, 1], step_positions.T,
                    kv_rows(block_tables, step_positions, block_size, scratch_block).T)


def finish_step(readback: torch.Tensor, drafts: torch.Tensor, following: NextInputs | None) -> None:
    readback[:, 2:] = drafts.T
    if following is None:
        return
    width = drafts.shape[0] + 1
    steps = torch.arange(width, device=readback.device)
    real = following.slots != following.scratch_slot
    accepted = readback[:, 0] * real
    following.verify_slots.copy_(following.verify_slots.gather(1, (accepted[:, None] + 1 + steps) % width))
    following.slots.copy_(following.verify_slots[:, -1])
    following.context_lens.add_((1 + accepted) * real)
    following.positions.copy_(((following.context_lens[:, None] + steps) * real[:, None]).flatten())
    following.input_ids.copy_((readback[:, 1:] * real[:, None]).flatten())
