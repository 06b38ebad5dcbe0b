"""The offline API on the demo model: generation, determinism, sampling options, log-probabilities."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(str(demo_dir), dtype="float32", device="cpu", max_model_len=512, max_num_seqs=4)


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x"]


def test_generates_text_and_tokens(llm):
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    completion = out.outputs[0]
    assert len(completion.token_ids) == 12
    assert completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
    assert out.prompt == PROMPTS[0] and out.prompt_token_ids == llm.get_tokenizer().encode(PROMPTS[0])


def test_greedy_is_deterministic_and_batch_invariant(llm):
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert alone == batched == again


def test_token_id_prompts_equal_text_prompts(llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    assert (llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
            == llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    # the same seed gives the same tokens even next to other requests
    second = llm.generate([PROMPTS[2], PROMPTS[0]], params)[1].outputs[0].token_ids
    other = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=8, max_tokens=10, ignore_eos=True))
    assert first == second
    assert other[0].outputs[0].token_ids != first


def test_n_completions(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_strings_and_stop_token_ids(llm):
    full = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    stop_token = full.token_ids[4]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]))[0]
    first = full.token_ids.index(stop_token)
    assert out.outputs[0].token_ids == full.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_token
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert out.outputs[0].text == full.text[: full.text.index(stop)]
    assert out.outputs[0].stop_reason == stop
    # of several stop strings the earliest match cuts (the later one is listed first), kept when asked
    early, late = full.text[5:9], full.text[len(full.text) // 2 : len(full.text) // 2 + 4]
    params = SamplingParams(temperature=0, max_tokens=12, stop=[late, early], include_stop_str_in_output=True,
                            ignore_eos=True)
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert out.text == full.text[: full.text.index(early) + 4] and out.stop_reason == early


def test_eos_ends_unless_ignored_and_min_tokens(llm):
    eos = llm.engine.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, ignore_eos=False)
    out = llm.generate(PROMPTS[3], params)[0].outputs[0]
    assert len(out.token_ids) == 5 and not set(out.token_ids) & eos


def test_prompt_logprobs_equal_reference_log_softmax(llm, demo_dir):
    """Against transformers' own forward over the demo checkpoint."""
    from transformers import Qwen4ExpForCausalLM

    reference = Qwen4ExpForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position in range(1, len(ids)):
        entry = out.prompt_logprobs[position]
        token = ids[position]
        assert math.isclose(entry[token].logprob, float(expected[position - 1, token]), abs_tol=1e-4)
        top = expected[position - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry)
        assert entry[top[0]].rank == 1
    # the greedy token is the reference's argmax after the prompt
    assert out.outputs[0].token_ids[0] == int(expected[-1].argmax())


def test_sampled_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 2
    assert math.isclose(completion.cumulative_logprob, sum(e[t].logprob for t, e in
                                                           zip(completion.token_ids, completion.logprobs)))


def test_generation_config_defaults_apply_when_unset(llm):
    """Unset temperature / top_p / top_k / repetition_penalty take generation_config.json's values; set ones
    are kept."""
    engine = llm.engine
    defaults = llm.get_tokenizer().generation_defaults
    assert defaults.temperature is not None and defaults.top_k is not None  # the demo model ships them
    saved = engine.tokenizer.generation_defaults
    engine.tokenizer.generation_defaults = dataclasses.replace(defaults, repetition_penalty=1.07)
    try:
        unset = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1))
        explicit = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.3, top_p=0.5, top_k=3,
                                                                 repetition_penalty=1.0))
    finally:
        engine.tokenizer.generation_defaults = saved
    queued = {r.request_id: r.params for r in engine.scheduler.waiting}
    assert (queued[unset].temperature, queued[unset].top_p, queued[unset].top_k, queued[unset].repetition_penalty) == (
        defaults.temperature, defaults.top_p, defaults.top_k, 1.07)
    assert (queued[explicit].temperature, queued[explicit].top_p, queued[explicit].top_k,
            queued[explicit].repetition_penalty) == (0.3, 0.5, 3, 1.0)
    for request_id in (unset, explicit):
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,message",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"n": 0}, "n must"), ({"logprobs": 50}, "logprobs"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
     ({"stop": [""]}, "stop")],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_errors(llm):
    with pytest.raises(ValueError, match="max_model_len is 512"):
        llm.generate({"prompt_token_ids": [5] * 600}, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**7]}, GREEDY)
    # the engine still serves afterwards
    assert len(llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == 12


def test_a_batch_shows_progress_unless_use_tqdm_is_false(llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(PROMPTS[:2], params)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], params)  # one prompt: no bar
    assert "Processed prompts" not in capsys.readouterr().err


def test_generate_cli_cpu_threads(demo_dir, capsys):
    import torch

    from tierlm.cli import main

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # (the suite runs on one thread: the flag must change it)
        assert main(["generate", str(demo_dir), "--prompt", "x", "--max-tokens", "2", "--cpu-threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["generate", str(demo_dir), "--prompt", "x", "--cpu-threads", "0"]) != 0
    assert "--cpu-threads must be at least 1" in capsys.readouterr().err
