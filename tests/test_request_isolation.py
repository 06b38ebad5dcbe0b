"""One request's failure is its own: sampling numerics at every edge, and a request whose part of a step
fails (NaN logits, its grammar) ends alone while the rest of the batch goes on (engine level, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.sampling_plan import MIN_TEMPERATURE

VOCAB = 64
EDGES = [0.0, 5e-324, 1e-46, 1e-39, 1e-38, MIN_TEMPERATURE / 2, MIN_TEMPERATURE, 1e-3, 0.7, 1.0, 2.0, 100.0,
         101.0, 1e30, 3.4e38, math.inf, -0.0, -1e-39, -1.0, math.nan]
logit_values = st.one_of(
    st.floats(-1e4, 1e4), st.sampled_from([-3.4e38, 3.4e38, -math.inf, 0.0, 1e-45, -1e-45, 88.0, -88.0])
)


class SamplingError(RuntimeError):
    """A row's failure (`Sampled.error`), raised by `sample_row`."""


def _request(params: SamplingParams) -> Request:
    return Request("r", [1, 2], params.with_defaults(None, None, None), frozenset({0}), 1024)


def sample_row(sampler: Sampler, row: torch.Tensor, request: Request) -> int:
    """One row through the batched sampler: its token, or its failure raised as SamplingError."""
    outcome = sampler.sample(row[None], [request], str)[0]
    if outcome.error is not None:
        raise SamplingError(outcome.error)
    return outcome.token_id


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    temperature=st.one_of(st.none(), st.sampled_from(EDGES), st.floats(allow_nan=True, allow_infinity=True)),
    top_p=st.one_of(st.none(), st.sampled_from(EDGES), st.floats(allow_nan=True, allow_infinity=True)),
    top_k=st.one_of(st.none(), st.integers(-3, 2 * VOCAB), st.sampled_from([2**63, -(2**63)])),
    min_tokens=st.integers(0, 3),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    logits=st.lists(logit_values, min_size=VOCAB, max_size=VOCAB),
)
def test_no_sampling_parameter_makes_the_sampler_raise(temperature, top_p, top_k, min_tokens, seed, logits):
    """Every value is either refused when the parameters are built (a ValueError naming it: HTTP 400) or
    gives a token in the vocabulary; a row with no finite logit to pick is this request's SamplingError."""
    try:
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_tokens=min_tokens, max_tokens=8, seed=seed
        )
        request = _request(params)
    except ValueError as exc:
        assert str(exc).split(" ", 1)[0] in {"temperature", "top_p", "top_k", "seed"}
        return
    row = torch.tensor(logits, dtype=torch.float32)
    try:
        token = sample_row(Sampler(0), row, request)
    except SamplingError:
        banned = {0} if min_tokens > 0 else set()  # EOS is masked before min_tokens
        allowed = [v for i, v in enumerate(row.tolist()) if i not in banned]
        assert max(allowed) == -math.inf  # the only allowed failure: nothing can be picked
        return
    assert 0 <= token < VOCAB and row[token] > -math.inf
    if min_tokens > 0:
        assert token != 0


def test_tiny_temperatures_and_top_p_are_greedy_and_huge_ones_are_finite():
    row = torch.tensor([1.0, 3.0, 2.0, -1e30, 3.4e38 / 2])
    for temperature in (1e-39, 5e-324, MIN_TEMPERATURE / 10):
        assert sample_row(Sampler(), row, _request(SamplingParams(temperature=temperature))) == 4
    for top_p in (1e-46, 5e-324):  # below the smallest fp32: top-p still keeps the most likely token
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=3)
        assert {sample_row(Sampler(), row, _request(params)) for _ in range(5)} == {4}
    flat = torch.zeros(8)
    draws = {sample_row(Sampler(i), flat, _request(SamplingParams(temperature=100.0))) for i in range(64)}
    assert len(draws) > 4  # a huge temperature still samples a proper distribution


def test_nan_logits_are_a_sampling_error():
    with pytest.raises(SamplingError, match="NaN"):
        sample_row(Sampler(), torch.tensor([0.0, math.nan, 1.0]), _request(SamplingParams(temperature=0)))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / "demo-tiny"
    build_demo_model(folder, "tiny")
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4)


def test_a_nan_row_ends_its_request_alone(llm, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(["one", "two", "three"], greedy)]
    runner = llm.engine.runner
    forward = runner.forward

    def poisoned(batch):
        logits = forward(batch)
        if logits.shape[0] == 3 and poisoned.steps == 2:  # the third step: "two"'s row only
            logits[1] = math.nan
        poisoned.steps += logits.shape[0] == 3
        return logits

    poisoned.steps = 0
    monkeypatch.setattr(runner, "forward", poisoned)
    outputs = llm.generate(["one", "two", "three"], greedy)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    assert "NaN" in outputs[1].outputs[0].stop_reason
    assert outputs[0].outputs[0].token_ids == expected[0] and outputs[2].outputs[0].token_ids == expected[2]
    assert outputs[1].outputs[0].token_ids == expected[1][:2]
    assert not llm.engine.has_unfinished_requests()  # its memory was freed with it


def test_a_grammar_that_fails_ends_its_request_alone(llm, monkeypatch):
    from tierlm.engine.structured_output import GrammarState
    from tierlm.sampling_params import StructuredOutputRequest

    def broken(self, bitmask, row):
        raise RuntimeError("matcher state corrupted")

    monkeypatch.setattr(GrammarState, "fill_token_bitmask", broken)
    json_params = SamplingParams(temperature=0, max_tokens=4, structured_output=StructuredOutputRequest(
        json_object=True))
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.engine.add_request("a", json_params, "json")
    llm.engine.add_request("b", plain, "plain")
    finished = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    assert finished["json"].finish_reason == "error" and "matcher state corrupted" in finished["json"].stop_reason
    assert finished["plain"].finish_reason == "length" and len(finished["plain"].token_ids) == 4
