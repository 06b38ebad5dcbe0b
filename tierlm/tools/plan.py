"""`tierlm plan MODEL`: the cache capacity the engine would have, from config.json alone.

Prints exactly the lines the engine logs at start-up for the same settings (both call
`engine_cache_plan`), without loading weights, tier by tier: on the device the weights (quantized modules
at their packed size, per format), state slots, QSA device rows and row-cache arena; in host RAM the QSA
K/V pools, the prefix-cache checkpoints and the page cache left for mapped PLE tables; then the number of
max_model_len requests that fit at once. `--device cuda`
with --kv-cache-memory-bytes needs no GPU, and --host-memory-bytes stands in for this machine's
MemAvailable, so a deployment machine (QSA K/V offloaded or not) can be planned from another one.
With --pipeline-parallel-size N it prints one line per rank (its layers, weights and cache, as the engine
logs them at start-up, ranks on devices of equal memory), then rank 0's plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tierlm.cli import CliError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="capacity of the cache for a model and settings")
    parser.add_argument("model", help="a local checkpoint folder (only config.json is read)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-state-checkpoints", type=int, default=None)
    parser.add_argument("--checkpoint-host-bytes", type=int, default=None,
                        help="host RAM for the prefix-cache checkpoints (instead of --max-state-checkpoints)")
    parser.add_argument("--qsa-kv-offload", action=argparse.BooleanOptionalAction, default=None,
                        help="QSA K/V in host RAM (default: auto, as the engine decides)")
    parser.add_argument("--qsa-row-cache-rows", type=int, default=None,
                        help="with offload: rows of each QSA layer's device arena (default: from the bytes)")
    parser.add_argument("--qsa-row-cache-bytes", type=int, default=None,
                        help="with offload: the device arenas of all QSA layers, in bytes (default 95 MiB)")
    parser.add_argument("--ple-table", default=None,
                        help="the PLE tables as mapped files (default: <model>/ple_tables if present)")
    parser.add_argument("--host-memory-bytes", type=int, default=None,
                        help="host RAM to plan with instead of this machine's MemAvailable")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="plan each of this many pipeline ranks (equal devices)")
    parser.add_argument("--pp-layer-partition", default=None,
                        help="layers per rank, e.g. 16,17,15 (default: balanced)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="plan MTP speculative decoding's caches too (the draft head's layers, the "
                        "per-position state slots, a speculative_token_map's head rows)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierlm.config import ConfigError, ModelConfig
    from tierlm.engine.llm_engine import EngineConfig, engine_cache_plan
    from tierlm.engine.speculative import SpeculativeConfig
    from tierlm.memory.ngram_store import find_table_dir
    from tierlm.memory.plan import CapacityError, weight_bytes
    from tierlm.model.loader import (
        ModelNotFoundError,
        read_quantization_config,
        resolve_dtype,
        resolve_model_path,
    )

    try:
        model_dir = resolve_model_path(args.model)
        config = ModelConfig.from_pretrained(model_dir)
        ple_mapped = bool(config.ple_layer_ids) and find_table_dir(str(model_dir), args.ple_table) is not None
        dtype = str(resolve_dtype(args.dtype, config)).removeprefix("torch.")
        settings = EngineConfig(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            max_state_checkpoints=args.max_state_checkpoints, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization, qsa_kv_offload=args.qsa_kv_offload,
            qsa_row_cache_rows=args.qsa_row_cache_rows, checkpoint_host_bytes=args.checkpoint_host_bytes,
            pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=args.pp_layer_partition,
            speculative_config=args.speculative_config,
            **({} if args.qsa_row_cache_bytes is None else {"qsa_row_cache_bytes": args.qsa_row_cache_bytes}),
        )
        if args.pipeline_parallel_size != 1:
            return _print_ranks(args, settings, config, dtype, ple_mapped)
        quantization = read_quantization_config(model_dir)
        speculative = SpeculativeConfig.parse(args.speculative_config)
        mtp = None if speculative is None else speculative.head_layout(_mtp_layout(model_dir, config))
        by_format = weight_bytes(config, dtype, quantization, ple_mapped, mtp=mtp)
        weights = sum(by_format.values())
        plan = engine_cache_plan(settings, config, dtype, args.device, weights, args.host_memory_bytes, ple_mapped,
                                 quantization=quantization, mtp=mtp)
    except (ConfigError, CapacityError, ModelNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None
    formats = "" if list(by_format) == ["dense"] else ": " + ", ".join(
        f"{label} {size:,} B" for label, size in sorted(by_format.items(), key=lambda item: -item[1])
    )
    print(f"model: {args.model} ({weights:,} B of weights in {dtype}{formats})")
    for line in plan.lines():
        print(line)
    return 0



def _mtp_layout(model_dir, config):
    """The draft head speculative decoding loads: the checkpoint's (its own lm_head or not, from the
    safetensors headers) when its files are there, else the config's layers with the target's lm_head."""
    from tierlm.model.checkpoint_layout import MTPLayout
    from tierlm.model.loader import index_tensors, mtp_layout

    files = sorted(Path(model_dir).glob("*.safetensors"))
    found = mtp_layout(config, index_tensors(files, with_mtp=True)) if files else None
    return found or MTPLayout(config.num_mtp_layers)


def _print_ranks(args, settings, config, dtype: str, ple_mapped: bool) -> int:
    """One line per pipeline rank, then rank 0's plan (each rank plans its layers with its own budget)."""
    from tierlm.engine.llm_engine import engine_cache_plan
    from tierlm.engine.stage_setup import (
        agreed_plan,
        check_pipeline_config,
        pipeline_layouts,
        plan_limits,
        rank_summary,
    )
    from tierlm.memory.plan import CapacityError
    from tierlm.model.loader import read_quantization_config, resolve_model_path

    if ple_mapped:
        raise CliError("memory-mapped PLE tables are not supported with --pipeline-parallel-size > 1 yet")
    try:
        check_pipeline_config(settings, config)
        quantization = read_quantization_config(resolve_model_path(args.model))
        ranks = pipeline_layouts(settings, config, dtype, [1] * args.pipeline_parallel_size, quantization)
        plans = [engine_cache_plan(settings, config, dtype, args.device, 0, args.host_memory_bytes, stage=layout,
                                   quantization=quantization) for layout in ranks]
    except (CapacityError, ValueError) as exc:
        raise CliError(str(exc)) from None
    limits = [plan_limits(plan) for plan in plans]
    plans = [agreed_plan(plan, limits, config, layout) for plan, layout in zip(plans, ranks)]
    weights = sum(plan.weights_bytes for plan in plans)
    print(f"model: {args.model} ({weights:,} B of weights in {dtype}, over {len(ranks)} pipeline ranks)")
    for layout, plan in zip(ranks, plans):
        print(rank_summary(layout, args.device, plan))
    for line in plans[0].lines():
        print(f"rank 0 {line}")
    return 0
