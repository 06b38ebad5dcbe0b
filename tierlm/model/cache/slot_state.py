"""Per-request state kinds: pools indexed by state slot, and what every kind can do with one slot.

A `SlotState` owns one or more pools whose first dimension is the slot ([num_slots, ...]); a request's
state is row `slot` of each. Every kind knows its bytes per slot, how to reset and copy a slot, and how
to save a slot into host memory and restore it (`slot_pools` lists what those move, in a fixed order).
The kinds (as vLLM's cache specs, one per layer kind):
- `GDNState`: a Gated DeltaNet layer's conv window (last Kc-1 inputs) and fp32 recurrent state.
- `PLEState`: a PLE layer's dilated short-conv history (last (Kp-1)*ngram_size values).
- `NgramContextState`: the model's last ngram_size-1 token ids per request (EOS at a request's start).
The QSA indexer ring is a slot state too, kept with the indexer's paged keys (`qsa.QSAIndexerState`).
"""

from __future__ import annotations

import torch


class SlotState:
    """Pools [num_slots, ...] addressed by slot. Subclasses set `slot_pools` and may override `reset_slot`."""

    slot_pools: tuple[torch.Tensor, ...] = ()

    @property
    def slot_bytes(self) -> int:
        return sum(pool[0].nbytes for pool in self.slot_pools)

    def reset_slot(self, slot: int) -> None:
        """The state of a request that has seen no tokens yet."""
        for pool in self.slot_pools:
            pool[slot].zero_()

    def copy_slot(self, source: int, target: int) -> None:
        for pool in self.slot_pools:
            pool[target].copy_(pool[source])

    def copy_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Slot sources[i] into slot targets[i] for every i (tensors on the pools' device; no slot both)."""
        for pool in self.slot_pools:
            pool.index_copy_(0, targets, pool.index_select(0, sources))

    def save_slot(self, slot: int, host: list[torch.Tensor], non_blocking: bool = False) -> None:
        """Copy the slot into host tensors shaped as one slot of each pool (`slot_pools` order)."""
        for pool, out in zip(self.slot_pools, host, strict=True):
            out.copy_(pool[slot], non_blocking=non_blocking)

    def restore_slot(self, host: list[torch.Tensor], slot: int, non_blocking: bool = False) -> None:
        """The inverse of `save_slot`."""
        for pool, saved in zip(self.slot_pools, host, strict=True):
            pool[slot].copy_(saved, non_blocking=non_blocking)


class GDNState(SlotState):
    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """conv [S, C, Kc-1] (model dtype), recurrent [S, nv, dk, dv] fp32."""
        self.conv, self.recurrent = conv, recurrent
        self.slot_pools = (conv, recurrent)


class PLEState(SlotState):
    def __init__(self, conv: torch.Tensor) -> None:
        """conv [S, hc*H, (Kp-1)*ngram_size]."""
        self.conv = conv
        self.slot_pools = (conv,)


class NgramContextState(SlotState):
    def __init__(self, context: torch.Tensor, eos_token_id: int | None) -> None:
        """context [S, ngram_size-1] int64 token ids; a fresh request's context is EOS (0 without one)."""
        self.context, self.eos_token_id = context, eos_token_id
        self.slot_pools = (context,) if context.shape[1] else ()

    def reset_slot(self, slot: int) -> None:
        if self.eos_token_id is not None:
            self.context[slot].fill_(self.eos_token_id)
