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

from tierlm.model.vision.mrope import MropePositions


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
    # True when logits_rows is every packed row in order (0..N-1): the rows are then taken as they are,
    # with no gather (`wanted_rows`); a static batch says so for its fixed logits_rows (a batch copied with
    # other logits_rows, as dataclasses.replace does, must give it again)
    logits_every_row: bool = False
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
    # speculative verification: per request, the slots that receive its state after each of its rows but
    # the last (whose state goes to its own slot, as always); [] for a request without drafts. The layers
    # with per-request state (GDN, PLE, n-gram context, indexer ring) write these per-position states, so
    # rejecting a draft costs copying one of them into the request's slot: no snapshot, no recompute
    position_slots: list[list[int]] | None = None
    # when every request verifies the same number T of rows: [B, T], its position slots then its own slot
    # (the multi-token decode forms of the layers read this); made from position_slots, or given by a
    # static batch (a CUDA graph's input buffer)
    verify_slots: torch.Tensor | None = None
    # images in a prompt (a VLM): the (t, h, w) M-RoPE position of every row [3, N], and of each request's
    # first token of the indexer group open when the forward begins (token context_len - context_len % R)
    # [3, B] (`model/vision/mrope.py` makes both); None: every row's rotary position is its position
    mrope_positions: torch.Tensor | None = None
    mrope_group_starts: torch.Tensor | None = None
    # the vision tower's features [K, H] that replace the embeddings of packed rows image_rows [K] (image
    # placeholder tokens, whose ids still feed the PLE n-gram hash)
    image_features: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.mrope_positions is None) != (self.mrope_group_starts is None):
            raise ValueError("mrope_positions and mrope_group_starts: give both or neither")
        if (self.image_features is None) != (self.image_rows is None):
            raise ValueError("image_features and image_rows: give both or neither")
        device = self.token_ids.device
        if self.slots is None:
            self.slots = on_device(self.state_slots, device)
        if self.context_lens_tensor is None:
            self.context_lens_tensor = on_device(self.context_lens, device)
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.bounds = list(itertools.pairwise(starts))
        if self.position_slots is not None:
            if len(self.position_slots) != len(self.query_lens) or any(
                    slots and len(slots) != n - 1 for slots, n in zip(self.position_slots, self.query_lens)):
                raise ValueError("position_slots: one list per request, empty or one slot per row but the last")
            width = self.query_lens[0] if self.query_lens else 0
            uniform = all(n == width and slots for slots, n in zip(self.position_slots, self.query_lens))
            if self.verify_slots is None and width > 1 and uniform:
                self.verify_slots = on_device(
                    [[*slots, own] for slots, own in zip(self.position_slots, self.state_slots)], device)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with its tensors on `device` (a pipeline rank's copy of rank 0's batch)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return ForwardBatch(**moved)

    def verify_row_tables(self) -> torch.Tensor:
        """A verification batch's block tables one per row [B*T, W] (request i's table T times): a copy, so a
        forward makes it once for all its QSA layers (`Rope.verify_row_tables`), not once per layer."""
        return self.block_tables.repeat_interleave(self.verify_slots.shape[1], dim=0)

    def verify_rows(self, row_tables: torch.Tensor) -> ForwardBatch:
        """A verification batch's rows as one-token requests (row t of request i at its position, with its
        block table, from row_tables (`verify_row_tables`), and its slot verify_slots[i, t]): what the QSA
        layers' decode path runs on. Made anew by each call (a static batch's buffers change between its
        forwards)."""
        width = self.verify_slots.shape[1]
        return ForwardBatch(
            token_ids=self.token_ids, positions=self.positions,
            context_lens=[context + t for context in self.context_lens for t in range(width)],
            query_lens=[1] * self.token_ids.shape[0],
            state_slots=[s for after, own in zip(self.position_slots, self.state_slots) for s in (*after, own)],
            block_tables=row_tables, slot_mapping=self.slot_mapping,
            logits_rows=self.logits_rows, logits_every_row=self.logits_every_row, slots=self.verify_slots.flatten(),
            context_lens_tensor=self.positions, static=self.static,
        )

    def wanted_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Of a tensor of every packed row [N, ...], the rows `logits_rows` names (all: `rows` itself)."""
        return rows if self.logits_every_row else rows[self.logits_rows]

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
        position_slots: list[list[int]] | None = None,
        mrope: list[MropePositions | None] | None = None,
        compress_ratio: int = 1,
    ) -> ForwardBatch:
        """Assemble the metadata for requests whose next `chunks[i]` tokens are computed now.

        logits: "last" (one row per request, its last token), "all" (every packed row) or explicit rows.
        position_slots: speculative verification's per-position state slots (see the field).
        mrope: per request, the M-RoPE positions of a prompt with images (None: a text request); with
        compress_ratio (the QSA indexer's R) they give `mrope_positions` and `mrope_group_starts`.
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
            logits_every_row=logits_rows == list(range(total)),
            position_slots=position_slots,
            **(_mrope_fields(mrope, chunks, context_lens, compress_ratio, device) if mrope else {}),
        )


def _mrope_fields(
    mrope: list[MropePositions | None], chunks: list[list[int]], context_lens: list[int], ratio: int, device
) -> dict[str, torch.Tensor]:
    rows, group_starts = [], []
    for layout, chunk, context in zip(mrope, chunks, context_lens):
        layout = layout or MropePositions.text()
        rows.append(layout.span(context, context + len(chunk)))
        group_starts.append(layout.span(context - context % ratio, context - context % ratio + 1))
    return {
        "mrope_positions": torch.cat(rows, dim=1).to(device),
        "mrope_group_starts": torch.cat(group_starts, dim=1).to(device),
    }
