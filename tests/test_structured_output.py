"""Structured output in the engine: schemas checked at add_request, the grammar mask in the sampler,
termination in `Request.append_token`, and `LLM.generate` producing JSON that validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model
from tierlm.engine.request import Request, RequestStatus
from tierlm.engine.sampler import Sampler
from tierlm.engine.structured_output import StructuredOutputManager
from tierlm.sampling_params import StructuredOutputRequest

SCHEMAS = [
    {"type": "object", "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99}}},
    {"type": "object", "required": ["unit"], "properties": {"unit": {"enum": ["cm", "inch"]}}},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "required": ["point", "label"], "properties": {
        "point": {"type": "object", "required": ["x", "y"],
                  "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                 "y": {"type": "boolean"}}},
        "label": {"enum": ["a", "b", None]}}},
]


def schema_request(schema) -> StructuredOutputRequest:
    return StructuredOutputRequest(json_schema=json.dumps(schema))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def manager(llm):
    return StructuredOutputManager(llm.get_tokenizer(), llm.engine.model_config.vocab_size, [0, 2])


@pytest.mark.parametrize("schema", SCHEMAS, ids=["required", "enum", "int_array", "nested"])
def test_generate_follows_the_schema(llm, schema):
    prompts = ["def f(x):", "JSON please:"]
    greedy = SamplingParams(temperature=0, max_tokens=80, structured_output=schema_request(schema))
    sampled = SamplingParams(
        temperature=1.0, seed=11, n=2, max_tokens=80, structured_output=schema_request(schema)
    )
    outputs = [c for o in llm.generate(prompts, greedy) + llm.generate(prompts, sampled) for c in o.outputs]
    assert len(outputs) == 6
    for completion in outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_ignore_eos_still_stops_at_the_end_of_the_json(llm):
    params = SamplingParams(
        temperature=0, max_tokens=60, ignore_eos=True, structured_output=schema_request(SCHEMAS[1])
    )
    completion = llm.generate("x", params)[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert json.loads(completion.text)["unit"] in ("cm", "inch")


@pytest.mark.parametrize("schema_text, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "object", "properties": {"a": {"type": "nonsense"}}}',
     "not a valid JSON Schema at /properties/a/type"),
    ('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "not supported"),
])
def test_bad_schemas_are_refused_before_anything_is_queued(llm, schema_text, problem):
    params = SamplingParams(structured_output=StructuredOutputRequest(json_schema=schema_text))
    with pytest.raises(ValueError, match="json_schema") as error:
        llm.engine.add_request("x", params)
    assert problem in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_request_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputRequest()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputRequest(json_schema="{}", json_object=True)
    with pytest.raises(ValueError, match="JSON text"):
        StructuredOutputRequest(json_schema={"type": "object"})
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output="json")


def test_mask_covers_padded_vocabulary_and_special_tokens(llm):
    tokenizer = llm.get_tokenizer()
    padded = tokenizer.vocab_size + 64
    manager = StructuredOutputManager(tokenizer, padded, [0, 2])
    state = manager.new_state(StructuredOutputRequest(json_object=True))
    masked = torch.zeros(1, padded)
    xgrammar.apply_token_bitmask_inplace(masked, state.token_bitmask()[None])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    assert not any(t >= tokenizer.vocab_size or t in tokenizer.special_token_ids for t in allowed)


def test_json_object_grammar_accepts_json_and_terminates_on_eos(llm, manager):
    tokenizer = llm.get_tokenizer()
    state = manager.new_state(StructuredOutputRequest(json_object=True))
    assert all(state.accept(t) for t in tokenizer.encode('{"a": [1, 2.5, "x"], "b": {"c": null}}'))
    assert not state.is_terminated
    assert state.accept(2) and state.is_terminated


def test_compiled_grammars_are_cached_by_schema_text(manager):
    schema = schema_request(SCHEMAS[2])
    manager.new_state(schema)
    hits = manager._compile.cache_info().hits
    manager.new_state(schema)
    assert manager._compile.cache_info().hits == hits + 1


def _request(params: SamplingParams, state) -> Request:
    return Request("r", [5, 6], params, frozenset([2]), 256, structured_output=state)


def test_a_grammar_row_anywhere_in_the_batch_gets_its_own_mask(llm, manager):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=10).with_defaults(None, None, None)
    plain = _request(params, None)
    constrained = _request(params, manager.new_state(schema_request(SCHEMAS[2])))
    logits = torch.zeros(3, manager.vocab_size)
    logits[:, tokenizer.encode("x")[0]] = 100.0  # the model's favourite is not JSON
    tokens = [s.token_id for s in Sampler(0).sample(logits, [plain, plain, constrained], str)]
    assert tokens[:2] == [tokenizer.encode("x")[0]] * 2
    assert tokenizer.decode([tokens[2]]).startswith("[")


def test_greedy_sampling_obeys_the_mask(llm, manager):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=10).with_defaults(None, None, None)
    request = _request(params, manager.new_state(schema_request(SCHEMAS[2])))
    logits = torch.zeros(manager.vocab_size)
    logits[tokenizer.encode("x")[0]] = 100.0  # the model's favourite is not JSON
    token = Sampler(0).sample(logits[None], [request], str)[0].token_id
    assert tokenizer.decode([token]).startswith("[")
    assert logits[tokenizer.encode("x")[0]] == 100.0  # the runner's row is left as it was (logprobs read it)


def test_append_token_ends_the_request_when_the_grammar_terminates(llm, manager):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=50, ignore_eos=True, min_tokens=40)
    request = _request(params, manager.new_state(schema_request(SCHEMAS[1])))
    for token in tokenizer.encode('{"unit": "cm"}'):
        request.append_token(token)
        assert not request.is_finished
    request.append_token(2)
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_a_token_the_grammar_rejects_fails_only_that_request(llm, manager):
    request = _request(SamplingParams(max_tokens=5), manager.new_state(schema_request(SCHEMAS[1])))
    request.append_token(llm.get_tokenizer().encode("x")[0])
    assert request.status == RequestStatus.FINISHED_ERROR


def test_rollback_returns_to_the_earlier_state_across_the_reasoning_end(llm, manager):
    """`GrammarState.rollback` (speculative decoding walks matchers over drafts and back): rolled back by n
    tokens, a state allows exactly what it allowed before them, the reasoning reopened if its end token was
    among them; a terminated state rolls back too."""
    tokenizer = llm.get_tokenizer()
    end, thinking, json_ids = 7, tokenizer.encode("so"), tokenizer.encode('{"unit": "cm"}')
    request = StructuredOutputRequest(json_schema=json.dumps(SCHEMAS[1]), reasoning_end_token_id=end)
    state, fresh = manager.new_state(request), manager.new_state(request)
    for token in thinking + [end] + json_ids[:2]:
        assert state.accept(token) and fresh.accept(token)
    assert all(state.accept(t) for t in json_ids[2:]) and state.accept(2) and state.is_terminated
    state.rollback(len(json_ids) - 2 + 1)
    assert not state.is_terminated and torch.equal(state.token_bitmask(), fresh.token_bitmask())
    state.rollback(3)  # the two JSON tokens and the end token
    assert state.phase == "open" and state.token_bitmask() is None
    plain = manager.new_state(schema_request(SCHEMAS[1]))
    assert state.accept(end) and state.accept(json_ids[0]) and plain.accept(json_ids[0])
    assert torch.equal(state.token_bitmask(), plain.token_bitmask())
