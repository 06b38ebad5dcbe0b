"""Prefix-cache checkpoints in host RAM: exact spill and restore, LRU eviction, many conversations."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model
from tierlm.memory.plan import checkpoint_bytes
from tierlm.model.model_cache import ModelCache

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


def make(demo_dir, **options):
    defaults = {"dtype": "float32", "device": options.pop("device", "cpu"), "max_model_len": 512, "max_num_seqs": 4,
                    "kv_cache_memory_bytes": 40_000_000}
    return LLM(str(demo_dir), **{**defaults, **options})


def prompt(seed: int, length: int = 20) -> dict:
    """Token ids whose first block differs from every other seed's (a hash chain of its own)."""
    ids = torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return {"prompt_token_ids": ids}


@pytest.mark.parametrize("device", DEVICES)
def test_spill_and_restore_are_exact(demo_dir, device):
    """Random state in two slots -> host rows -> other slots: every pool equal bit for bit, the row the
    planner's size, and a saved row unchanged by later writes to its slot; device copies too."""
    config = ModelConfig.from_pretrained(demo_dir)
    cache = ModelCache(config, num_slots=4, num_blocks=8, block_size=16, dtype=torch.float32, device=device,
                       num_host_checkpoints=3)
    assert cache.checkpoints.pool.pinned == (device == "cuda")
    assert cache.checkpoints.row_bytes == checkpoint_bytes(config, "float32")
    assert cache.checkpoints.nbytes == 3 * checkpoint_bytes(config, "float32")
    generator = torch.Generator().manual_seed(0)
    for state in cache.slot_states:
        for pool in state.slot_pools:
            pool.copy_(torch.randint(0, 1000, pool.shape, generator=generator).to(pool.dtype).to(device))
    before = [[pool[slot].clone() for state in cache.slot_states for pool in state.slot_pools] for slot in (0, 1)]
    cache.save_checkpoint(0, 2)
    cache.save_checkpoint(1, 0)
    cache.reset_slot(0)  # the slot moves on; its saved copy must not
    cache.restore_checkpoint(2, 3)
    cache.restore_checkpoint(0, 2)
    for state in cache.slot_states:  # and a slot copied on the device, as each kind copies it
        state.copy_slot(3, 1)
    for slot, expected in ((3, before[0]), (2, before[1]), (1, before[0])):
        got = [pool[slot] for state in cache.slot_states for pool in state.slot_pools]
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("device", DEVICES)
def test_a_conversation_resumed_after_50_others_hits_and_matches(demo_dir, device):
    """Its checkpoint went to host RAM and came back: the same tokens as a run without prefix caching."""
    row = checkpoint_bytes(ModelConfig.from_pretrained(demo_dir), "float32")
    llm = make(demo_dir, device=device, checkpoint_host_bytes=200 * row)
    plain = make(demo_dir, device=device, enable_prefix_caching=False)
    plan = llm.engine.cache_plan
    assert plan.num_checkpoints == 200 and llm.engine.cache.checkpoints.nbytes == plan.host_checkpoint_bytes()
    assert llm.engine.cache.num_slots == 4  # the device keeps the running requests' slots only
    first = prompt(0)
    turn1 = llm.generate(first, GREEDY)[0]
    llm.generate([prompt(seed) for seed in range(1, 51)], SamplingParams(temperature=0, max_tokens=1))
    assert len(llm.engine.cache_manager.checkpoints) == 51  # one each, at token 16: none evicted
    resumed = {"prompt_token_ids": first["prompt_token_ids"] + turn1.outputs[0].token_ids + [5, 6, 7]}
    turn2 = llm.generate(resumed, GREEDY)[0]
    assert turn2.num_cached_tokens == 16  # its prompt checkpoint (the last block boundary of turn 1's prompt)
    expected = [plain.generate(first, GREEDY)[0], plain.generate(resumed, GREEDY)[0]]
    assert [turn1.outputs[0].token_ids, turn2.outputs[0].token_ids] == [e.outputs[0].token_ids for e in expected]


def test_checkpoints_are_evicted_least_recently_used(demo_dir):
    """Two host rows: A, B, then A again (a hit makes it the newest), then C evicts B, not A."""
    llm = make(demo_dir, max_state_checkpoints=2)
    a, b, c = prompt(100), prompt(101), prompt(102)  # 20 tokens: one checkpoint each, at token 16

    def hits(p: dict) -> int:
        return llm.generate(p, GREEDY)[0].num_cached_tokens

    assert [hits(a), hits(b), hits(a), hits(c)] == [0, 0, 16, 0]
    assert hits(a) == 16  # still there (now the newest)
    assert hits(b) == 0  # evicted: its blocks are cached, but no checkpoint ends at them


def test_serve_flags_reach_engine_config():
    from tierlm.cli import build_parser
    from tierlm.server.cli import engine_config

    argv = ["serve", "m", "--checkpoint-host-bytes", "123456789", "--qsa-row-cache-bytes", "4096"]
    config = engine_config("m", build_parser(argv).parse_args(argv))
    assert (config.checkpoint_host_bytes, config.qsa_row_cache_bytes) == (123456789, 4096)


def test_the_model_never_imports_the_planner():
    """memory/ may depend on model/, never the reverse: importing the model and its cache loads no plan."""
    code = ("import sys, tierlm.model.qwen4_exp, tierlm.model.model_cache, tierlm.model.static_decode; "
            "assert 'tierlm.memory.plan' not in sys.modules, 'tierlm.memory.plan imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
