"""QSA K/V in host memory: where one layer's rows live when they do not fit the device.

The layer's K and V pools are `HostPool`s (exactly sized, pinned on CUDA). The model writes each new
token's rows into them, and reads them in two ways:
- decode: only the selected rows, straight from the pool over UVA, through a per-layer VRAM row cache
  (`kernels/qsa_row_cache`: consecutive steps select mostly the same rows), bit-identical to reading
  the pool;
- prefill: the request's context rows are copied into a device staging buffer (shared by the layers,
  allocated once) and the chunk's queries gather from there.
On CPU the pools are plain memory and the torch reference forms of the same steps run. The indexer's
compressed keys stay on the device: they are tens of bytes per token and every step reads them all.
"""

from __future__ import annotations

import torch

from tierlm.kernels.qsa_row_cache import QSARowCache, plan_rows, read_rows
from tierlm.memory.host_pool import HostPool


class OffloadedKV:
    def __init__(
        self, keys: HostPool, values: HostPool, staging: tuple[torch.Tensor, torch.Tensor],
        device: torch.device, cache_rows: int,
    ) -> None:
        """keys, values: pools [num_blocks, block_size, nkv, hd]; staging: device [max_rows, nkv, hd] x 2;
        cache_rows: row-cache slots in VRAM (0: no cache, every selected row crosses PCIe)."""
        self.pools = (keys, values)
        self.host_k = keys.tensor.view(-1, *keys.tensor.shape[2:])
        self.host_v = values.tensor.view(-1, *values.tensor.shape[2:])
        self.staging = staging
        self.device = device
        row_shape = self.host_k.shape[1:]
        slots = max(cache_rows, 1)
        arena = [torch.zeros(slots, *row_shape, dtype=self.host_k.dtype, device=device) for _ in range(2)]
        self.cache = QSARowCache(*arena)
        self.use_cache = cache_rows > 0
        if device.type == "cuda":
            from tierlm.kernels.qsa_row_cache.triton import (
                triton_invalidate,
                triton_plan_rows,
                triton_read_rows,
                triton_write_rows,
            )

            self._invalidate, self._plan, self._read = triton_invalidate, triton_plan_rows, triton_read_rows
            self._write = triton_write_rows
        else:
            self._invalidate, self._plan, self._read = QSARowCache.invalidate, plan_rows, read_rows
            self._write = _write_rows

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New tokens' K, V [N, nkv, hd] into pool rows [N]; their cached copies are dropped."""
        self._write(self.host_k, rows, keys)
        self._write(self.host_v, rows, values)
        self._invalidate(self.cache, rows)

    def read_selected(self, rows: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, S, nkv, hd] of selected pool rows [B, S] (invalid entries: padding, any row)."""
        if self.use_cache:
            hit = self._plan(self.cache, rows, valid)
        else:  # never planned, the cache's claims stay empty: nothing is cached, everything is read
            hit = torch.zeros_like(valid)
        return self._read(self.cache, self.host_k, self.host_v, rows, hit)

    def stage(self, table: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` logical rows of a request (its block table) on the device, position-indexed."""
        block_size = self.pools[0].tensor.shape[1]
        blocks = table[: -(-count // block_size)].cpu()
        staged = []
        for pool, buffer in zip(self.pools, self.staging):
            rows = pool.tensor[blocks].flatten(0, 1)[:count]
            buffer[:count].copy_(rows)  # from pageable memory: a synchronous copy whatever the flag
            staged.append(buffer[:count])
        return staged[0], staged[1]


def _write_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """Reference write (CPU): pool[rows] = values."""
    pool[rows.cpu()] = values.to(pool.device)
