"""Every sampling field has its effect, on the demo model at fixed seeds (engine level, CPU): penalties,
logit bias, min-p, bad words, allowed ids; and the batched sampler gives each row what it would alone."""

from __future__ import annotations

import collections

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8)


def greedy(llm, max_tokens: int = 40, **fields) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


def test_penalties_stop_repeats(llm):
    baseline = collections.Counter(greedy(llm))
    assert max(baseline.values()) > 1  # greedy decoding repeats itself here
    for field in ("presence_penalty", "frequency_penalty"):
        assert max(collections.Counter(greedy(llm, **{field: 2.0})).values()) == 1, field
    tokens = greedy(llm, repetition_penalty=5.0)
    assert max(collections.Counter(tokens).values()) == 1
    prompt_ids = set(llm.get_tokenizer().encode(PROMPT))
    assert len(prompt_ids & set(tokens)) <= len(prompt_ids & set(baseline))  # the prompt's tokens count too


def test_logit_bias_forces_and_forbids(llm):
    assert set(greedy(llm, 8, logit_bias={1234: 100.0})) == {1234}
    first = greedy(llm, 1)[0]
    assert greedy(llm, 1, logit_bias={first: -100.0})[0] != first


def test_min_p_one_keeps_only_the_most_likely_token(llm):
    sampled = SamplingParams(temperature=1.0, seed=7, min_p=1.0, max_tokens=20, ignore_eos=True)
    assert llm.generate(PROMPT, sampled)[0].outputs[0].token_ids == greedy(llm, 20)
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    assert llm.generate(PROMPT, free)[0].outputs[0].token_ids != greedy(llm, 20)


def test_bad_words_and_allowed_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    baseline = greedy(llm, 12)
    word = tokenizer.decode([baseline[0]]).strip()
    banned = {tokenizer.encode(word, add_special_tokens=False)[-1], tokenizer.encode(" " + word)[-1]}
    assert not banned & set(greedy(llm, 12, bad_words=[word]))
    allowed = [baseline[3], 77, 1500]
    assert set(greedy(llm, 12, allowed_token_ids=allowed)) <= set(allowed)
    with pytest.raises(ValueError, match="logit_bias"):
        greedy(llm, 1, logit_bias={10**6: 1.0})


def test_a_batch_samples_each_row_as_it_would_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    params = [
        SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1, top_k=20),
        SamplingParams(temperature=0.7, seed=2, top_p=0.5, frequency_penalty=1.0),
        SamplingParams(temperature=0, logit_bias={7: 50.0}), SamplingParams(temperature=1.0, seed=3, min_p=0.2),
    ]

    def request(p: SamplingParams) -> Request:
        return Request("r", [1, 2], p.with_defaults(None, None, None), frozenset({0}), 1024, output_token_ids=[5, 5])

    together = Sampler().sample(logits, [request(p) for p in params], str)
    alone = [Sampler().sample(logits[i : i + 1], [request(p)], str)[0] for i, p in enumerate(params)]
    assert [s.token_id for s in together] == [s.token_id for s in alone]
    assert together[3].token_id == 7
