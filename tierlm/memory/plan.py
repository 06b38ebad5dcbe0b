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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierlm.config import ModelConfig

ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_CPU_MEMORY_FRACTION = 0.1  # of available RAM, when no --gpu-memory-utilization is given on CPU


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


def block_bytes(config: ModelConfig, dtype: str, block_size: int) -> int:
    """One block of block_size tokens over all QSA layers."""
    if not config.has_qsa:
        return 0
    item = ITEM_BYTES[dtype]
    per_layer = block_size * 2 * config.num_key_value_heads * config.head_dim * item
    per_layer += block_size // config.indexer_compress_ratio * config.indexer_head_dim * item
    return config.layer_types.count("indexed_attention") * per_layer


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
    block_bytes: int
    slot_bytes: int
    layers: tuple[LayerBytes, ...]

    @property
    def num_slots(self) -> int:
        """Slots the engine hands out: running requests, then checkpoints (a scratch slot comes on top)."""
        return self.max_num_seqs + self.num_checkpoints

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def requests_at_max_len(self) -> float:
        """Requests of max_model_len that fit at once (blocks and running slots both limit it)."""
        if not self.block_bytes:
            return float(self.max_num_seqs)
        return min(self.tokens / self.max_model_len, float(self.max_num_seqs))

    def used_bytes(self) -> int:
        return (self.num_blocks + 1) * self.block_bytes + (self.num_slots + 1) * self.slot_bytes

    def lines(self) -> list[str]:
        out = [f"cache budget: {self.budget_bytes:,} B ({self.budget_source}), dtype {self.dtype}"]
        for lb in self.layers:
            unit = f"{lb.per_token:,.0f} B/token" if lb.per_token else f"{lb.per_request:,} B/request"
            out.append(f"  {lb.layer_type} x{lb.layers}: {unit} per layer ({lb.detail})")
        if self.block_bytes:
            out.append(f"  QSA blocks: {self.num_blocks:,} x {self.block_size} tokens = {self.tokens:,} tokens "
                       f"({self.block_bytes:,} B/block)")
        out.append(f"  state slots: {self.max_num_seqs} running + {self.num_checkpoints} prefix-cache checkpoints "
                   f"(+1 scratch), {self.slot_bytes:,} B each")
        share = self.num_checkpoints * self.slot_bytes / self.budget_bytes if self.budget_bytes else 0.0
        out.append(f"  checkpoint cost: {self.num_checkpoints} x {self.slot_bytes:,} B = "
                   f"{self.num_checkpoints * self.slot_bytes:,} B ({share:.1%} of the budget)")
        out.append(f"  capacity: {self.requests_at_max_len:.2f} requests of max_model_len {self.max_model_len:,} "
                   f"at once (max_num_seqs {self.max_num_seqs}); {self.used_bytes():,} B allocated")
        return out


def plan_cache(
    config: ModelConfig,
    dtype: str,
    *,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    budget_bytes: int,
    budget_source: str,
    num_checkpoints: int,
) -> CachePlan:
    """Split the budget: slots for running requests and checkpoints first, the rest into blocks.

    Blocks are capped at twice what max_num_seqs requests of max_model_len can use (the second half
    serves the prefix cache), so a large budget is not spent on blocks nothing can reach.
    """
    block_size = aligned_block_size(config, block_size)
    one_block, one_slot = block_bytes(config, dtype, block_size), slot_bytes(config, dtype)
    per_request_blocks = math.ceil(max_model_len / block_size)
    slots_bytes = (max_num_seqs + num_checkpoints + 1) * one_slot
    if one_block:
        fit = (budget_bytes - slots_bytes) // one_block - 1  # one scratch block
        num_blocks = min(fit, 2 * max_num_seqs * per_request_blocks)
        if num_blocks < per_request_blocks:
            raise CapacityError(
                f"the cache budget of {budget_bytes:,} B ({budget_source}) holds {max(fit, 0):,} blocks of "
                f"{block_size} tokens after {max_num_seqs + num_checkpoints + 1} state slots of {one_slot:,} B, "
                f"but one request of max_model_len {max_model_len:,} needs {per_request_blocks:,} blocks "
                f"({one_block:,} B each); raise --kv-cache-memory-bytes or lower --max-model-len / --max-num-seqs"
            )
    else:
        num_blocks = 0
        if slots_bytes > budget_bytes:
            raise CapacityError(
                f"the cache budget of {budget_bytes:,} B ({budget_source}) cannot hold "
                f"{max_num_seqs + num_checkpoints + 1} state slots of {one_slot:,} B"
            )
    return CachePlan(
        dtype=dtype, block_size=block_size, budget_bytes=budget_bytes, budget_source=budget_source,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
        num_checkpoints=num_checkpoints, block_bytes=one_block, slot_bytes=one_slot,
        layers=tuple(layer_bytes(config, dtype)),
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
