"""One pipeline rank's start-up: which layers it holds, its weights, its cache plan and its cache.

Every rank runs `build_stage` at start-up (it holds collectives): the ranks tell each other their
device memory, rank 0 picks the layer split (`--pp-layer-partition`, or balanced by bytes:
`memory/partition.py`), each rank loads its tensors and plans its memory with its own budget, and then
all take the fewest blocks and checkpoint rows any rank can hold (rank 0's cache manager numbers them for
everyone). `tierlm plan --pipeline-parallel-size` plans every rank the same way without loading weights.
Under --speculative-config every rank keeps K per-position state slots per running request (its own
GDN/PLE layers'), the last rank also the MTP draft head and its caches, and no rank runs a static decode
runner (speculative steps under pipeline parallelism run eagerly: `engine/pipeline_speculative.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from tierlm.distributed.group import PipelineGroup
from tierlm.memory.partition import (
    PartitionError,
    balanced_partition,
    check_partition,
    layouts,
    parse_partition,
    rank_loads,
)
from tierlm.model.pipeline_stage import StageLayout


def device_capacity(device: torch.device) -> int:
    """The memory a rank balances its layers against: the device's total memory (equal shares on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return 1


def pipeline_layouts(config, model_config, dtype: str, capacities: list[int], quantization=None) -> list[StageLayout]:
    """Every rank's layers: `pp_layer_partition` if given, else balanced by bytes against capacities; under
    --speculative-config the last rank holds the MTP draft head (counted in its load)."""
    from tierlm.engine.speculative import SpeculativeConfig
    from tierlm.model.checkpoint_layout import MTPLayout

    speculative = SpeculativeConfig.parse(config.speculative_config)

    world = len(capacities)
    counts = parse_partition(config.pp_layer_partition)
    if counts is not None:
        check_partition(counts, model_config.num_hidden_layers, world)
    else:
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        mtp = MTPLayout(model_config.num_mtp_layers) if speculative is not None else None
        per_layer, first, last = rank_loads(model_config, dtype, world, config.max_num_seqs, max_model_len,
                                            quantization, mtp=mtp, num_speculative_tokens=0 if mtp is None else
                                            speculative.num_speculative_tokens)
        counts = balanced_partition(per_layer, first, last, capacities)
    out = layouts(model_config, counts)
    if speculative is not None:
        out[-1] = dataclasses.replace(out[-1], draft_head=True)
    return out


def check_pipeline_config(config, model_config) -> None:
    """What can be checked before any process starts; errors are ValueErrors for the CLI."""
    world = config.pipeline_parallel_size
    if world < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {world}")
    counts = parse_partition(config.pp_layer_partition)
    if counts is not None:
        check_partition(counts, model_config.num_hidden_layers, world)
    elif model_config.num_hidden_layers < world:
        raise PartitionError(f"the model has {model_config.num_hidden_layers} layers, fewer than "
                             f"--pipeline-parallel-size {world}")


@dataclass
class Stage:
    layout: StageLayout
    model: torch.nn.Module
    model_config: object
    cache: object  # ModelCache
    plan: object  # CachePlan, with the blocks and checkpoints every rank agreed on
    static_decode: object | None
    summaries: list[str]  # one line per rank (rank 0 logs them)


def build_stage(config, group: PipelineGroup) -> Stage:
    """Load this rank's layers, plan its memory, agree on blocks and checkpoints with the other ranks,
    and allocate its cache. Every rank calls this at start-up (it holds collectives)."""
    from tierlm.config import ModelConfig
    from tierlm.engine.llm_engine import engine_cache_plan
    from tierlm.engine.speculative import SpeculativeConfig
    from tierlm.model.loader import load_model, read_quantization_config, resolve_dtype, resolve_model_path
    from tierlm.model.model_cache import ModelCache

    model_dir = resolve_model_path(config.model)
    model_config = ModelConfig.from_pretrained(model_dir)
    quantization = read_quantization_config(model_dir)
    dtype_name = str(resolve_dtype(config.dtype, model_config)).removeprefix("torch.")
    capacities = group.all_gather_object(device_capacity(group.device))
    chosen = pipeline_layouts(config, model_config, dtype_name, capacities, quantization) if group.rank == 0 else None
    layout = group.all_gather_object(chosen)[0][group.rank]
    speculative_config = SpeculativeConfig.parse(config.speculative_config)
    speculative = speculative_config is not None
    model, model_config = load_model(
        model_dir, config.dtype, group.device, stage=layout, load_format=config.load_format, load_mtp=speculative
    )
    if speculative:  # the last rank's draft head
        speculative_config.restrict_draft_vocab(model)
    plan = engine_cache_plan(config, model_config, dtype_name, str(group.device), 0, stage=layout,
                             quantization=quantization)
    plan = agreed_plan(plan, group.all_gather_object(plan_limits(plan)), model_config, layout)
    dtype = next(model.parameters()).dtype
    cache = ModelCache(
        model_config, plan.num_slots + plan.spare_slots, plan.num_blocks, plan.block_size, dtype, group.device,
        kv_offload=plan.kv_offload, arena_rows=plan.arena_rows, row_cache=config.qsa_row_cache,
        row_cache_max_batch=config.qsa_row_cache_max_batch, num_host_checkpoints=plan.num_checkpoints,
        layer_ids=layout.layer_ids, num_draft_layers=plan.num_draft_layers,
    )
    static_decode = None if speculative else _static_decode(config, model, model_config, cache, layout)
    summary = rank_summary(layout, str(group.device), plan)
    if group.device.type == "cuda":
        summary += f"; device memory allocated {torch.cuda.memory_allocated(group.device):,} B"
    return Stage(layout, model, model_config, cache, plan, static_decode, group.all_gather_object(summary))


def plan_limits(plan) -> tuple[int | None, int]:
    """What a rank's plan allows: (blocks, or None when it holds no QSA layer; checkpoints)."""
    return (plan.num_blocks if plan.block_bytes else None), plan.num_checkpoints


def agreed_plan(plan, limits: list[tuple[int | None, int]], model_config, layout: StageLayout):
    """A rank's plan cut to what every rank allows: slots and blocks are numbered by rank 0's cache
    manager, so every rank holds as many blocks and checkpoint rows as the tightest one."""
    from tierlm.memory.plan import arena_bytes

    blocks = min((b for b, _ in limits if b is not None), default=plan.num_blocks)
    checkpoints = min(c for _, c in limits)
    arena_rows = min(plan.arena_rows, (blocks + 1) * plan.block_size) if plan.kv_offload else 0
    return dataclasses.replace(plan, num_blocks=blocks, num_checkpoints=checkpoints, arena_rows=arena_rows,
                               arena_bytes=arena_bytes(model_config, plan.dtype, arena_rows, layout.layer_ids))


def memory_report(stage: Stage) -> dict:
    """A rank's planned device bytes (weights and cache) beside what its device's allocator holds (CUDA)."""
    device = stage.cache.device
    return {"plan_device_bytes": stage.plan.weights_bytes + stage.plan.device_bytes(),
            "device_memory_allocated": torch.cuda.memory_allocated(device) if device.type == "cuda" else None}


def rank_summary(layout: StageLayout, device: str, plan) -> str:
    """One rank's line of the start-up log and of `tierlm plan --pipeline-parallel-size N`."""
    host = f", host pools {plan.host_bytes():,} B" if plan.host_bytes() else ""
    return (f"rank {layout.rank} on {device}: {layout.describe()}; weights {plan.weights_bytes:,} B, cache "
            f"{plan.device_bytes():,} B ({plan.num_blocks:,} blocks, {plan.device_slots} slots){host}")


def _static_decode(config, model, model_config, cache, layout: StageLayout):
    from tierlm.model.static_decode import StaticDecodeRunner, runner_mode

    mode = runner_mode(cache.device, config.compile_decode, config.enforce_eager)
    if mode is None:
        return None
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    width = None if layout.is_first else model_config.hc_count * model_config.hidden_size
    return StaticDecodeRunner(model, cache, config.max_num_seqs, math.ceil(max_model_len / cache.block_size), mode,
                              stage_input_width=width)
