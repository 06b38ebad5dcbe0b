"""Pooled per-request state of a Qwen4-Exp model, allocated once and addressed by slot and block.

Each decoder layer gets a `LayerCaches` of the typed caches its kind needs (`model/cache/`):
- linear_attention: `GDNState`, per slot the conv window (last Kc-1 inputs) and fp32 recurrent state;
- indexed_attention: K/V rows paged in blocks (`QSADeviceKV` on the device, or `OffloadedKV` in host
  pools with a VRAM row cache) and the `QSAIndexerState` (per slot the raw keys of the open compression
  group; paged, one compressed key per complete group of R tokens). block_size must be a multiple of R;
- a PLE layer also a `PLEState`, per slot the short-conv history (last (Kp-1)*ngram_size values);
and the model one `NgramContextState` (last ngram_size-1 token ids, EOS at a request's start).
An MTP draft head's layers (`draft_layers`) get QSA caches of their own, paged with the same block ids
and slots as the target's (a draft row has its target row's position); their indexer rings are slot
states like the others, so prefix-cache checkpoints carry them.
The layers see only their own caches; who owns which slot or block is the engine's business.

Slots are for running requests. Prefix-cache checkpoints (copies of a slot at a block boundary) live in
host RAM (`HostCheckpoints`): `save_checkpoint` / `restore_checkpoint` move a slot there and back. On
CUDA one more slot (`staging_slot`) holds the copy of a slot whose save is still crossing PCIe.

One extra slot and one extra block (`scratch_slot`, `scratch_block`) are never handed out: padded rows
of a fixed-size decode batch (CUDA graphs) and writes that a static-shape path must make unconditionally
(an indexer key of a block not yet complete) land there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.config import ModelConfig
from tierlm.memory.host_pool import allocate_pools
from tierlm.model.cache import (
    GDNState,
    HostCheckpoints,
    NgramContextState,
    PLEState,
    QSADeviceKV,
    QSAIndexerState,
)
from tierlm.model.cache.slot_state import SlotState
from tierlm.model.qsa_offload import ROW_CACHE_MAX_BATCH, OffloadedKV


@dataclass
class LayerCaches:
    """The caches of one decoder layer (None where its kind has none)."""

    gdn: GDNState | None = None
    ple: PLEState | None = None
    kv: QSADeviceKV | OffloadedKV | None = None
    indexer: QSAIndexerState | None = None

    # the pools by flat name, for tests and tools that compare them
    @property
    def gdn_conv(self) -> torch.Tensor | None:
        return self.gdn.conv if self.gdn else None

    @property
    def gdn_recurrent(self) -> torch.Tensor | None:
        return self.gdn.recurrent if self.gdn else None

    @property
    def ple_conv(self) -> torch.Tensor | None:
        return self.ple.conv if self.ple else None

    @property
    def index_ring(self) -> torch.Tensor | None:
        return self.indexer.ring if self.indexer else None

    @property
    def index_keys(self) -> torch.Tensor | None:
        return self.indexer.keys if self.indexer else None

    @property
    def key_cache(self) -> torch.Tensor | None:
        return self.kv.key_cache if self.kv else None

    @property
    def value_cache(self) -> torch.Tensor | None:
        return self.kv.value_cache if self.kv else None

    @property
    def offload(self) -> OffloadedKV | None:
        """The layer's host-pool K/V (None when they are on the device)."""
        return self.kv if isinstance(self.kv, OffloadedKV) else None


class ModelCache:
    """All state pools of one model, sized at construction and never reallocated."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_offload: bool = False,
        arena_rows: int = 0,
        row_cache: bool = True,
        row_cache_max_batch: int = ROW_CACHE_MAX_BATCH,
        num_host_checkpoints: int = 0,
        layer_ids: tuple[int, ...] | None = None,
        num_draft_layers: int = 0,
    ) -> None:
        """kv_offload: QSA K/V in exactly sized host pools (pinned on CUDA) instead of device memory, with
        a device arena of `arena_rows` rows per layer that stages prefill reads and, at decode, caches
        recently read rows for batches of up to `row_cache_max_batch` requests unless `row_cache` is False
        (see `qsa_offload`). num_host_checkpoints: rows of the host checkpoint pool (0: none).
        layer_ids: the decoder layers whose caches this holds (one pipeline rank's; default all): `layers`
        has one entry per id, in order. num_draft_layers: the MTP draft head's layers (`draft_layers`; 0:
        no draft head)."""
        c = config
        if num_draft_layers and not c.has_qsa:
            raise ValueError("MTP draft layers are QSA layers: the config needs the indexer_* fields")
        if c.has_qsa and block_size % c.indexer_compress_ratio:
            raise ValueError(
                f"block_size {block_size} must be a multiple of indexer_compress_ratio {c.indexer_compress_ratio}"
            )
        self.config, self.num_slots, self.num_blocks, self.block_size = c, num_slots, num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.scratch_slot, self.scratch_block = num_slots, num_blocks
        staging = num_host_checkpoints > 0 and self.device.type == "cuda"
        self.staging_slot = num_slots + 1 if staging else None
        num_slots, num_blocks = num_slots + 1 + staging, num_blocks + 1
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        alloc = {"dtype": dtype, "device": self.device}
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        layer_ids = tuple(range(c.num_hidden_layers)) if layer_ids is None else tuple(layer_ids)
        draft_names = [f"mtp{k}" for k in range(num_draft_layers)]
        qsa_names = [f"layer{i}" for i in layer_ids if c.layer_types[i] == "indexed_attention"] + draft_names
        pools = {}
        if kv_offload and qsa_names:
            pools = allocate_pools(
                {f"{name}.{kind}": (kv_shape, dtype) for name in qsa_names for kind in ("keys", "values")},
                pin=self.device.type == "cuda",
            )

        def qsa_caches(name: str) -> LayerCaches:
            if pools:
                kv = OffloadedKV(pools[f"{name}.keys"], pools[f"{name}.values"], arena_rows, self.device, row_cache,
                                 row_cache_max_batch)
            else:
                kv = QSADeviceKV(torch.zeros(kv_shape, **alloc), torch.zeros(kv_shape, **alloc))
            ratio = c.indexer_compress_ratio
            indexer = QSAIndexerState(
                torch.zeros(num_slots, ratio, c.indexer_head_dim, **alloc),
                torch.zeros(num_blocks, block_size // ratio, c.indexer_head_dim, **alloc),
                block_size, self.scratch_block,
            )
            return LayerCaches(kv=kv, indexer=indexer)

        self.layers: list[LayerCaches] = []
        for layer_idx in layer_ids:
            layer_type = c.layer_types[layer_idx]
            if layer_type == "linear_attention":
                caches = LayerCaches(gdn=GDNState(
                    torch.zeros(num_slots, conv_dim, c.linear_conv_kernel_dim - 1, **alloc),
                    torch.zeros(num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                dtype=torch.float32, device=self.device),
                ))
            else:
                caches = qsa_caches(f"layer{layer_idx}")
            if c.ple_index(layer_idx) is not None:
                history = (c.ple_conv_kernel_size - 1) * c.ngram_size
                caches.ple = PLEState(torch.zeros(num_slots, c.hc_count * c.hidden_size, history, **alloc))
            self.layers.append(caches)
        # the MTP draft head's layers: QSA caches of their own, paged and slotted like the target's
        self.draft_layers: list[LayerCaches] = [qsa_caches(name) for name in draft_names]
        eos = c.eos_token_id if c.eos_token_id is not None else 0
        self.ngram_context = torch.full((num_slots, max(c.ngram_size - 1, 0)), eos, dtype=torch.int64, device=self.device)
        def states(layers: list[LayerCaches]) -> list[SlotState]:
            kinds = ((caches.gdn, caches.ple, caches.indexer) for caches in layers)
            return [state for states_of_layer in kinds for state in states_of_layer if state is not None]

        # what a target forward writes per slot (speculative verification keeps these per position), and
        # what the draft head's layers do
        self.target_slot_states: list[SlotState] = [
            *states(self.layers), NgramContextState(self.ngram_context, c.eos_token_id)]
        self.draft_slot_states: list[SlotState] = states(self.draft_layers)
        self.slot_states: list[SlotState] = self.target_slot_states + self.draft_slot_states
        self.checkpoints = HostCheckpoints(
            self.slot_states, num_host_checkpoints, self.device, self.staging_slot
        ) if num_host_checkpoints else None

    @property
    def slot_bytes(self) -> int:
        """One request's state over every layer (what a checkpoint copies)."""
        return sum(state.slot_bytes for state in self.slot_states)

    @property
    def offloaded(self) -> list[OffloadedKV]:
        """The host-pool K/V of every offloaded QSA layer, the draft head's included."""
        return [caches.offload for caches in self.layers + self.draft_layers if caches.offload is not None]

    def reset_row_cache_counters(self) -> None:
        """Zero every offloaded layer's row-cache hit and miss counts (warm-up forwards are not serving)."""
        for kv in self.offloaded:
            kv.cache.reset_counters()

    def reset_slot(self, slot: int) -> None:
        """Give a slot the state of a request that has seen no tokens yet."""
        for state in self.slot_states:
            state.reset_slot(slot)

    def copy_target_states(self, sources: list[int], targets: list[int]) -> None:
        """The target layers' states of slot sources[i] into slot targets[i] (speculative decoding's rollback
        `SpeculativeRunner._restore` where no graph is prepared; the pipeline's ranks replay it:
        `engine/pipeline_speculative.py`)."""
        if not sources:
            return
        sources, targets = (torch.tensor(x, dtype=torch.int64, device=self.device) for x in (sources, targets))
        for state in self.target_slot_states:
            state.copy_slots(sources, targets)

    def save_checkpoint(self, slot: int, index: int) -> None:
        """The slot's state into host checkpoint `index` (asynchronous on CUDA)."""
        self.checkpoints.save(slot, index)

    def restore_checkpoint(self, index: int, slot: int) -> None:
        """Host checkpoint `index` into the slot."""
        self.checkpoints.restore(index, slot)
