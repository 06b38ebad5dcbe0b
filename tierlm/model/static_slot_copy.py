"""Batched slot copies over many state pools at fixed batch sizes: one CUDA graph replay on a GPU.

Speculative decoding rolls a rejecting request back by copying one of its position slots into its own slot
in every per-request state pool (GDN conv and recurrent states, PLE histories, n-gram context, indexer
rings: ~2 ops per pool, dozens of pools). Eagerly that is one kernel launch per op; here the copies of every
pool are captured once per prepared batch size (the sizes `StaticDecodeRunner` prepares) and replayed
from two index buffers. Rows past the batch copy the cache's scratch slot onto itself. Mode "eager" runs
the same padded copies without capture (CPU, and the tests).
"""

from __future__ import annotations

import torch

from tierlm.model.cache.slot_state import SlotState
from tierlm.model.forward_batch import on_device
from tierlm.model.static_decode import prepared_sizes


class StaticSlotCopy:
    def __init__(self, states: list[SlotState], max_batch: int, scratch_slot: int, device: torch.device,
                 mode: str) -> None:
        """states: the slot states whose pools every copy moves; mode "cuda_graph" captures, "eager" not."""
        if mode not in ("cuda_graph", "eager"):
            raise ValueError(f"mode {mode!r}: choose cuda_graph or eager")
        self.pools = [pool for state in states for pool in state.slot_pools]
        self.sizes = prepared_sizes(max_batch)
        self.scratch_slot = scratch_slot
        self.max_batch = max_batch
        # sources then targets: one input buffer, filled by one host-to-device copy per call
        self.indices = torch.full((2 * max_batch,), scratch_slot, dtype=torch.int64, device=device)
        self.sources, self.targets = self.indices[:max_batch], self.indices[max_batch:]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if mode == "cuda_graph":
            self._capture()

    def _copy(self, size: int) -> None:
        sources, targets = self.sources[:size], self.targets[:size]
        for pool in self.pools:
            pool.index_copy_(0, targets, pool.index_select(0, sources))

    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._copy(size)  # warm-up outside the capture (scratch onto itself)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._copy(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def copy(self, sources: list[int], targets: list[int]) -> None:
        """Slot sources[i] into slot targets[i] in every pool (no slot both a source and another row's
        target)."""
        n = len(sources)
        if n > self.max_batch or len(targets) != n:
            raise ValueError(f"{n} sources, {len(targets)} targets: need as many of each, at most {self.max_batch}")
        size = next(s for s in self.sizes if s >= n)
        padding = [self.scratch_slot] * (self.max_batch - n)
        self.indices.copy_(on_device([*sources, *padding, *targets, *padding], self.indices.device),
                           non_blocking=True)
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            self._copy(size)
