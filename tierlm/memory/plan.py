"""Capacity planning: how a memory budget splits into QSA blocks and recurrent-state slots.

One pure function (`plan_cache`) turns a config, the engine settings and a byte budget into a
`CachePlan`; the engine sizes its pools from it and logs `plan.lines()` at start-up, and `tierlm plan`
prints the same lines from config.json alone, without loading weights.

Where the bytes go (per layer type):
- indexed_attention (QSA): per token K and V rows plus one compressed indexer key per R tokens (paged,
  in blocks of block_size tokens); per request the raw indexer keys of the open block (the ring).
- linear_attention (GDN): per request the conv window (Kc-1 inputs) and the fp32 recurrent state.
- PLE: per request the dilated conv history ((Kp-1) * ngram_size values) and ngram_size-1 token ids.
A state slot holds one request's recurrent state for every layer; prefix-cache checkpoints are slots too.

With QSA K/V offloaded (--qsa-kv-offload, or auto on CUDA when the device alone is short) a block's K/V
rows go to host RAM and only its indexer keys stay on the device, which also holds each QSA layer's
arena (prefill staging and decode row cache); the number of blocks is then bounded by both memories.

`weight_bytes` counts the weights as held in memory, per storage format (quantized modules packed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tierlm.config import ModelConfig

ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SPEC_DTYPE_BYTES = {"int32": 4, "int64": 8, "float8_e4m3fn": 1, "float32": 4}
DEFAULT_CPU_MEMORY_FRACTION = 0.1  # of available RAM, when no --gpu-memory-utilization is given on CPU


def weight_bytes(config: ModelConfig, dtype: str, quantization=None) -> dict[str, int]:
    """Bytes of the model's weights in memory per format label (`dense`: the model dtype; int64 hash
    buffers at 8 bytes), the quantized modules counted by their packed runtime tensors."""
    from tierlm.model.checkpoint_layout import checkpoint_layout, weight_module
    from tierlm.model.quantization.base import DENSE

    totals: dict[str, int] = {}
    ple_fp8 = config.extra.get("ple_embedding_dtype") == "float8_e4m3fn"  # vLLM's config field
    for spec in checkpoint_layout(config, ple_fp8=ple_fp8):
        module = weight_module(spec)
        fmt = quantization.format_of(*module) if module and quantization is not None else DENSE
        if fmt == DENSE:
            item = SPEC_DTYPE_BYTES[spec.dtype] if spec.dtype else 8 if spec.kind == "int64" else ITEM_BYTES[dtype]
            nbytes = math.prod(spec.shape) * item
        else:
            nbytes = sum(
                math.prod(t.shape) * (t.dtype.itemsize if t.dtype is not None else ITEM_BYTES[dtype])
                for t in fmt.runtime_tensors(*spec.shape).values()
            )
        totals[fmt.label] = totals.get(fmt.label, 0) + nbytes
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


def layer_bytes(config: ModelConfig, dtype: str) -> list[LayerBytes]:
    item = ITEM_BYTES[dtype]
    c = config
    out = []
    qsa_layers = c.layer_types.count("indexed_attention")
    if qsa_layers:
        kv = 2 * c.num_key_value_heads * c.head_dim * item
        index_key = c.indexer_head_dim * item / c.indexer_compress_ratio
        ring = c.indexer_compress_ratio * c.indexer_head_dim * item
        out.append(LayerBytes(
            "indexed_attention", qsa_layers, kv + index_key, ring,
            f"K/V {kv:,} + index key {index_key:g} per token; index ring {ring:,} per request",
        ))
    gdn_layers = c.layer_types.count("linear_attention")
    if gdn_layers:
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        conv = conv_dim * (c.linear_conv_kernel_dim - 1) * item
        state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        out.append(LayerBytes(
            "linear_attention", gdn_layers, 0, conv + state, f"conv window {conv:,} + fp32 state {state:,} per request"
        ))
    if c.ple_layer_ids:
        history = c.hc_count * c.hidden_size * (c.ple_conv_kernel_size - 1) * c.ngram_size * item
        out.append(LayerBytes("ple", len(c.ple_layer_ids), 0, history, f"conv history {history:,} per request"))
    return out


def slot_bytes(config: ModelConfig, dtype: str) -> int:
    """One request's recurrent state over all layers (plus its n-gram context ids)."""
    total = sum(lb.layers * lb.per_request for lb in layer_bytes(config, dtype))
    return total + (8 * (config.ngram_size - 1) if config.ple_layer_ids else 0)


def kv_block_bytes(config: ModelConfig, dtype: str, block_size: int) -> int:
    """One block's K and V rows over all QSA layers (what offload moves to host RAM)."""
    if not config.has_qsa:
        return 0
    per_layer = block_size * 2 * config.num_key_value_heads * config.head_dim * ITEM_BYTES[dtype]
    return config.layer_types.count("indexed_attention") * per_layer


def index_block_bytes(config: ModelConfig, dtype: str, block_size: int) -> int:
    """One block's compressed indexer keys over all QSA layers (on the device, offloaded or not)."""
    if not config.has_qsa:
        return 0
    per_layer = block_size // config.indexer_compress_ratio * config.indexer_head_dim * ITEM_BYTES[dtype]
    return config.layer_types.count("indexed_attention") * per_layer


def arena_bytes(config: ModelConfig, dtype: str, arena_rows: int) -> int:
    """The device arenas of offloaded QSA layers: per layer arena_rows K rows and as many V rows, and the
    row cache's tag, hit mark and claim (int64 each) per row."""
    row = config.num_key_value_heads * config.head_dim * ITEM_BYTES[dtype]
    return config.layer_types.count("indexed_attention") * arena_rows * (2 * row + 3 * 8)


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
    num_checkpoints: int
    block_bytes: int  # per block on the device: K/V and indexer keys, or with offload the indexer keys alone
    slot_bytes: int
    layers: tuple[LayerBytes, ...]
    kv_offload: bool  # QSA K/V in host pools
    kv_placement: str  # why the K/V are where they are: the flag, or what auto saw
    host_block_bytes: int  # per block in host RAM (0 without offload)
    host_available_bytes: int  # what the host pools may take (the safety margin already taken off)
    host_source: str
    arena_rows: int  # per QSA layer, K and V each, with offload
    arena_bytes: int  # all QSA layers' arenas, on the device (0 without offload)

    @property
    def num_slots(self) -> int:
        """Slots the engine hands out: running requests, then checkpoints (a scratch slot comes on top)."""
        return self.max_num_seqs + self.num_checkpoints

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
        """Device bytes: blocks and slots (each with its scratch one), and the arenas."""
        return (self.num_blocks + 1) * self.block_bytes + (self.num_slots + 1) * self.slot_bytes + self.arena_bytes

    def host_bytes(self) -> int:
        """Host RAM of the K/V pools (the scratch block included)."""
        return (self.num_blocks + 1) * self.host_block_bytes

    def lines(self) -> list[str]:
        out = [f"cache budget: {self.budget_bytes:,} B ({self.budget_source}), dtype {self.dtype}"]
        for lb in self.layers:
            unit = f"{lb.per_token:,.0f} B/token" if lb.per_token else f"{lb.per_request:,} B/request"
            out.append(f"  {lb.layer_type} x{lb.layers}: {unit} per layer ({lb.detail})")
        if self.block_bytes:
            out += self._qsa_lines()
        out.append(f"  state slots: {self.max_num_seqs} running + {self.num_checkpoints} prefix-cache checkpoints "
                   f"(+1 scratch), {self.slot_bytes:,} B each")
        share = self.num_checkpoints * self.slot_bytes / self.budget_bytes if self.budget_bytes else 0.0
        out.append(f"  checkpoint cost: {self.num_checkpoints} x {self.slot_bytes:,} B = "
                   f"{self.num_checkpoints * self.slot_bytes:,} B ({share:.1%} of the budget)")
        out.append(f"  capacity: {self.requests_at_max_len:.2f} requests of max_model_len {self.max_model_len:,} "
                   f"at once (max_num_seqs {self.max_num_seqs}); {self.used_bytes():,} B allocated"
                   + (" on the device" if self.kv_offload else ""))
        return out

    def _qsa_lines(self) -> list[str]:
        blocks = f"  QSA blocks: {self.num_blocks:,} x {self.block_size} tokens = {self.tokens:,} tokens"
        if not self.kv_offload:
            return [f"  QSA K/V: on the device ({self.kv_placement})", f"{blocks} ({self.block_bytes:,} B/block)"]
        host = (f"  host RAM: {self.num_blocks + 1:,} blocks (1 scratch) x {self.host_block_bytes:,} B = "
                f"{self.host_bytes():,} B of K/V pools, of {self.host_available_bytes:,} B available "
                f"({self.host_source})")
        arenas = (f"  QSA arenas: {self.arena_rows:,} rows (K and V) per layer x {self.qsa_layers} = "
                  f"{self.arena_bytes:,} B on the device (prefill staging, decode row cache)")
        return [
            f"  QSA K/V: in host RAM ({self.kv_placement})",
            f"{blocks} ({self.block_bytes:,} B/block on the device + {self.host_block_bytes:,} B/block in host RAM)",
            host,
            arenas,
        ]


@dataclass(frozen=True)
class CacheSettings:
    """What a plan is asked for: the engine's settings and the memory each side may use."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    num_checkpoints: int
    budget_bytes: int  # device
    budget_source: str
    kv_offload: bool | None  # QSA K/V in host pools; None: auto
    device_type: str
    arena_rows: int  # with offload, per QSA layer
    host_available_bytes: int  # for the host pools, the safety margin already taken off
    host_source: str


def plan_cache(config: ModelConfig, dtype: str, settings: CacheSettings) -> CachePlan:
    """Split the budget: slots for running requests and checkpoints first, the rest into blocks.

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
    kv_offload = kv_offload and config.has_qsa
    kv_block, index_block = kv_block_bytes(config, dtype, s.block_size), index_block_bytes(config, dtype, s.block_size)
    one_block, host_block = (index_block, kv_block) if kv_offload else (kv_block + index_block, 0)
    arenas = arena_bytes(config, dtype, s.arena_rows) if kv_offload else 0
    one_slot = slot_bytes(config, dtype)
    per_request_blocks = math.ceil(s.max_model_len / s.block_size)
    num_slots = s.max_num_seqs + s.num_checkpoints + 1
    held = f"{num_slots} state slots of {one_slot:,} B" + (f" and QSA arenas of {arenas:,} B" if arenas else "")
    free = s.budget_bytes - num_slots * one_slot - arenas
    if one_block:
        fit = free // one_block - 1  # one scratch block
        host_fit = s.host_available_bytes // host_block - 1 if host_block else fit
        num_blocks = min(fit, host_fit, 2 * s.max_num_seqs * per_request_blocks)
        if fit < per_request_blocks:
            raise CapacityError(
                f"the cache budget of {s.budget_bytes:,} B ({s.budget_source}) holds {max(fit, 0):,} blocks of "
                f"{s.block_size} tokens after {held}, but one request of max_model_len {s.max_model_len:,} needs "
                f"{per_request_blocks:,} blocks ({one_block:,} B each); raise --kv-cache-memory-bytes or lower "
                "--max-model-len / --max-num-seqs" + (" / --qsa-row-cache-rows" if arenas else "")
            )
        if host_fit < per_request_blocks:
            raise CapacityError(
                f"host RAM for the QSA K/V: {s.host_available_bytes:,} B available ({s.host_source}) holds "
                f"{max(host_fit, 0):,} blocks of {s.block_size} tokens (+1 scratch), but one request of "
                f"max_model_len {s.max_model_len:,} needs {per_request_blocks:,} blocks of {host_block:,} B = "
                f"{per_request_blocks * host_block:,} B; free host memory or lower --max-model-len"
            )
    else:
        num_blocks = 0
        if free < 0:
            raise CapacityError(f"the cache budget of {s.budget_bytes:,} B ({s.budget_source}) cannot hold {held}")
    return CachePlan(
        dtype=dtype, block_size=s.block_size, budget_bytes=s.budget_bytes, budget_source=s.budget_source,
        max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs, num_blocks=num_blocks,
        num_checkpoints=s.num_checkpoints, block_bytes=one_block, slot_bytes=one_slot,
        layers=tuple(layer_bytes(config, dtype)), kv_offload=kv_offload, kv_placement=kv_placement,
        host_block_bytes=host_block, host_available_bytes=s.host_available_bytes, host_source=s.host_source,
        arena_rows=s.arena_rows if kv_offload else 0, arena_bytes=arenas,
    )


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")


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


def host_budget(host_memory_bytes: int | None, margin_bytes: int) -> tuple[int, str]:
    """(bytes the QSA K/V host pools may take, where it came from): host RAM less a safety margin.

    host_memory_bytes stands in for this machine's MemAvailable (to plan another machine). On CPU the
    weights, the cache budget and the host pools all come out of RAM; the pools are checked against
    MemAvailable alone, as `host_pool.allocate_pools` checks them at start-up, before the cache's other
    tensors exist.
    """
    available, source = (
        (available_ram_bytes(), "MemAvailable") if host_memory_bytes is None
        else (host_memory_bytes, "--host-memory-bytes")
    )
    return available - margin_bytes, f"{source} {available:,} B less a {margin_bytes:,} B margin"
