"""Pooled per-request state of a Qwen4-Exp model, allocated once and addressed by slot and block.

Two kinds of memory, matching the two kinds of layer:
- Recurrent state, one slot per running request (`state slots`): the GDN conv window (last Kc-1 inputs)
  and fp32 recurrent state, the PLE short-conv history (last (Kp-1)*ngram_size values) and the n-gram
  token context (last ngram_size-1 ids, EOS-padded at the start of a request), and per QSA layer the raw
  indexer keys of the open compression group (at most R-1 rows; the ring).
- Paged QSA memory in fixed-size blocks (`blocks`): main K and V rows, and one compressed indexer key
  per complete group of R tokens (normalised, roped at the group start), so that decode reads
  ceil(p/R) small keys instead of p raw ones. block_size must be a multiple of R.
The layers see only their own `LayerState`; who owns which slot or block is the engine's business.

One extra slot and one extra block (`scratch_slot`, `scratch_block`) are never handed out: padded rows
of a fixed-size decode batch (CUDA graphs) and writes that a static-shape path must make unconditionally
(an indexer key of a block not yet complete) land there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.config import ModelConfig
from tierlm.kernels.qsa_row_cache import QSARowCache
from tierlm.memory.host_pool import allocate_pools
from tierlm.model.qsa_offload import ROW_CACHE_MAX_BATCH, OffloadedKV


@dataclass
class LayerState:
    """The pools one decoder layer reads and writes (unused fields are None)."""

    gdn_conv: torch.Tensor | None = None  # [S, C, Kc-1]
    gdn_recurrent: torch.Tensor | None = None  # [S, nv, dk, dv] fp32
    ple_conv: torch.Tensor | None = None  # [S, hc*H, (Kp-1)*ngram_size]
    key_cache: torch.Tensor | None = None  # [num_blocks, block_size, nkv, hd]
    value_cache: torch.Tensor | None = None  # [num_blocks, block_size, nkv, hd]
    index_keys: torch.Tensor | None = None  # [num_blocks, block_size // R, index_head_dim]
    index_ring: torch.Tensor | None = None  # [S, R, index_head_dim] raw keys of the open group
    block_size: int = 0
    scratch_block: int = 0
    offload: object | None = None  # an OffloadedKV when key/value_cache are host pools
    # CUDA, device pools: a one-slot row cache never planned, so that decode reads the pools with the
    # attention kernel host pools use (the same numerics: offload changes no bit of the output)
    empty_row_cache: QSARowCache | None = None


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
    ) -> None:
        """kv_offload: QSA K/V in exactly sized host pools (pinned on CUDA) instead of device memory, with
        a device arena of `arena_rows` rows per layer that stages prefill reads and, at decode, caches
        recently read rows for batches of up to `row_cache_max_batch` requests unless `row_cache` is False
        (see `qsa_offload`)."""
        c = config
        if c.has_qsa and block_size % c.indexer_compress_ratio:
            raise ValueError(
                f"block_size {block_size} must be a multiple of indexer_compress_ratio {c.indexer_compress_ratio}"
            )
        self.config, self.num_slots, self.num_blocks, self.block_size = c, num_slots, num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.scratch_slot, self.scratch_block = num_slots, num_blocks
        num_slots, num_blocks = num_slots + 1, num_blocks + 1
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        alloc = dict(dtype=dtype, device=self.device)
        kv_shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        qsa_layers = [i for i, t in enumerate(c.layer_types) if t == "indexed_attention"]
        pools = {}
        if kv_offload and qsa_layers:
            pools = allocate_pools(
                {f"layer{i}.{kind}": (kv_shape, dtype) for i in qsa_layers for kind in ("keys", "values")},
                pin=self.device.type == "cuda",
            )
        self.layers: list[LayerState] = []
        for layer_idx, layer_type in enumerate(c.layer_types):
            state = LayerState(block_size=block_size, scratch_block=self.scratch_block)
            if layer_type == "linear_attention":
                state.gdn_conv = torch.zeros(num_slots, conv_dim, c.linear_conv_kernel_dim - 1, **alloc)
                state.gdn_recurrent = torch.zeros(
                    num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                    dtype=torch.float32, device=self.device,
                )
            elif pools:
                keys, values = pools[f"layer{layer_idx}.keys"], pools[f"layer{layer_idx}.values"]
                state.key_cache, state.value_cache = keys.tensor, values.tensor
                state.offload = OffloadedKV(keys, values, arena_rows, self.device, row_cache, row_cache_max_batch)
            else:
                state.key_cache = torch.zeros(kv_shape, **alloc)
                state.value_cache = torch.zeros(kv_shape, **alloc)
                if self.device.type == "cuda":
                    state.empty_row_cache = QSARowCache(*torch.zeros(2, 1, *kv_shape[2:], **alloc))
            if layer_type == "indexed_attention":
                ratio = c.indexer_compress_ratio
                state.index_keys = torch.zeros(num_blocks, block_size // ratio, c.indexer_head_dim, **alloc)
                state.index_ring = torch.zeros(num_slots, ratio, c.indexer_head_dim, **alloc)
            if c.ple_index(layer_idx) is not None:
                history = (c.ple_conv_kernel_size - 1) * c.ngram_size
                state.ple_conv = torch.zeros(num_slots, c.hc_count * c.hidden_size, history, **alloc)
            self.layers.append(state)
        eos = c.eos_token_id if c.eos_token_id is not None else 0
        self.ngram_context = torch.full((num_slots, max(c.ngram_size - 1, 0)), eos, dtype=torch.int64, device=self.device)

    def copy_slot(self, source: int, target: int) -> None:
        """Copy one slot's recurrent state into another (a prefix-cache checkpoint, or its restore)."""
        for state in self.layers:
            for pool in (state.gdn_conv, state.gdn_recurrent, state.ple_conv, state.index_ring):
                if pool is not None:
                    pool[target].copy_(pool[source])
        self.ngram_context[target].copy_(self.ngram_context[source])

    def reset_row_cache_counters(self) -> None:
        """Zero every offloaded layer's row-cache hit and miss counts (warm-up forwards are not serving)."""
        for state in self.layers:
            if state.offload is not None:
                state.offload.cache.reset_counters()

    def reset_slot(self, slot: int) -> None:
        """Give a slot the state of a request that has seen no tokens yet."""
        for state in self.layers:
            for pool in (state.gdn_conv, state.gdn_recurrent, state.ple_conv):
                if pool is not None:
                    pool[slot].zero_()
        if self.config.eos_token_id is not None:
            self.ngram_context[slot].fill_(self.config.eos_token_id)
