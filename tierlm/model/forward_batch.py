"""What one model forward computes: packed tokens of several requests at different positions.

Requests are packed without padding (varlen): tokens of request i occupy rows cu_seqlens[i]:cu_seqlens[i+1].
Each request names its recurrent-state slot and its QSA block table in the `ModelCache` pools; the caller
(the engine) owns the allocation, the model only reads and writes the slots and blocks it is given.
Host lists reach the device through `on_device`, which never waits for the kernels already queued.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch


def on_device(values: list, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list as a tensor on `device`; on CUDA through pinned memory without waiting for the stream
    (a plain `torch.tensor(..., device=cuda)` waits for every queued kernel, which would stall overlap)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64, packed
    positions: torch.Tensor  # [N] int64, absolute position of each token in its request
    context_lens: list[int]  # per request: tokens already in the cache before this forward
    query_lens: list[int]  # per request: tokens in this forward
    state_slots: list[int]  # per request: slot in the recurrent-state pools
    block_tables: torch.Tensor  # [B, max_blocks] int64 physical block ids (-1 past the end)
    slot_mapping: torch.Tensor  # [N] int64 physical K/V row (block * block_size + offset) of each token
    logits_rows: torch.Tensor  # [M] int64 packed rows whose logits are wanted
    bounds: list[tuple[int, int]] = field(init=False)
    # the per-request lists as tensors on the batch's device (what decode paths index with); given
    # explicitly only by a static batch whose tensors are a CUDA graph's input buffers
    slots: torch.Tensor | None = None
    context_lens_tensor: torch.Tensor | None = None
    # True for the fixed-shape decode batches of `static_decode`: layers must then take their
    # sync-free forms (no host reads of tensor values), which CUDA graphs and torch.compile need
    static: bool = False
    # PLE embeddings gathered by the host from memory-mapped tables (the NVMe tier), per PLE index:
    # [N, ple_embed_dim]; None: the PLE layers read their in-memory tables
    ple_embeddings: dict[int, torch.Tensor] | None = None
    # pipeline parallel: the multi-stream residual [N, hc_count * hidden] from the previous stage (None on
    # the first stage, which embeds the tokens)
    stage_input: torch.Tensor | None = None

    def __post_init__(self) -> None:
        device = self.token_ids.device
        if self.slots is None:
            self.slots = on_device(self.state_slots, device)
        if self.context_lens_tensor is None:
            self.context_lens_tensor = on_device(self.context_lens, device)
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.bounds = list(itertools.pairwise(starts))

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with its tensors on `device` (a pipeline rank's copy of rank 0's batch)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return ForwardBatch(**moved)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        context_lens: list[int],
        state_slots: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        logits: str | list[int] = "last",
    ) -> ForwardBatch:
        """Assemble the metadata for requests whose next `chunks[i]` tokens are computed now.

        logits: "last" (one row per request, its last token), "all" (every packed row) or explicit rows.
        """
        positions, slots, last_rows = [], [], []
        row = 0
        for chunk, ctx, table in zip(chunks, context_lens, block_tables):
            for p in range(ctx, ctx + len(chunk)):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            row += len(chunk)
            last_rows.append(row - 1)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [-1] * (width - len(t)) for t in block_tables]
        total = sum(len(c) for c in chunks)
        if isinstance(logits, list):
            logits_rows = logits
        else:
            logits_rows = list(range(total)) if logits == "all" else last_rows
        return cls(
            token_ids=on_device([t for c in chunks for t in c], device),
            positions=on_device(positions, device),
            context_lens=list(context_lens),
            query_lens=[len(c) for c in chunks],
            state_slots=list(state_slots),
            block_tables=on_device(padded, device).reshape(len(chunks), width),
            slot_mapping=on_device(slots, device),
            logits_rows=on_device(logits_rows, device),
        )
