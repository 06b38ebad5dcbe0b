"""The PLE n-gram tables as memory-mapped files: the NVMe tier.

A table too large for RAM (95 GiB in the target model) stays a file (`tierlm ple export`), mapped
read-only and shared (MAP_SHARED, PROT_READ: the mapping is the page cache's pages, charged to no
process's commit, so a table larger than RAM + swap maps on any host) with MADV_RANDOM (readahead would
read 23x more than the 320-byte rows need). Each step's rows are computed on the host from the
requests' token ids (`ngram_rows_np`), copied from the mapping into a staging buffer (pinned on CUDA;
numpy `take`, since torch tensors over read-only memory are not allowed) and copied to the device; the
model's PLE layers take those embeddings instead of their own table.

Page faults in the gather are synchronous 4 KiB reads at queue depth 1, so the store asks the kernel
for pages ahead of use (`madvise.PageAdvisor`): at admission for a whole prompt (`ngram_prefetch`),
and right before the gather for a freshly sampled token (its rows' first and last pages, one call).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.config import ModelConfig
from tierlm.memory.madvise import PAGE_SIZE, PageAdvisor, page_ranges, resident_fraction, row_pages
from tierlm.memory.ngram_rows_np import NgramHashArrays, carry_context, initial_context, ngram_rows_np
from tierlm.memory.ple_table import PleTableManifest, load_manifest
from tierlm.model.ngram_hash import NgramHashSpec

MADV_RANDOM = 1
TORCH_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,  # fp8: with the manifest's scale
}
# the rows are only copied, never computed on: numpy moves them as integers of the element's width
# (numpy has no bfloat16 or float8), and the staging buffer is viewed the same way
BIT_TYPES = {4: (np.int32, torch.int32), 2: (np.int16, torch.int16), 1: (np.int8, torch.int8)}
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class MappedTable:
    """One PLE layer's table file, mapped."""

    ple_index: int
    hashing: NgramHashArrays
    rows: np.ndarray  # [rows, row_dim] read-only view of the mapping, elements as same-width integers
    dtype: torch.dtype  # what the elements are
    row_bytes: int
    address: int
    length: int
    mapping: mmap.mmap
    scale: float | None = None  # fp8 tables: embeddings = rows * scale


@dataclass
class StoreCounters:
    rows_gathered: int = 0
    pages_advised: int = 0
    gather_seconds: float = 0.0  # time inside gathers (page faults included): what the step waited
    resident_fraction: float = 0.0  # sampled with mincore on a background cadence


class NgramStore:
    def __init__(
        self, directory: str, config: ModelConfig, device: torch.device, force_madvise_fallback: bool = False,
        max_tokens: int = 512,
    ) -> None:
        """max_tokens: the most tokens one gather serves (the engine's max_num_batched_tokens); the staging
        buffers are sized for it here, once, and never grow while serving."""
        self.manifest: PleTableManifest = load_manifest(directory, config)
        self.config = config
        self.device = device
        self.advisor = PageAdvisor(force_fallback=force_madvise_fallback)
        self.counters = StoreCounters()
        self.lock = threading.Lock()  # the advisor and counters are shared with the prefetch thread
        self.tables: list[MappedTable] = []
        # per PLE index, reused (pinned on CUDA), sized at start: (buffer, its integer view for numpy)
        self._staging: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self.max_rows = max_tokens * config.num_ngram_heads
        for entry in self.manifest.layers:
            with open(self.manifest.path(entry), "rb") as f:
                # ACCESS_READ: MAP_SHARED | PROT_READ (no commit charge, unlike a private writable mapping)
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            dtype = TORCH_DTYPES[entry.dtype]
            rows = np.frombuffer(mapping, dtype=BIT_TYPES[dtype.itemsize][0]).reshape(entry.rows, -1)
            address = rows.ctypes.data
            _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(len(mapping)), MADV_RANDOM)
            spec = NgramHashSpec.from_config(config, entry.ple_index)
            self.tables.append(MappedTable(
                entry.ple_index, NgramHashArrays.from_spec(spec), rows, dtype, entry.row_bytes, address,
                len(mapping), mapping, entry.scale,
            ))
            buffer = torch.empty(self.max_rows, rows.shape[1], dtype=dtype, pin_memory=device.type == "cuda")
            self._staging[entry.ple_index] = buffer, buffer.view(BIT_TYPES[dtype.itemsize][1]).numpy()
        self.initial_context = initial_context(NgramHashSpec.from_config(config, self.tables[0].ple_index))

    # ---- rows ---------------------------------------------------------------------------------------
    def rows_for(self, context: np.ndarray, chunk: np.ndarray) -> list[np.ndarray]:
        """Per PLE layer, the row ids [T, heads] of `chunk` after `context` (its previous ids)."""
        return [ngram_rows_np(table.hashing, context, chunk) for table in self.tables]

    @property
    def context_len(self) -> int:
        return self.config.ngram_size - 1

    def context_of(self, previous_ids: list[int]) -> np.ndarray:
        """The hash context from the ids just before a chunk (fewer than ngram_size-1 at a request's start:
        the rest is EOS padding)."""
        return carry_context(self.initial_context, np.asarray(previous_ids[-self.context_len :], dtype=np.int64))

    # ---- advice -------------------------------------------------------------------------------------
    def advise_rows(self, rows: list[np.ndarray], merge: bool) -> None:
        """MADV_WILLNEED for the pages of these rows (per layer), in one batch of system calls.

        merge=False (decode): each row's first and last page as given, no sorting: cheaper than a
        generic unique-and-merge for a step's handful of rows.
        """
        starts, lengths = [], []
        for table, layer_rows in zip(self.tables, rows):
            offsets = layer_rows.reshape(-1).astype(np.int64) * table.row_bytes
            if merge:
                first, count = page_ranges(offsets, table.row_bytes)
                starts.append(table.address + first * PAGE_SIZE)
                lengths.append(count * PAGE_SIZE)
            else:
                pages = row_pages(offsets, table.row_bytes)
                starts.append(table.address + pages * PAGE_SIZE)
                lengths.append(np.full(pages.shape, PAGE_SIZE, dtype=np.int64))
        starts, lengths = np.concatenate(starts), np.concatenate(lengths)
        with self.lock:
            self.advisor.advise(starts, lengths)
            self.counters.pages_advised += int(lengths.sum()) // PAGE_SIZE

    # ---- gather -------------------------------------------------------------------------------------
    def gather(self, rows: list[np.ndarray]) -> dict[int, torch.Tensor]:
        """Embeddings per PLE index: [T, heads * row_dim] on the device, rows read from the mappings."""
        out = {}
        start = time.perf_counter()
        for table, layer_rows in zip(self.tables, rows):
            index = layer_rows.reshape(-1)
            staged, staged_bits = self._staging_for(table, index.size)
            # mode="clip" copies straight into `out` (mode="raise" goes through a temporary); the rows
            # come from the hash modulo the table size, in range by construction
            np.take(table.rows, index, axis=0, out=staged_bits, mode="clip")
            # a blocking copy: the staging buffer is reused by the next gather
            embeddings = staged.to(self.device).view(layer_rows.shape[0], -1)
            out[table.ple_index] = embeddings if table.scale is None else embeddings.float() * table.scale
        with self.lock:
            self.counters.gather_seconds += time.perf_counter() - start
            self.counters.rows_gathered += sum(r.size for r in rows)
        return out

    def _staging_for(self, table: MappedTable, count: int) -> tuple[torch.Tensor, np.ndarray]:
        """The first `count` rows of the table's staging buffer, and the same memory as numpy integers."""
        if count > self.max_rows:
            raise ValueError(f"a gather of {count} rows exceeds the staging buffer's {self.max_rows} "
                             f"(max_tokens x {self.config.num_ngram_heads} heads)")
        buffer, bits = self._staging[table.ple_index]
        return buffer[:count], bits[:count]

    def sample_residency(self) -> float:
        """Update and return the share of table pages in memory (mincore on a page sample)."""
        total = sum(t.length for t in self.tables)
        fraction = sum(resident_fraction(t.address, t.length) * t.length for t in self.tables) / total
        self.counters.resident_fraction = fraction
        return fraction


def find_table_dir(model_dir: str, explicit: str | None) -> str | None:
    """The table folder: given explicitly, or `ple_tables/` inside the model folder if it has a manifest."""
    if explicit:
        return explicit
    candidate = os.path.join(model_dir, "ple_tables")
    return candidate if os.path.exists(os.path.join(candidate, "manifest.json")) else None
