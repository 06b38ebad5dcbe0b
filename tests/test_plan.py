"""`tierlm plan` prints what the engine logs at start-up for the same settings."""

from __future__ import annotations

import logging

import pytest

from tierlm.cli import main
from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine, engine_cache_plan
from tierlm.memory import plan as plan_module
from tierlm.memory.host_pool import DEFAULT_MARGIN_BYTES
from tierlm.memory.plan import CapacityError, checkpoint_bytes, kv_block_bytes


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


SETTINGS = [
    {"kv_cache_memory_bytes": 20_000_000},
    {"kv_cache_memory_bytes": 3_000_000, "max_model_len": 1024, "max_num_seqs": 2},
    {"kv_cache_memory_bytes": 8_000_000, "max_model_len": 2048, "enable_prefix_caching": False, "block_size": 32},
    {"kv_cache_memory_bytes": 5_000_000, "max_model_len": 512, "max_num_seqs": 3, "max_state_checkpoints": 1},
    {"kv_cache_memory_bytes": 20_000_000, "qsa_kv_offload": True, "qsa_row_cache_rows": 64},
    {"kv_cache_memory_bytes": 20_000_000, "qsa_kv_offload": True, "qsa_row_cache_bytes": 300_000},
    {"kv_cache_memory_bytes": 5_000_000, "max_model_len": 512, "checkpoint_host_bytes": 10_000_000},
]


def cli_args(settings: dict) -> list[str]:
    args = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("settings", SETTINGS)
def test_plan_prints_the_engine_startup_figures(demo_dir, settings, capsys, caplog, monkeypatch):
    # the plan prints the host RAM it counted on: the same figure for both (MemAvailable moves)
    monkeypatch.setattr(plan_module, "available_ram_bytes", lambda: 8 << 30)
    assert main(["plan", str(demo_dir), *cli_args(settings)]) == 0
    printed = capsys.readouterr().out.splitlines()[1:]  # after the model line
    with caplog.at_level(logging.INFO, logger="tierlm"):
        engine = LLMEngine(EngineConfig(model=str(demo_dir), device="cpu", **settings))
    logged = [r.getMessage() for r in caplog.records if r.name == "tierlm"]
    assert printed == logged[: len(printed)] == engine.cache_plan.lines()  # then the host pools' lines
    plan = engine.cache_plan
    # the pools really have the planned sizes, within the budget
    assert engine.cache.num_blocks == plan.num_blocks and engine.cache.num_slots == plan.num_slots
    assert plan.used_bytes() <= plan.budget_bytes
    assert plan.kv_offload == settings.get("qsa_kv_offload", False)  # auto is off on CPU
    qsa = [state for state in engine.cache.layers if state.key_cache is not None]
    assert qsa and all((state.offload is not None) == plan.kv_offload for state in qsa)
    if plan.kv_offload:
        assert sum(state.key_cache.nbytes + state.value_cache.nbytes for state in qsa) == plan.host_kv_bytes()
        assert plan.host_bytes() <= plan.host_available_bytes
        caches = [state.offload.cache for state in qsa]
        arena = sum(c.keys.nbytes + c.values.nbytes + c.tags.nbytes + c.hitmark.nbytes + c.claims.nbytes
                    for c in caches)
        assert arena == plan.arena_bytes
    if "checkpoint_host_bytes" in settings:
        assert plan.num_checkpoints == settings["checkpoint_host_bytes"] // plan.checkpoint_bytes
    elif settings.get("enable_prefix_caching", True):
        assert plan.num_checkpoints == settings.get("max_state_checkpoints", 2 * settings.get("max_num_seqs", 4))
    else:
        assert plan.num_checkpoints == 0
    # each cache kind's own sizes add up to the plan's
    layers = engine.cache.layers
    device_block = sum(c.indexer.block_bytes for c in layers if c.indexer) + (
        0 if plan.kv_offload else sum(c.kv.block_bytes for c in layers if c.kv))
    assert device_block == plan.block_bytes and engine.cache.slot_bytes == plan.slot_bytes
    # the checkpoints are host rows of exactly the planned size; the device holds the running slots only
    host_pool = engine.cache.checkpoints.nbytes if engine.cache.checkpoints else 0
    assert host_pool == plan.host_checkpoint_bytes() and engine.cache.num_slots == plan.max_num_seqs
    if "qsa_row_cache_bytes" in settings:
        assert plan.arena_bytes <= settings["qsa_row_cache_bytes"] < plan.arena_bytes + plan.qsa_layers * (2 * 2 * 32 * 4 + 24)


def test_plan_rejects_a_budget_too_small(demo_dir, capsys):
    assert main(["plan", str(demo_dir), "--kv-cache-memory-bytes", "1000"]) == 2
    assert "raise --kv-cache-memory-bytes" in capsys.readouterr().err


def test_row_cache_settings_out_of_range_are_refused(demo_dir, capsys):
    assert main(["plan", str(demo_dir), "--kv-cache-memory-bytes", "20000000", "--qsa-row-cache-rows", "0"]) == 2
    assert "--qsa-row-cache-rows must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--qsa-row-cache-max-batch must be 0 or more, got -1"):
        LLMEngine(EngineConfig(model=str(demo_dir), device="cpu", qsa_row_cache_max_batch=-1))


# ---- where the QSA K/V go: auto, explicit, and the host RAM that bounds them -------------------------

SMALL = {"kv_cache_memory_bytes": 12_000_000, "qsa_row_cache_rows": 1024}  # the device alone: 2.56 of 4 requests
LARGE = {"kv_cache_memory_bytes": 20_000_000, "qsa_row_cache_rows": 1024}  # the device alone: all 4


def plan_for(demo_dir, device, host_memory_bytes=64 << 30, **settings):
    """The engine's plan on `device`; a given budget queries no device, so "cuda" plans without a GPU."""
    config = ModelConfig.from_pretrained(demo_dir)
    return engine_cache_plan(EngineConfig(model="m", **settings), config, "float32", device, 0, host_memory_bytes)


def host_blocks(demo_dir, blocks):
    """Host RAM (before the margin) for `blocks` blocks of K/V and the scratch block, beside the default
    8 prefix-cache checkpoints."""
    config = ModelConfig.from_pretrained(demo_dir)
    return DEFAULT_MARGIN_BYTES + (blocks + 1) * kv_block_bytes(config, "float32", 16) + 8 * checkpoint_bytes(
        config, "float32")


def test_auto_offloads_on_cuda_when_the_device_alone_is_short(demo_dir):
    on_device = plan_for(demo_dir, "cuda", **SMALL, qsa_kv_offload=False)
    assert on_device.requests_at_max_len < on_device.max_num_seqs
    plan = plan_for(demo_dir, "cuda", **SMALL)
    assert plan.kv_offload and plan.kv_placement.startswith("auto: the device alone holds 2.56 of")
    assert plan.num_blocks > on_device.num_blocks and plan.requests_at_max_len == plan.max_num_seqs
    assert plan.used_bytes() <= plan.budget_bytes and plan.arena_bytes == 1024 * (2 * 2 * 32 * 4 + 3 * 8)
    line = "  QSA K/V: in host RAM (auto: the device alone holds 2.56 of max_num_seqs 4 requests of max_model_len)"
    assert line in plan.lines()
    assert not plan_for(demo_dir, "cuda", **LARGE).kv_offload
    tight = {"kv_cache_memory_bytes": 800_000, "max_model_len": 1024, "qsa_row_cache_rows": 64}
    with pytest.raises(CapacityError):
        plan_for(demo_dir, "cuda:1", **tight, qsa_kv_offload=False)
    plan = plan_for(demo_dir, "cuda:1", **tight)
    assert plan.kv_offload and plan.kv_placement == "auto: the device alone cannot hold one request of max_model_len"


def test_auto_stays_on_the_device_on_cpu_or_when_offloading_holds_no_more(demo_dir):
    plan = plan_for(demo_dir, "cpu", **SMALL)
    assert not plan.kv_offload and plan.kv_placement == "auto: off on cpu"
    assert "  QSA K/V: on the device (auto: off on cpu)" in plan.lines()
    no_more = plan_for(demo_dir, "cuda", host_blocks(demo_dir, 600), **SMALL)
    assert not no_more.kv_offload and no_more.kv_placement.endswith("offloaded they would hold no more")
    assert no_more.num_blocks == plan_for(demo_dir, "cuda", **SMALL, qsa_kv_offload=False).num_blocks
    assert plan.staging_slots == 0 and no_more.staging_slots == 1  # checkpoint saves stage on CUDA only


def test_explicit_placement_wins(demo_dir):
    assert not plan_for(demo_dir, "cuda", **SMALL, qsa_kv_offload=False).kv_offload
    for device in ("cuda", "cpu"):
        plan = plan_for(demo_dir, device, **LARGE, qsa_kv_offload=True)
        assert plan.kv_offload and plan.kv_placement == "--qsa-kv-offload"


def test_host_ram_bounds_the_offloaded_blocks(demo_dir):
    plan = plan_for(demo_dir, "cuda", host_blocks(demo_dir, 600), **SMALL, qsa_kv_offload=True)
    assert plan.num_blocks == 600 and plan.host_bytes() == plan.host_available_bytes
    assert plan.host_source.startswith("--host-memory-bytes")
    with pytest.raises(CapacityError, match="host RAM for the QSA K/V: .* needs 512 blocks"):
        plan_for(demo_dir, "cuda", host_blocks(demo_dir, 100), **SMALL, qsa_kv_offload=True)


def test_plan_rejects_host_ram_too_small(demo_dir, capsys):
    argv = ["plan", str(demo_dir), "--kv-cache-memory-bytes", "20000000", "--qsa-kv-offload",
            "--host-memory-bytes", "1000"]
    assert main([*argv, "--no-enable-prefix-caching"]) == 2
    assert "host RAM for the QSA K/V" in capsys.readouterr().err
    assert main(argv) == 2  # the checkpoints come first
    assert "host RAM for the prefix-cache checkpoints: 8 x 95,760 B" in capsys.readouterr().err


# ---- the real model at the seed's release settings ---------------------------------------------------

# the fact sheet's deduced real config (docs: qwen4-exp-architecture.md section 14)
REAL = {
    "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 24,
    "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640, "hc_count": 4,
    "hc_lowrank": 320, "ple_layer_ids": [2], "ple_embed_dim": 2560, "ngram_size": 3, "heads_per_ngram": 8, "indexer_n_heads": 8,
    "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4, "eos_token_id": 248044,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
}
SEED_RANKS = (tuple(range(16)), tuple(range(16, 33)), tuple(range(33, 48)))  # the seed's PP=3 split 16/17/15
SEED_RELEASE = {"kv_cache_memory_bytes": 550_000_000, "max_model_len": 262144, "max_num_seqs": 4}


def test_real_config_sizes_match_the_fact_sheet():
    config = ModelConfig.from_dict(REAL)
    assert config.layer_types.count("indexed_attention") == 12
    assert plan_module.slot_bytes(config, "bfloat16") == 36 * (61_440 + 3_145_728) + 184_320 + 12 * 4 * 128 * 2 + 16
    assert plan_module.ple_table_bytes(config, "bfloat16") == 102_400_491_520  # 95.37 GiB
    assert plan_module.arena_rows_for(config, "bfloat16", 95 << 20) == (95 << 20) // (12 * (2 * 2 * 256 * 2 + 24))


@pytest.mark.parametrize("layer_ids", SEED_RANKS, ids=["rank0", "rank1", "rank2"])
def test_seed_release_settings_hold_four_full_length_requests_per_rank(layer_ids):
    """550 MB per GPU and 262,144 tokens with prefix caching on: each rank of the seed's split holds 4
    requests of max_model_len (the seed: 2.00), checkpoints in host RAM, and the plan says so."""
    config = ModelConfig.from_dict(REAL)
    plan = engine_cache_plan(EngineConfig(model="m", **SEED_RELEASE), config, "bfloat16", "cuda", 0,
                             host_memory_bytes=48 << 30, ple_mapped=True, layer_ids=layer_ids)
    assert plan.kv_offload and plan.prefix_caching and plan.num_checkpoints == 8
    assert plan.requests_at_max_len >= 4
    lines = plan.lines()
    assert "capacity: 4.00 requests of max_model_len 262,144 at once (max_num_seqs 4), with prefix caching on" in lines
    assert plan.used_bytes() <= 550_000_000 and plan.arena_bytes <= 95 << 20  # the arena beside the budget
    assert plan.num_slots == 4 and plan.device_slots == 6  # + scratch + the checkpoints' staging slot
    assert plan.slot_bytes * 6 + (plan.num_blocks + 1) * plan.block_bytes == plan.used_bytes()
    printed = "\n".join(lines)
    for tier in ("weights", "state slots", "QSA device rows", "QSA row-cache arena", "QSA K/V pools",
                 "prefix-cache checkpoints: 8 x"):
        assert tier in printed, tier
    assert ("page cache left for the mapped PLE tables" in printed) == (0 in layer_ids)  # the PLE layer's rank


def test_the_whole_real_model_on_one_550_mb_device_is_refused_with_the_reason():
    """One rank with all 48 layers: 6 slots of 115.6 MB (4 running, scratch, staging) leave nothing for
    262,144 tokens of indexer keys."""
    with pytest.raises(CapacityError, match="holds 0 blocks of 16 tokens after 6 state slots of 115,65"):
        engine_cache_plan(EngineConfig(model="m", **SEED_RELEASE), ModelConfig.from_dict(REAL), "bfloat16", "cuda",
                          0, host_memory_bytes=48 << 30)
