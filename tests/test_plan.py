"""`tierlm plan` prints what the engine logs at start-up for the same settings."""

from __future__ import annotations

import logging

import pytest

from tierlm.cli import main
from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


SETTINGS = [
    dict(kv_cache_memory_bytes=20_000_000),
    dict(kv_cache_memory_bytes=3_000_000, max_model_len=1024, max_num_seqs=2),
    dict(kv_cache_memory_bytes=8_000_000, max_model_len=2048, enable_prefix_caching=False, block_size=32),
    dict(kv_cache_memory_bytes=5_000_000, max_model_len=512, max_num_seqs=3, max_state_checkpoints=1),
]


def cli_args(settings: dict) -> list[str]:
    args = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("settings", SETTINGS)
def test_plan_prints_the_engine_startup_figures(demo_dir, settings, capsys, caplog):
    assert main(["plan", str(demo_dir), *cli_args(settings)]) == 0
    printed = capsys.readouterr().out.splitlines()[1:]  # after the model line
    with caplog.at_level(logging.INFO, logger="tierlm"):
        engine = LLMEngine(EngineConfig(model=str(demo_dir), device="cpu", **settings))
    logged = [r.getMessage() for r in caplog.records if r.name == "tierlm"]
    assert printed == logged == engine.cache_plan.lines()
    plan = engine.cache_plan
    # the pools really have the planned sizes, within the budget
    assert engine.cache.num_blocks == plan.num_blocks and engine.cache.num_slots == plan.num_slots
    assert plan.used_bytes() <= plan.budget_bytes
    if settings.get("enable_prefix_caching", True):
        assert plan.num_checkpoints == settings.get("max_state_checkpoints", 2 * settings.get("max_num_seqs", 4))
    else:
        assert plan.num_checkpoints == 0


def test_plan_rejects_a_budget_too_small(demo_dir, capsys):
    assert main(["plan", str(demo_dir), "--kv-cache-memory-bytes", "1000"]) == 2
    assert "raise --kv-cache-memory-bytes" in capsys.readouterr().err
