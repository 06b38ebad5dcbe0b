"""Prefix caching with recurrent-state checkpoints, and preemption, on the demo model (fp32)."""

from __future__ import annotations

import pytest

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


def make(demo_dir, **options):
    defaults = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "max_num_seqs": 4}
    return LLM(str(demo_dir), **{**defaults, **options})


def conversation(llm, first_prompt, follow_up, turns=2):
    """Each turn resends the whole history (token ids) plus new text, as a chat client does."""
    history, outputs = list(first_prompt), []
    for turn in range(turns):
        out = llm.generate({"prompt_token_ids": history}, GREEDY)[0]
        outputs.append(out)
        if turn < turns - 1:
            history = history + out.outputs[0].token_ids + follow_up[turn]
    return outputs


def assert_same_generation(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for pos_a, pos_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        # the values of the top tokens agree (a near-tie may order two alternatives differently)
        top_a = sorted(e.logprob for e in pos_a.values())
        top_b = sorted(e.logprob for e in pos_b.values())
        assert max(abs(x - y) for x, y in zip(top_a, top_b)) <= 1e-5, (pos_a, pos_b)


def test_second_turn_reuses_first_turn(demo_dir):
    cached, uncached = make(demo_dir), make(demo_dir, enable_prefix_caching=False)
    tokenizer = cached.get_tokenizer()
    first = tokenizer.encode("def parse(tokens):\n    " * 12)
    follow_up = [tokenizer.encode(" and then the next question " * 3), tokenizer.encode(" thanks")]
    with_cache = conversation(cached, first, follow_up, turns=3)
    without = conversation(uncached, first, follow_up, turns=3)
    block = cached.engine.cache_plan.block_size
    assert with_cache[0].num_cached_tokens == 0
    for turn in (1, 2):
        # the hit reaches the latest block boundary the previous turn computed (its decode checkpoint)
        previous_computed = len(with_cache[turn - 1].prompt_token_ids) + len(with_cache[turn - 1].outputs[0].token_ids) - 1
        assert with_cache[turn].num_cached_tokens == previous_computed // block * block
        assert without[turn].num_cached_tokens == 0
    for a, b in zip(with_cache, without):
        assert_same_generation(a, b)
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits == with_cache[1].num_cached_tokens + with_cache[2].num_cached_tokens
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits > 0


def test_identical_prompt_hits_its_prompt_checkpoint(demo_dir):
    llm = make(demo_dir)
    prompt = llm.get_tokenizer().encode("import collections\n" * 20)
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    second = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    block = llm.engine.cache_plan.block_size
    assert second.num_cached_tokens == (len(prompt) - 1) // block * block > 0
    assert_same_generation(first, second)


def test_few_checkpoints_are_recycled_and_stay_correct(demo_dir):
    llm, reference = make(demo_dir, max_state_checkpoints=1), make(demo_dir, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(f"value_{i} = compute({i})\n" * 8) for i in range(4)]
    for _ in range(2):
        for prompt in prompts:
            assert_same_generation(llm.generate({"prompt_token_ids": prompt}, GREEDY)[0],
                                   reference.generate({"prompt_token_ids": prompt}, GREEDY)[0])
    assert len(llm.engine.cache_manager.checkpoints) <= 1


def test_preemption_under_a_tiny_budget_loses_nothing(demo_dir):
    plan = make(demo_dir).engine.cache_plan
    # room for one request of max_model_len 256 plus a little: several concurrent requests must preempt
    blocks = 256 // plan.block_size + 6  # + 1 scratch block and 4 running + 1 scratch slots (checkpoints: host)
    budget = (blocks + 1) * plan.block_bytes + 5 * plan.slot_bytes
    tight = make(demo_dir, max_model_len=256, kv_cache_memory_bytes=budget, max_state_checkpoints=2)
    roomy = make(demo_dir, max_model_len=256, enable_prefix_caching=False)
    tokenizer = roomy.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(f"# file {i}\n" + "x = 1\n" * (5 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    got, expected = tight.generate(prompts, params), roomy.generate(prompts, params)
    assert tight.engine.cache_plan.num_blocks == blocks
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(got, expected):
        assert_same_generation(a, b)
        assert a.outputs[0].finish_reason == "length"
