"""QSA K/V in host memory: where one layer's rows live when they do not fit the device.

The layer's K and V pools are `HostPool`s (exactly sized, pinned on CUDA); the model writes each new
token's rows into them over UVA. Beside them the layer owns a device arena of `arena_rows` rows of K and
of V, allocated once at start-up, with two uses that never overlap in time:
- prefill: the rows a chunk's queries selected are copied from the pools into the arena, and attention
  reads them there. On CUDA (`prefill_attention`) the sparse attention kernel reads each query's rows
  by index in the arena: all at once when the chunk's rows fit (bit-identical to device pools), else a
  part of the rows at a time, each part's attention and log-sum-exp merged. The torch path
  (`prefill_reader`) gathers each query's rows from the arena (staged for each group of queries, section
  by section, when they do not fit) and gives exactly the bytes device pools would give. Either way a
  row crosses PCIe once per chunk (or part, or group) however many queries select it, rows nobody
  selected not at all.
- decode: the arena is the row cache (`kernels/qsa_row_cache`): the attention kernel reads each selected
  row from the arena if it is cached there, else straight from the pool over UVA, and keeps it. Only
  decode-shaped batches (at most `max_cached_batch` requests) use the cache; larger ones read every row
  from the pool, and their writes still invalidate. A row written again (a freed block handed out anew,
  a position a rejected speculative draft wrote, rewritten by the next step) is never read stale.
A staged prefill overwrites the arena's first rows, so it drops their tags. On CPU the pools are plain
memory and the torch reference forms of the same steps run. The indexer's compressed keys stay on the
device: they are tens of bytes per token and every step reads them all.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from tierlm.kernels.qsa_row_cache import QSARowCache, decode_attention, plan_rows, store_rows
from tierlm.kernels.qsa_sparse_attention.naive import merge_parts, sparse_attention, sparse_attention_lse
from tierlm.memory.host_pool import HostPool

ROW_CACHE_MAX_BATCH = 12  # decode batches up to this size use the row cache
KeysValues = tuple[torch.Tensor, torch.Tensor]


class OffloadedKV:
    def __init__(
        self, keys: HostPool, values: HostPool, arena_rows: int, device: torch.device, row_cache: bool = True,
        max_cached_batch: int = ROW_CACHE_MAX_BATCH,
    ) -> None:
        """keys, values: pools [num_blocks, block_size, nkv, hd]; arena_rows: rows of the device arena
        (prefill staging section, row-cache slots); row_cache: False reads every decode row from the pool."""
        if arena_rows < 1:
            raise ValueError(f"the staging arena needs at least one row, got {arena_rows}")
        self.key_cache, self.value_cache = keys.tensor, values.tensor
        self.host_k = keys.tensor.view(-1, *keys.tensor.shape[2:])
        self.host_v = values.tensor.view(-1, *values.tensor.shape[2:])
        self.device = device
        arena = [torch.zeros(arena_rows, *self.host_k.shape[1:], dtype=self.host_k.dtype, device=device)
                 for _ in range(2)]
        self.cache = QSARowCache(*arena)
        self.row_cache, self.max_cached_batch = row_cache, max_cached_batch
        if device.type == "cuda":
            from tierlm.kernels.qsa_row_cache.triton import (
                triton_decode_attention,
                triton_gather_rows,
                triton_plan_rows,
                triton_store_rows,
            )
            from tierlm.kernels.qsa_sparse_attention.triton import triton_sparse_attention

            self._store, self._plan, self._attend = triton_store_rows, triton_plan_rows, triton_decode_attention
            self._gather = triton_gather_rows
            self._sparse, self._sparse_lse = triton_sparse_attention, partial(triton_sparse_attention, with_lse=True)
        else:
            self._store, self._plan, self._attend, self._gather = store_rows, plan_rows, decode_attention, _gather_rows
            self._sparse, self._sparse_lse = sparse_attention, sparse_attention_lse

    def write(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New tokens' K, V [N, nkv, hd] into pool rows [N]; their cached copies are dropped."""
        self._store(self.cache, self.host_k, self.host_v, rows, keys, values)

    def decode_attention(
        self, q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each request's query q [B, nh, hd] over its selected pool rows [B, S] (where valid) -> [B, nh, hd],
        times sigmoid(gate [B, nh, hd]) when given."""
        hit = None  # not planned: no hit, no claim wins, nothing is cached and every row is read from the pool
        if self.row_cache and rows.shape[0] <= self.max_cached_batch:
            hit = self._plan(self.cache, rows, valid)
        return self._attend(self.cache, self.host_k, self.host_v, q, rows, valid, hit, scale, gate)

    def prefill_attention(self, q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
        """A prefill chunk's attention: q [M, nh, hd] over its selected pool rows [M, S] (where valid)
        -> [M, nh, hd], the rows staged into the arena (see the module docstring)."""
        entries = valid.nonzero(as_tuple=True)
        needed, inverse = torch.unique(rows[entries], return_inverse=True)
        at = torch.zeros_like(rows)
        at[entries] = inverse
        capacity = self.cache.num_slots
        if needed.numel() <= capacity:
            self._stage(needed)
            return self._sparse(q, self.cache.keys, self.cache.values, at, valid, scale)
        outs, lses = [], []
        for first in range(0, needed.numel(), capacity):
            part = needed[first : first + capacity]
            self._stage(part)
            in_part = valid & (at >= first) & (at < first + part.numel())
            at_in_part = (at - first).clamp_(0, part.numel() - 1)
            out, lse = self._sparse_lse(q, self.cache.keys, self.cache.values, at_in_part, in_part, scale)
            outs.append(out)
            lses.append(lse)
        return merge_parts(outs, lses, q.dtype)

    def prefill_reader(self, rows: torch.Tensor, valid: torch.Tensor) -> Callable[[int, int], KeysValues]:
        """For a prefill chunk's selections, pool rows [M, S] (where valid): a function giving K, V
        [hi - lo, S, nkv, hd] of queries lo:hi (invalid entries: zeros).

        When the chunk's distinct rows fit the arena they are staged once, here, and every query group
        gathers from the arena; otherwise each call stages its own queries' rows, section by section.
        """
        entries = valid.nonzero(as_tuple=True)
        needed, inverse = torch.unique(rows[entries], return_inverse=True)
        if needed.numel() > self.cache.num_slots:
            return lambda lo, hi: self.gather_prefill(rows[lo:hi], valid[lo:hi])
        self._stage(needed)
        arena_row = torch.zeros_like(rows)
        arena_row[entries] = inverse

        def gather(lo: int, hi: int) -> KeysValues:
            at, ok = arena_row[lo:hi], valid[lo:hi, :, None, None]
            return torch.where(ok, self.cache.keys[at], 0), torch.where(ok, self.cache.values[at], 0)

        return gather

    def gather_prefill(self, rows: torch.Tensor, valid: torch.Tensor) -> KeysValues:
        """K, V [M, S, nkv, hd] of selected pool rows [M, S] (invalid entries: zeros), staged through the
        arena at most an arena's worth of distinct rows at a time."""
        keys = torch.zeros(*rows.shape, *self.host_k.shape[1:], dtype=self.host_k.dtype, device=self.device)
        values = torch.zeros_like(keys)
        entries = valid.nonzero(as_tuple=True)
        needed, inverse = torch.unique(rows[entries], return_inverse=True)
        arena_rows = self.cache.num_slots
        for first in range(0, needed.numel(), arena_rows):
            section = needed[first : first + arena_rows]
            self._stage(section)
            in_section = (inverse >= first) & (inverse < first + section.numel())
            at = tuple(index[in_section] for index in entries)
            keys[at] = self.cache.keys[inverse[in_section] - first]
            values[at] = self.cache.values[inverse[in_section] - first]
        return keys, values

    def _stage(self, rows: torch.Tensor) -> None:
        """Pool rows [n <= arena rows] into the arena's first n rows, whose cached rows are forgotten."""
        self._gather(self.cache.keys, self.host_k, rows)
        self._gather(self.cache.values, self.host_v, rows)
        self.cache.drop_slots(rows.numel())


def _gather_rows(out: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor) -> None:
    """Reference staging copy (CPU): out[:len(rows)] = pool[rows]."""
    torch.index_select(pool, 0, rows.cpu(), out=out[: rows.numel()])
