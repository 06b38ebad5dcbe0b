"""Pipeline parallelism on two GPUs (NCCL, CUDA graphs, overlap scheduling; skipped without 2 GPUs): the demo
model in fp32 gives one GPU's greedy tokens with PP=2, with and without MTP drafts (the draft head on the
last rank). The CPU tests (test_pipeline.py, test_pipeline_speculative.py) cover the same logic over gloo;
these run what only CUDA has: the sampled ids copied to rank 0's device on a side stream, the streams'
waits, the ranks' graphs.
"""

from __future__ import annotations

import json

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

OPTIONS = {"dtype": "float32", "device": "cuda", "max_model_len": 256, "max_num_seqs": 4,
           "kv_cache_memory_bytes": 64 << 20}
PROMPTS = ["Hello there, how are you", "The quick brown fox jumps over the lazy dog and",
           "def parse(tokens):\n    return [t for t in tokens if t]\n", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("pp-gpu") / "demo", "tiny", mtp=True)


@pytest.fixture(scope="module")
def one_gpu(demo) -> list:
    llm = LLM(str(demo), **OPTIONS)
    try:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("k", [0, 1, 3], ids=["no-drafts", "mtp-k1", "mtp-k3"])
def test_two_gpus_give_one_gpus_tokens(demo, one_gpu, k):
    spec = {"speculative_config": json.dumps({"method": "mtp", "num_speculative_tokens": k})} if k else {}
    llm = LLM(str(demo), **OPTIONS, pipeline_parallel_size=2, **spec)
    try:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert got == one_gpu
        if k:
            assert llm.engine.stats().num_draft_tokens > 0
    finally:
        llm.engine.close()
