"""Decode steps as fixed-shape forwards: replayed from CUDA graphs, or compiled with torch.compile.

A decode step of a small model is ~1,500 tiny ops; its time is dispatch and launch overhead, not
arithmetic. The decode path is static-shape and sync-free (see the layers), so one forward per batch
size can be captured once (GPU: a CUDA graph) or compiled once (CPU: torch.compile fuses the ops into
a few kernels) and then reused: each step's inputs are copied into fixed input buffers, the forward runs
on them, and the logits come out of a fixed output buffer.

A batch of B requests runs at the smallest prepared size >= B; padding rows point at the cache's
scratch slot and scratch block, so they never touch a real request's state. Mode "eager" runs the same
padded batches without capture or compilation: that is how the padding is tested without a GPU.
"""

from __future__ import annotations

import torch

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.model_cache import ModelCache

MODES = ("cuda_graph", "compile", "eager")


def prepared_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class StaticDecodeRunner:
    def __init__(
        self, model, cache: ModelCache, max_batch: int, max_blocks_per_request: int, mode: str,
        sizes: list[int] | None = None, ple_embedding_dims: dict[int, int] | None = None,
    ) -> None:
        """sizes: the batch sizes to prepare (default `prepared_sizes(max_batch)`); the largest is max_batch.
        ple_embedding_dims: {PLE index: width} when the host gathers PLE embeddings (mapped tables)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: choose one of {MODES}")
        self.model, self.cache, self.mode = model, cache, mode
        self.sizes = sorted(set(sizes or prepared_sizes(max_batch)) | {max_batch})
        self.max_batch = max_batch
        as_long = dict(dtype=torch.int64, device=cache.device)
        # the input buffers every prepared forward reads
        self.token_ids = torch.zeros(max_batch, **as_long)
        self.positions = torch.zeros(max_batch, **as_long)
        self.context_lens = torch.zeros(max_batch, **as_long)
        self.slots = torch.zeros(max_batch, **as_long)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_request, **as_long)
        self.slot_mapping = torch.zeros(max_batch, **as_long)
        self.logits_rows = torch.arange(max_batch, **as_long)
        self.ple_embeddings = {
            index: torch.zeros(max_batch, width, dtype=cache.dtype, device=cache.device)
            for index, width in (ple_embedding_dims or {}).items()
        } or None
        self._pad_from(0)
        self.batches = {size: self._static_batch(size) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.forward = model
        if mode == "compile":
            # one compiled graph per prepared size; shapes never change for a given size
            self.forward = torch.compile(model, dynamic=False)
            for size in self.sizes:
                self.forward(self.batches[size], cache)
        elif mode == "cuda_graph":
            self._capture()

    def _static_batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            token_ids=self.token_ids[:size], positions=self.positions[:size], context_lens=[0] * size,
            query_lens=[1] * size, state_slots=[self.cache.scratch_slot] * size,
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            logits_rows=self.logits_rows[:size], slots=self.slots[:size], context_lens_tensor=self.context_lens[:size],
            static=True,
            ple_embeddings={i: e[:size] for i, e in self.ple_embeddings.items()} if self.ple_embeddings else None,
        )

    def _pad_from(self, start: int) -> None:
        """Rows from `start` on become harmless padding: scratch slot, scratch block, position 0."""
        for buffer in (self.token_ids, self.positions, self.context_lens):
            buffer[start:].zero_()
        self.slots[start:] = self.cache.scratch_slot
        self.block_tables[start:] = self.cache.scratch_block
        self.slot_mapping[start:] = self.cache.scratch_block * self.cache.block_size

    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            batch = self.batches[size]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up lazily built tensors and kernels outside the capture
                    self.model(batch, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(batch, self.cache)
            pool = graph.pool()
            self.graphs[size] = graph

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode_only
            and batch.num_requests <= self.max_batch
            and batch.block_tables.shape[1] <= self.block_tables.shape[1]
            and batch.logits_rows.shape[0] == batch.num_requests
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only batch (valid until the next call)."""
        n = batch.num_requests
        size = next(s for s in self.sizes if s >= n)
        self.token_ids[:n].copy_(batch.token_ids)
        self.positions[:n].copy_(batch.positions)
        self.context_lens[:n].copy_(batch.context_lens_tensor)
        self.slots[:n].copy_(batch.slots)
        width = batch.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.block_tables[:n, width:] = -1
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        for index, buffer in (self.ple_embeddings or {}).items():
            buffer[:n].copy_(batch.ple_embeddings[index])
        self._pad_from(n)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self.forward(self.batches[size], self.cache)[:n]
