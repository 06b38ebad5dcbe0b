"""QSA K/V in host pools (and through the row cache) generate exactly what device pools generate."""

from __future__ import annotations

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_offload_with_and_without_row_cache_equals_device_pools(demo_dir, device):
    """On CUDA: pinned pools read over UVA by the Triton kernels, decode steps in CUDA graphs."""
    options = dict(device=device, max_model_len=512, max_num_seqs=4, enable_prefix_caching=False)
    prompts = ["def parse(tokens):\n" * 30, "import os\n", "class Node:\n    def __init__(self):\n" * 8]
    expected = LLM(str(demo_dir), **options).generate(prompts, PARAMS)
    for row_cache in (True, False):
        # a tiny cache: many slots collide, rows are evicted and refilled every step
        llm = LLM(str(demo_dir), **options, qsa_kv_offload=True, qsa_row_cache=row_cache, qsa_row_cache_rows=61)
        assert all(s.offload is not None for s in llm.engine.cache.layers if s.key_cache is not None)
        got = llm.generate(prompts, PARAMS)
        for a, b in zip(got, expected):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [list(p.items()) for p in a.outputs[0].logprobs] == [list(p.items()) for p in b.outputs[0].logprobs]
        stats = llm.engine.stats()
        if row_cache:
            assert stats.qsa_row_cache_hits > 0 and stats.qsa_row_cache_misses > 0
        else:
            assert stats.qsa_row_cache_hits == 0
