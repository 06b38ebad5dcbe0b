"""QSA layer caches: the paged K/V rows on the device, and the indexer's ring and compressed keys.

Paged memory comes in blocks of `block_size` tokens; block `scratch_block` (the last) is never handed
out: padding rows and unconditional writes of static-shape paths land there.
- `QSADeviceKV`: K and V pools [num_blocks, block_size, nkv, hd] in device memory. Its host-RAM
  counterpart with the same interface is `model.qsa_offload.OffloadedKV` (host pools + a VRAM row cache).
  Both write new rows, hand prefill a reader of selected rows, and run decode attention over selected
  rows, so the attention layer never asks where the rows live.
- `QSAIndexerState`: per request the raw indexer keys of the open compression group (the ring, a slot
  state), and paged, one compressed key per complete group of R tokens [num_blocks, block_size / R, id].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierlm.kernels.qsa_row_cache import QSARowCache, attend_rows
from tierlm.model.cache.slot_state import SlotState

KeysValues = tuple[torch.Tensor, torch.Tensor]


class QSADeviceKV:
    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """key_cache, value_cache: [num_blocks, block_size, nkv, hd] on the device."""
        self.key_cache, self.value_cache = key_cache, value_cache
        self.key_rows = key_cache.view(-1, *key_cache.shape[2:])  # [rows, nkv, hd]
        self.value_rows = value_cache.view(-1, *value_cache.shape[2:])
        # CUDA: a one-slot row cache never planned, so that decode reads these pools with the attention
        # kernel host pools use (the same numerics: offload changes no bit of the output)
        self.empty_row_cache = None
        if key_cache.is_cuda:
            self.empty_row_cache = QSARowCache(*torch.zeros(2, 1, *key_cache.shape[2:], dtype=key_cache.dtype,
                                                            device=key_cache.device))

    @property
    def block_bytes(self) -> int:
        return self.key_cache[0].nbytes + self.value_cache[0].nbytes

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New tokens' K, V [N, nkv, hd] into physical rows [N]."""
        self.key_rows[rows] = keys
        self.value_rows[rows] = values

    def gather(self, rows: torch.Tensor) -> KeysValues:
        """K, V [M, S, nkv, hd] of physical rows [M, S]."""
        return self.key_rows[rows], self.value_rows[rows]

    def prefill_reader(self, rows: torch.Tensor, valid: torch.Tensor) -> Callable[[int, int], KeysValues]:
        """For a prefill chunk's selections [M, S]: a function giving K, V of queries lo:hi."""
        return lambda lo, hi: self.gather(rows[lo:hi])

    def decode_attention(
        self, q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each request's query q [B, nh, hd] over its selected rows [B, S] (where valid) -> [B, nh, hd],
        times sigmoid(gate [B, nh, hd]) when given (on CUDA inside the kernel's last launch)."""
        if self.empty_row_cache is None:
            keys, values = self.gather(rows)
            out = attend_rows(q, keys, values, valid, scale)
            return out if gate is None else out * torch.sigmoid(gate)
        from tierlm.kernels.qsa_row_cache.triton import triton_decode_attention

        return triton_decode_attention(self.empty_row_cache, self.key_rows, self.value_rows, q, rows, valid, None,
                                       scale, gate)


class QSAIndexerState(SlotState):
    def __init__(self, ring: torch.Tensor, keys: torch.Tensor, block_size: int, scratch_block: int) -> None:
        """ring [S, R, id] raw keys of each request's open group; keys [num_blocks, block_size // R, id]."""
        self.ring, self.keys = ring, keys
        self.block_size, self.scratch_block = block_size, scratch_block
        self.slot_pools = (ring,)

    @property
    def block_bytes(self) -> int:
        return self.keys[0].nbytes
