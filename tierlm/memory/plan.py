"""Capacity planning: how each memory tier's budget splits into blocks, slots, arenas and pools.

One pure function (`plan_cache`) turns a config, the engine settings and the byte budgets into a
`CachePlan`; the engine sizes its pools from it and logs `plan.lines()` at start-up, and `tierlm plan`
prints the same lines from config.json alone, without loading weights.

Where the bytes go (per layer type):
- indexed_attention (QSA): per token K and V rows plus one compressed indexer key per R tokens (paged,
  in blocks of block_size tokens); per request the raw indexer keys of the open block (the ring).
- linear_attention (GDN): per request the conv window (Kc-1 inputs) and the fp32 recurrent state.
- PLE: per request the dilated conv history ((Kp-1) * ngram_size values); the model keeps ngram_size-1
  token ids per request.
A state slot holds one request's recurrent state for every layer.

The tiers:
- device: the weights (reported, per storage format: quantized modules at their packed size), one state slot per running request (+1 scratch, and on CUDA with
  prefix caching +1 that checkpoint saves pass through on their way to host RAM), the QSA device rows
  (indexer keys, and K/V unless offloaded), with offload each QSA layer's arena (prefill staging and
  decode row cache; a byte budget, `--qsa-row-cache-bytes`, default the seed's 95 MiB per GPU). An
  explicit --kv-cache-memory-bytes sizes the cache alone (slots and rows, as vLLM's flag sizes its KV
  cache) and the arena comes beside it; a budget from --gpu-memory-utilization holds the arena too.
- host RAM (pinned on CUDA): offloaded QSA K/V pools, and the prefix-cache checkpoints (a slot's copy
  each, LRU; `--checkpoint-host-bytes`); what is left of the host budget is page cache, which the
  mapped PLE tables need (reported against their size).
With QSA K/V offloaded (--qsa-kv-offload, or auto on CUDA when the device alone is short) the number of
blocks is bounded by both memories.

`layer_ids` plans the layers one pipeline rank holds (default: all of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tierlm.config import ModelConfig
from tierlm.memory.host_pool import available_ram_bytes

ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SPEC_DTYPE_BYTES = {"int32": 4, "int64": 8, "float8_e4m3fn": 1, "float32": 4}
DEFAULT_CPU_MEMORY_FRACTION = 0.1  # of available RAM, when no --gpu-memory-utilization is given on CPU
DEFAULT_ROW_CACHE_BYTES = 95 << 20  # the seed's row-cache arena per GPU
CHECKPOINT_ALIGN = 8  # a host checkpoint row is padded to this (see model/cache/host_checkpoints.py)


def weight_bytes(
    config: ModelConfig, dtype: str, quantization=None, ple_mapped: bool = False,
    layer_ids: tuple[int, ...] | None = None, stage=None, mtp=None,
) -> dict[str, int]:
    """Bytes of the model's weights in memory per format label (`dense`: the model dtype; int64 hash
    buffers at 8 bytes), the quantized modules counted by their packed runtime tensors; without the PLE
    tables when they are mapped files; with layer_ids only those decoder layers (and every tensor outside
    the layers); with stage (a pipeline rank's `StageLayout`) only the tensors that rank holds; with mtp
    (an `MTPLayout`: speculative decoding loads the draft head) the draft head's too, and the copy of its
    lm_head's rows a reduced draft vocabulary makes (`draft_vocab_rows`, in the head's format)."""
    from tierlm.model.checkpoint_layout import VISION_PREFIX, checkpoint_layout, weight_module
    from tierlm.model.quantization.base import DENSE

    totals: dict[str, int] = {}
    # the draft head's lm_head: its own, or the target's (held as the embedding when tied)
    draft_head = None if mtp is None or not mtp.draft_vocab_rows else (
        "mtp.shared_head.head.weight" if mtp.shared_head else
        "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    ids = None if layer_ids is None else set(layer_ids)
    ple_fp8 = config.extra.get("ple_embedding_dtype") == "float8_e4m3fn"  # vLLM's config field
    for spec in checkpoint_layout(config, ple_fp8=ple_fp8, mtp=mtp):
        parts = spec.name.split(".")
        if (ple_mapped and spec.kind == "ple_table") or (
                ids is not None and parts[:2] == ["model", "layers"] and int(parts[2]) not in ids):
            continue
        if stage is not None and not stage.holds(spec.name):
            continue
        module = weight_module(spec)
        quantized = module and quantization is not None and not spec.name.startswith(VISION_PREFIX)  # ViT: dense
        fmt = quantization.format_of(*module) if quantized else DENSE
        if fmt == DENSE:
            item = SPEC_DTYPE_BYTES[spec.dtype] if spec.dtype else 8 if spec.kind == "int64" else ITEM_BYTES[dtype]
            nbytes = math.prod(spec.shape) * item
        else:
            nbytes = sum(
                math.prod(t.shape) * (t.dtype.itemsize if t.dtype is not None else ITEM_BYTES[dtype])
                for t in fmt.runtime_tensors(*spec.shape).values()
            )
        totals[fmt.label] = totals.get(fmt.label, 0) + nbytes
        if spec.name == draft_head:
            totals[fmt.label] += nbytes * mtp.draft_vocab_rows // spec.shape[0]
    return totals


class CapacityError(ValueError):
    """A budget that cannot hold even one request of max_model_len."""


@dataclass(frozen=True)
class LayerBytes:
    layer_type: str
    layers: int
    per_token: float  # per layer
    per_request: int  # per layer
    detail: str


def _layer_types(config: ModelConfig, layer_ids: tuple[int, ...] | None) -> list[str]:
    ids = range(config.num_hidden_layers) if layer_ids is None else layer_ids
    return [config.layer_types[i] for i in ids]


def _ple_layers(config: ModelConfig, layer_ids: tuple[int, ...] | None) -> int:
    ids = range(config.num_hidden_layers) if layer_ids is None else layer_ids
    return sum(1 for i in ids if config.ple_index(i) is not None)


def layer_bytes(config: ModelConfig, dtype: str, layer_ids: tuple[int, ...] | None = None) -> list[LayerBytes]:
    item = ITEM_BYTES[dtype]
    c = config
    types = _layer_types(c, layer_ids)
    out = []
    qsa_layers = types.count("indexed_attention")
    if qsa_layers:
        kv = 2 * c.num_key_value_heads * c.head_dim * item
        index_key = c.indexer_head_dim * item / c.indexer_compress_ratio
        ring = c.indexer_compress_ratio * c.indexer_head_dim * item
        out.append(LayerBytes(
            "indexed_attention", qsa_layers, kv + index_key, ring,
            f"K/V {kv:,} + index key {index_key:g} per token; index ring {ring:,} per request",
        ))
    gdn_layers = types.count("linear_attention")
    if gdn_layers:
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        conv = conv_dim * (c.linear_conv_kernel_dim - 1) * item
        state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        out.append(LayerBytes(
            "linear_attention", gdn_layers, 0, conv + state, f"conv window {conv:,} + fp32 state {state:,} per request"
        ))
    ple_layers = _ple_layers(c, layer_ids)
    if ple_layers:
        history = c.hc_count * c.hidden_size * (c.ple_conv_kernel_size - 1) * c.ngram_size * item
        out.append(LayerBytes("ple", ple_layers, 0, history, f"conv history {history:,} per request"))
    return out


def slot_bytes(config: ModelConfig, dtype: str, layer_ids: tuple[int, ...] | None = None) -> int:
    """One request's state over the layers (plus the model's n-gram context ids, int64)."""
    total = sum(lb.layers * lb.per_request for lb in layer_bytes(config, dtype, layer_ids))
    return total + 8 * max(config.ngram_size - 1, 0)


def checkpoint_bytes(config: ModelConfig, dtype: str, layer_ids: tuple[int, ...] | None = None) -> int:
    """One prefix-cache checkpoint in host RAM: a slot, padded to CHECKPOINT_ALIGN bytes."""
    return -(-slot_bytes(config, dtype, layer_ids) // CHECKPOINT_ALIGN) * CHECKPOINT_ALIGN


def kv_block_bytes(config: ModelConfig, dtype: str, block_size: int, layer_ids: tuple[int, ...] | None = None) -> int:
    """One block's K and V rows over the QSA layers (what offload moves to host RAM)."""
    per_layer = block_size * 2 * config.num_key_value_heads * config.head_dim * ITEM_BYTES[dtype]
    return _layer_types(config, layer_ids).count("indexed_attention") * per_layer


def index_block_bytes(
    config: ModelConfig, dtype: str, block_size: int, layer_ids: tuple[int, ...] | None = None
) -> int:
    """One block's compressed indexer keys over the QSA layers (on the device, offloaded or not)."""
    qsa_layers = _layer_types(config, layer_ids).count("indexed_attention")
    if not qsa_layers:
        return 0
    return qsa_layers * block_size // config.indexer_compress_ratio * config.indexer_head_dim * ITEM_BYTES[dtype]


def arena_row_bytes(config: ModelConfig, dtype: str) -> int:
    """One arena row of one QSA layer: a K row and a V row, and the row cache's tag, hit mark and claim."""
    return 2 * config.num_key_value_heads * config.head_dim * ITEM_BYTES[dtype] + 3 * 8


def arena_bytes(config: ModelConfig, dtype: str, arena_rows: int, layer_ids: tuple[int, ...] | None = None) -> int:
    """The device arenas of offloaded QSA layers: arena_rows rows per layer."""
    return _layer_types(config, layer_ids).count("indexed_attention") * arena_rows * arena_row_bytes(config, dtype)


def arena_rows_for(config: ModelConfig, dtype: str, budget_bytes: int, layer_ids: tuple[int, ...] | None = None) -> int:
    """Rows per QSA layer that an arena byte budget (all QSA layers together) holds."""
    layers = _layer_types(config, layer_ids).count("indexed_attention")
    return budget_bytes // (max(layers, 1) * arena_row_bytes(config, dtype))


def ple_table_bytes(config: ModelConfig, dtype: str, layer_ids: tuple[int, ...] | None = None) -> int:
    """The PLE n-gram tables of the layers (rows x ngram_head_dim each)."""
    from tierlm.model.checkpoint_layout import checkpoint_layout

    ids = set(range(config.num_hidden_layers) if layer_ids is None else layer_ids)
    return sum(math.prod(spec.shape) * ITEM_BYTES[dtype] for spec in checkpoint_layout(config)
               if spec.kind == "ple_table" and int(spec.name.split(".")[2]) in ids)


def aligned_block_size(config: ModelConfig, block_size: int) -> int:
    """Blocks must hold whole compression groups: round up to a multiple of the compress ratio."""
    if config.has_qsa and block_size % config.indexer_compress_ratio:
        return math.lcm(block_size, config.indexer_compress_ratio)
    return block_size


@dataclass(frozen=True)
class CachePlan:
    dtype: str
    block_size: int
    budget_bytes: int
    budget_source: str
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    num_checkpoints: int  # rows of the host checkpoint pool
    checkpoint_bytes: int  # one row
    checkpoint_source: str
    block_bytes: int  # per block on the device: K/V and indexer keys, or with offload the indexer keys alone
    slot_bytes: int
    layers: tuple[LayerBytes, ...]
    kv_offload: bool  # QSA K/V in host pools
    kv_placement: str  # why the K/V are where they are: the flag, or what auto saw
    host_block_bytes: int  # per block in host RAM (0 without offload)
    host_available_bytes: int  # what the host pools may take (the safety margin already taken off)
    host_source: str
    arena_rows: int  # per QSA layer, K and V each, with offload (at most the pool's rows)
    arena_bytes: int  # all QSA layers' arenas, on the device (0 without offload)
    arena_source: str
    arena_in_budget: bool  # the arena comes out of the cache budget (else it is allocated beside it)
    weights_bytes: int  # on the device (reported; mapped PLE tables not included)
    ple_table_bytes: int  # the PLE tables' size
    ple_mapped: bool  # the tables are files mapped from NVMe (served through the page cache)
    prefix_caching: bool
    staging_slots: int  # 1 on CUDA with checkpoints: the slot saves pass through (model/cache/host_checkpoints)
    layer_ids: tuple[int, ...] | None  # one pipeline rank's layers; None: all
    # speculative decoding: the MTP draft head's QSA layers (counted in block_bytes and slot_bytes) and the
    # spare slots for verification's per-position states (K per running request: the state after each
    # verified row but the last, one of which becomes the request's when a draft is rejected)
    num_draft_layers: int = 0
    spare_slots: int = 0

    @property
    def num_slots(self) -> int:
        """Device slots the engine hands out: one per running request (a scratch slot comes on top)."""
        return self.max_num_seqs

    @property
    def device_slots(self) -> int:
        """Every slot in device memory: running, scratch, staging, speculative per-position states."""
        return self.num_slots + 1 + self.staging_slots + self.spare_slots

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def qsa_layers(self) -> int:
        return sum(lb.layers for lb in self.layers if lb.layer_type == "indexed_attention")

    @property
    def requests_at_max_len(self) -> float:
        """Requests of max_model_len that fit at once (blocks and running slots both limit it)."""
        if not self.block_bytes:
            return float(self.max_num_seqs)
        return min(self.tokens / self.max_model_len, float(self.max_num_seqs))

    def used_bytes(self) -> int:
        """Bytes of the cache budget taken: blocks and slots (each with its scratch one), and the arenas
        when they come out of the budget."""
        cache = (self.num_blocks + 1) * self.block_bytes + self.device_slots * self.slot_bytes
        return cache + (self.arena_bytes if self.arena_in_budget else 0)

    def device_bytes(self) -> int:
        """Every device byte the cache allocates: the budget's share and the arenas."""
        return (self.num_blocks + 1) * self.block_bytes + self.device_slots * self.slot_bytes + self.arena_bytes

    def host_kv_bytes(self) -> int:
        """Host RAM of the K/V pools (the scratch block included)."""
        return (self.num_blocks + 1) * self.host_block_bytes

    def host_checkpoint_bytes(self) -> int:
        return self.num_checkpoints * self.checkpoint_bytes

    def host_bytes(self) -> int:
        """Host RAM of every pool: K/V and checkpoints."""
        return self.host_kv_bytes() + self.host_checkpoint_bytes()

    def page_cache_bytes(self) -> int:
        """What the host budget leaves once the pools are allocated (the mapped tables' page cache)."""
        return max(self.host_available_bytes - self.host_bytes(), 0)

    def lines(self) -> list[str]:
        ranks = "" if self.layer_ids is None else f" for layers {self.layer_ids[0]}-{self.layer_ids[-1]}"
        out = [(f"cache plan{ranks}: dtype {self.dtype}, block {self.block_size} tokens, max_model_len "
                f"{self.max_model_len:,}, max_num_seqs {self.max_num_seqs}")]
        for lb in self.layers:
            unit = f"{lb.per_token:,.0f} B/token" if lb.per_token else f"{lb.per_request:,} B/request"
            out.append(f"  {lb.layer_type} x{lb.layers}: {unit} per layer ({lb.detail})")
        mapped = " (PLE tables mapped, not included)" if self.ple_mapped else ""
        out.append(f"device: cache budget {self.budget_bytes:,} B ({self.budget_source}); weights "
                   f"{self.weights_bytes:,} B{mapped}")
        staging = ", +1 checkpoint staging" if self.staging_slots else ""
        staging += f", +{self.spare_slots} speculative per-position states" if self.spare_slots else ""
        if self.num_draft_layers:
            out.append(f"  MTP draft head: {self.num_draft_layers} QSA layer(s), in the block and slot sizes below")
        out.append(f"  state slots: {self.max_num_seqs} running (+1 scratch{staging}) x {self.slot_bytes:,} B = "
                   f"{self.device_slots * self.slot_bytes:,} B")
        if self.block_bytes:
            out += self._qsa_lines()
        beside = "" if self.arena_in_budget or not self.arena_bytes else (
            f" + {self.arena_bytes:,} B of arenas beside it = {self.device_bytes():,} B")
        out.append(f"  allocated: {self.used_bytes():,} B of the budget{beside}")
        out.append(f"host: {self.host_available_bytes:,} B for pools and page cache ({self.host_source})")
        if self.kv_offload:
            out.append(f"  QSA K/V pools: {self.num_blocks + 1:,} blocks (1 scratch) x {self.host_block_bytes:,} B = "
                       f"{self.host_kv_bytes():,} B")
        if self.prefix_caching:
            out.append(f"  prefix-cache checkpoints: {self.num_checkpoints:,} x {self.checkpoint_bytes:,} B = "
                       f"{self.host_checkpoint_bytes():,} B, LRU ({self.checkpoint_source})")
        else:
            out.append("  prefix-cache checkpoints: none (prefix caching off)")
        if self.ple_table_bytes and self.ple_mapped:
            share = self.page_cache_bytes() / self.ple_table_bytes
            out.append(f"  page cache left for the mapped PLE tables: {self.page_cache_bytes():,} B of their "
                       f"{self.ple_table_bytes:,} B ({share:.1%})")
        elif self.ple_table_bytes:
            out.append(f"  PLE tables: {self.ple_table_bytes:,} B in the weights (not mapped)")
        caching = "with prefix caching on" if self.prefix_caching else "prefix caching off"
        out.append(f"capacity: {self.requests_at_max_len:.2f} requests of max_model_len {self.max_model_len:,} "
                   f"at once (max_num_seqs {self.max_num_seqs}), {caching}")
        return out

    def _qsa_lines(self) -> list[str]:
        what = "indexer keys" if self.kv_offload else "K/V and indexer keys"
        rows = (f"  QSA device rows ({what}): {self.num_blocks:,} blocks (+1 scratch) x {self.block_size} tokens = "
                f"{self.tokens:,} tokens, {self.block_bytes:,} B/block = {(self.num_blocks + 1) * self.block_bytes:,} B")
        out = [rows, f"  QSA K/V: {'in host RAM' if self.kv_offload else 'on the device'} ({self.kv_placement})"]
        if self.kv_offload:
            out.append(f"  QSA row-cache arena: {self.arena_rows:,} rows (K and V) per layer x {self.qsa_layers} = "
                       f"{self.arena_bytes:,} B ({self.arena_source}; prefill staging, decode row cache)")
        return out


@dataclass(frozen=True)
class CacheSettings:
    """What a plan is asked for: the engine's settings and the memory each side may use."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    num_checkpoints: int  # host checkpoint rows (0: prefix caching off)
    budget_bytes: int  # device
    budget_source: str
    kv_offload: bool | None  # QSA K/V in host pools; None: auto
    device_type: str
    arena_rows: int  # with offload, per QSA layer
    host_available_bytes: int  # for the host pools, the safety margin already taken off
    host_source: str
    arena_source: str = "--qsa-row-cache-rows"
    arena_in_budget: bool = True
    checkpoint_source: str = "--max-state-checkpoints"
    weights_bytes: int = 0
    ple_mapped: bool = False
    prefix_caching: bool = True
    layer_ids: tuple[int, ...] | None = None
    num_draft_layers: int = 0  # speculative decoding: the MTP draft head's QSA layers
    spare_slots: int = 0  # speculative decoding: slots for the per-position states (K per running request)


def plan_cache(config: ModelConfig, dtype: str, settings: CacheSettings) -> CachePlan:
    """Split the budgets: on the device a slot per running request first, the rest into blocks; in host
    RAM the checkpoints first, the rest (offload) into K/V pools.

    Blocks are capped at twice what max_num_seqs requests of max_model_len can use (the second half
    serves the prefix cache), so a large budget is not spent on blocks nothing can reach.

    kv_offload None (auto) offloads the QSA K/V only on CUDA (on CPU host RAM is the device memory),
    and only when the device alone holds fewer than max_num_seqs requests of max_model_len and the
    offloaded plan holds more blocks: auto never plans less than the device alone would.
    """
    settings = replace(settings, block_size=aligned_block_size(config, settings.block_size))
    seqs = settings.max_num_seqs
    if settings.kv_offload is not None:
        flag = "--qsa-kv-offload" if settings.kv_offload else "--no-qsa-kv-offload"
        return _split(config, dtype, settings, settings.kv_offload, flag)
    if settings.device_type != "cuda":
        return _split(config, dtype, settings, False, f"auto: off on {settings.device_type}")
    try:
        on_device = _split(config, dtype, settings, False,
                           f"auto: the device holds max_num_seqs {seqs} requests of max_model_len")
    except CapacityError:
        return _split(config, dtype, settings, True, "auto: the device alone cannot hold one request of max_model_len")
    if on_device.requests_at_max_len >= seqs:
        return on_device
    short = (f"auto: the device alone holds {on_device.requests_at_max_len:.2f} of max_num_seqs {seqs} "
             "requests of max_model_len")
    try:
        offloaded = _split(config, dtype, settings, True, short)
    except CapacityError:
        return replace(on_device, kv_placement=f"{short}; offloaded they would not fit")
    if offloaded.num_blocks <= on_device.num_blocks:
        return replace(on_device, kv_placement=f"{short}; offloaded they would hold no more")
    return offloaded


def _split(config: ModelConfig, dtype: str, s: CacheSettings, kv_offload: bool, kv_placement: str) -> CachePlan:
    """The plan for one placement of the QSA K/V; CapacityError when one request does not fit."""
    ids = s.layer_ids
    kv_offload = kv_offload and config.has_qsa
    kv_block, index_block = kv_block_bytes(config, dtype, s.block_size, ids), index_block_bytes(
        config, dtype, s.block_size, ids)
    one_slot = slot_bytes(config, dtype, ids)
    one_checkpoint = checkpoint_bytes(config, dtype, ids)
    if s.num_draft_layers:  # each draft layer: one QSA layer's K/V, indexer keys and ring (no PLE)
        draft_kv, draft_index, draft_ring = _one_qsa_layer(config, dtype, s.block_size)
        kv_block += s.num_draft_layers * draft_kv
        index_block += s.num_draft_layers * draft_index
        one_slot += s.num_draft_layers * draft_ring
        one_checkpoint = -(-one_slot // CHECKPOINT_ALIGN) * CHECKPOINT_ALIGN  # a checkpoint carries the rings
    one_block, host_block = (index_block, kv_block) if kv_offload else (kv_block + index_block, 0)
    arenas = _arenas(config, dtype, s.arena_rows, ids, s.num_draft_layers) if kv_offload else 0
    checkpoints_host = s.num_checkpoints * one_checkpoint
    if checkpoints_host and checkpoints_host > s.host_available_bytes:
        raise CapacityError(
            f"host RAM for the prefix-cache checkpoints: {s.num_checkpoints:,} x {one_checkpoint:,} B = "
            f"{checkpoints_host:,} B, but {s.host_available_bytes:,} B are available ({s.host_source}); lower "
            "--checkpoint-host-bytes / --max-state-checkpoints or free host memory"
        )
    per_request_blocks = math.ceil(s.max_model_len / s.block_size)
    staging = int(s.device_type == "cuda" and s.num_checkpoints > 0)
    num_slots = s.max_num_seqs + 1 + staging + s.spare_slots
    held = f"{num_slots} state slots of {one_slot:,} B" + (
        f" and QSA arenas of {arenas:,} B" if arenas and s.arena_in_budget else "")
    free = s.budget_bytes - num_slots * one_slot - (arenas if s.arena_in_budget else 0)
    if one_block:
        fit = free // one_block - 1  # one scratch block
        host_fit = (s.host_available_bytes - checkpoints_host) // host_block - 1 if host_block else fit
        num_blocks = min(fit, host_fit, 2 * s.max_num_seqs * per_request_blocks)
        if fit < per_request_blocks:
            raise CapacityError(
                f"the cache budget of {s.budget_bytes:,} B ({s.budget_source}) holds {max(fit, 0):,} blocks of "
                f"{s.block_size} tokens after {held}, but one request of max_model_len {s.max_model_len:,} needs "
                f"{per_request_blocks:,} blocks ({one_block:,} B each); raise --kv-cache-memory-bytes or lower "
                "--max-model-len / --max-num-seqs" + (" / --qsa-row-cache-bytes" if arenas and s.arena_in_budget else "")
            )
        if host_fit < per_request_blocks:
            raise CapacityError(
                f"host RAM for the QSA K/V: {s.host_available_bytes:,} B available ({s.host_source}), less "
                f"{checkpoints_host:,} B of checkpoints, holds {max(host_fit, 0):,} blocks of {s.block_size} tokens "
                f"(+1 scratch), but one request of max_model_len {s.max_model_len:,} needs {per_request_blocks:,} "
                f"blocks of {host_block:,} B = {per_request_blocks * host_block:,} B; free host memory or lower "
                "--max-model-len / --checkpoint-host-bytes"
            )
    else:
        num_blocks = 0
        if free < 0:
            raise CapacityError(f"the cache budget of {s.budget_bytes:,} B ({s.budget_source}) cannot hold {held}")
    arena_rows = min(s.arena_rows, (num_blocks + 1) * s.block_size) if kv_offload else 0  # no more than the pool
    arenas = _arenas(config, dtype, arena_rows, ids, s.num_draft_layers)
    return CachePlan(
        dtype=dtype, block_size=s.block_size, budget_bytes=s.budget_bytes, budget_source=s.budget_source,
        max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs, num_blocks=num_blocks,
        num_checkpoints=s.num_checkpoints, checkpoint_bytes=one_checkpoint, checkpoint_source=s.checkpoint_source,
        block_bytes=one_block, slot_bytes=one_slot, layers=tuple(layer_bytes(config, dtype, ids)),
        kv_offload=kv_offload, kv_placement=kv_placement, host_block_bytes=host_block,
        host_available_bytes=s.host_available_bytes, host_source=s.host_source,
        arena_rows=arena_rows, arena_bytes=arenas, arena_source=s.arena_source,
        arena_in_budget=s.arena_in_budget,
        weights_bytes=s.weights_bytes, ple_table_bytes=ple_table_bytes(config, dtype, ids), ple_mapped=s.ple_mapped,
        prefix_caching=s.prefix_caching, staging_slots=staging, layer_ids=ids,
        num_draft_layers=s.num_draft_layers, spare_slots=s.spare_slots,
    )


def _arenas(config: ModelConfig, dtype: str, arena_rows: int, ids, num_draft_layers: int) -> int:
    """The offload arenas of the target's QSA layers and of the draft head's (one each)."""
    return arena_bytes(config, dtype, arena_rows, ids) + num_draft_layers * arena_rows * arena_row_bytes(config, dtype)


def _one_qsa_layer(config: ModelConfig, dtype: str, block_size: int) -> tuple[int, int, int]:
    """(K/V bytes per block, indexer-key bytes per block, ring bytes per slot) of one QSA layer (an MTP
    draft layer's caches)."""
    if not config.has_qsa:
        raise CapacityError("an MTP draft head's layers are QSA layers: the config needs the indexer_* fields")
    layer = (config.layer_types.index("indexed_attention"),)
    ring = sum(lb.per_request for lb in layer_bytes(config, dtype, layer) if lb.layer_type == "indexed_attention")
    return (kv_block_bytes(config, dtype, block_size, layer), index_block_bytes(config, dtype, block_size, layer),
            ring)


def cache_budget(
    kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None, device: str, weights_bytes: int
) -> tuple[int, str]:
    """(budget bytes, where it came from). Explicit bytes win; else a fraction of the device's memory.

    CUDA: utilization x total memory, minus what is already in use -- vLLM's meaning.
    CPU: utilization (default 0.1) x available RAM.
    weights_bytes: weights not loaded yet but to be counted as in use (the planner passes them; the
    engine, which has loaded its weights, passes 0).
    """
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes <= 0:
            raise CapacityError(f"--kv-cache-memory-bytes must be positive, got {kv_cache_memory_bytes}")
        return kv_cache_memory_bytes, "--kv-cache-memory-bytes"
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise CapacityError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if device.startswith("cuda"):
        import torch

        fraction = gpu_memory_utilization or 0.9
        free, total = torch.cuda.mem_get_info(torch.device(device))
        in_use = total - free + weights_bytes
        return int(fraction * total - in_use), f"--gpu-memory-utilization {fraction} of {total:,} B on {device}"
    fraction = gpu_memory_utilization or DEFAULT_CPU_MEMORY_FRACTION
    available = available_ram_bytes() - weights_bytes
    return int(fraction * available), f"{fraction} of {available:,} B available RAM"


def host_budget(host_memory_bytes: int | None, margin_bytes: int, ranks_on_host: int = 1) -> tuple[int, str]:
    """(bytes the QSA K/V host pools may take, where it came from): host RAM less a safety margin.

    host_memory_bytes stands in for this machine's MemAvailable (to plan another machine). On CPU the
    weights, the cache budget and the host pools all come out of RAM; the pools are checked against
    MemAvailable alone, as `host_pool.allocate_pools` checks them at start-up, before the cache's other
    tensors exist. ranks_on_host: pipeline ranks sharing this host's RAM; each plans with its share.
    """
    available, source = (
        (available_ram_bytes(), "MemAvailable") if host_memory_bytes is None
        else (host_memory_bytes, "--host-memory-bytes")
    )
    if ranks_on_host > 1:
        available, source = available // ranks_on_host, f"{source} / {ranks_on_host} ranks:"
    return available - margin_bytes, f"{source} {available:,} B less a {margin_bytes:,} B margin"
