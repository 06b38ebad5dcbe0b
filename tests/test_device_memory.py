"""Memory discipline: after start-up and a warm-up, serving takes no new device memory, and the engine
reports its device memory (allocated, reserved, peak)."""

from __future__ import annotations

import random

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


def mixed_requests(count: int, seed: int, max_prompt: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(count):
        prompts.append({"prompt_token_ids": [rng.randrange(2, 500) for _ in range(rng.randint(1, max_prompt))]})
        kind = rng.randrange(3)
        params.append(SamplingParams(
            temperature=0 if kind == 0 else 0.8, top_p=1.0 if kind < 2 else 0.9, max_tokens=rng.randint(1, 48),
            ignore_eos=True, logprobs=2 if kind == 2 else None, seed=rng.randrange(1000) if kind == 1 else None,
        ))
    return prompts, params


def test_stats_report_no_device_memory_on_cpu(demo_dir):
    llm = LLM(str(demo_dir), device="cpu", max_model_len=256, max_num_seqs=2)
    stats = llm.engine.stats()
    assert (stats.device_memory_allocated, stats.device_memory_reserved, stats.device_memory_peak) == (0, 0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_serving_mixed_requests_takes_no_new_device_memory(demo_dir):
    llm = LLM(str(demo_dir), device="cuda", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)
    llm.generate(*mixed_requests(24, seed=0, max_prompt=900))  # warm-up: every shape class once
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    stats = llm.engine.stats()
    # (the peak may exceed what is reserved now: start-up frees its cached segments once warm)
    assert 0 < stats.device_memory_allocated <= min(stats.device_memory_peak, stats.device_memory_reserved)
    outputs = llm.generate(*mixed_requests(100, seed=1, max_prompt=900))
    assert len(outputs) == 100
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    # no new cudaMalloc segment, no retry, the same reserved bytes
    assert after["segment.all.allocated"] == before["segment.all.allocated"]
    assert after["num_alloc_retries"] == before["num_alloc_retries"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
