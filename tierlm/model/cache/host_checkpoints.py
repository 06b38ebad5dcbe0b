"""Prefix-cache checkpoints in (pinned) host RAM: copies of request state slots, taken and restored.

A checkpoint is one slot of every `SlotState` of the model, laid out back to back in one row of a
single exact-size host pool (`memory.host_pool`, allocated under the rank lock; pinned on CUDA):
[num_checkpoints, checkpoint_bytes] bytes, each slot pool's part viewed with its own dtype and shape.
Parts are ordered by element size (largest first) and a row is padded to 8 bytes, so every view is
aligned; `checkpoint_bytes` gives the row size (the planner uses the same function).

Moves (the caller keeps the books: which checkpoint holds what, least recently used first):
- `save(slot, index)`: device slot -> host row. On CUDA the slot is first copied into a device staging
  slot on the current stream (device bandwidth: tens of microseconds for 115 MB), then a side stream
  copies the staging slot to the host row (non_blocking) while the next steps run; the next save waits
  for that copy before it overwrites the staging slot. Neither the engine thread nor the device waits.
- `restore(index, slot)`: host row -> device slot, queued on the current stream (non_blocking on CUDA)
  after any save still writing to the host. On CPU both are plain copies.
Only the slots of running requests stay in device memory.
"""

from __future__ import annotations

import torch

from tierlm.memory.host_pool import allocate_pools
from tierlm.model.cache.slot_state import SlotState

ALIGN = 8  # bytes: the largest element size of a slot pool (int64 token ids)


def checkpoint_bytes(part_bytes: list[int]) -> int:
    """One checkpoint row: the parts' bytes, padded to ALIGN."""
    return -(-sum(part_bytes) // ALIGN) * ALIGN


class HostCheckpoints:
    def __init__(
        self, states: list[SlotState], count: int, device: torch.device, staging_slot: int | None = None
    ) -> None:
        """`count` checkpoint rows, each one slot of every pool of `states` (the device's slot states);
        staging_slot: the slot saves pass through on CUDA."""
        if device.type == "cuda" and staging_slot is None:
            raise ValueError("checkpoints of CUDA slots need a staging slot")
        self.count, self.device, self.staging_slot = count, device, staging_slot
        pools = [pool for state in states for pool in state.slot_pools]
        order = sorted(range(len(pools)), key=lambda i: -pools[i].dtype.itemsize)
        self.row_bytes = checkpoint_bytes([pools[i][0].nbytes for i in order])
        self.pool = allocate_pools({"prefix-cache checkpoints": ((count, self.row_bytes), torch.uint8)},
                                   pin=device.type == "cuda")["prefix-cache checkpoints"]
        rows = self.pool.tensor
        views: list[torch.Tensor | None] = [None] * len(pools)
        offset = 0
        for i in order:
            pool = pools[i]
            nbytes = pool[0].nbytes
            views[i] = rows[:, offset : offset + nbytes].view(pool.dtype).view(count, *pool.shape[1:])
            offset += nbytes
        # per state, its pools' views (in the state's own order)
        self._views, at = [], 0
        for state in states:
            self._views.append(views[at : at + len(state.slot_pools)])
            at += len(state.slot_pools)
        self.states = states
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def save(self, slot: int, index: int) -> None:
        if not self.cuda:
            self._copy_out(slot, index, non_blocking=False)
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.side)  # the previous save has left the staging slot
        for state in self.states:
            state.copy_slot(slot, self.staging_slot)
        self.side.wait_stream(current)  # the staging copy, and restores still reading host rows
        with torch.cuda.stream(self.side):
            self._copy_out(self.staging_slot, index, non_blocking=True)

    def restore(self, index: int, slot: int) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)  # saves still writing host rows
        for state, views in zip(self.states, self._views):
            state.restore_slot([view[index] for view in views], slot, non_blocking=self.cuda)

    def _copy_out(self, slot: int, index: int, non_blocking: bool) -> None:
        for state, views in zip(self.states, self._views):
            state.save_slot(slot, [view[index] for view in views], non_blocking=non_blocking)

