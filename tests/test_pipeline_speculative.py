"""MTP speculative decoding with pipeline parallelism (engine/pipeline_speculative.py), on CPU (gloo ranks as
processes, demo tiny with an MTP head, fp32): the draft head on the last rank, verify rows through both
stages, the accepted count back on rank 0 and the rollback replayed on rank 1. Greedy output (a penalized
request too) is exactly one process's without drafts, whether the drafts are the head's own (random:
rejected, every step rolls back on both ranks) or an oracle's (forced acceptance, partial runs; a
preemption), and after a prefix-cache hit; a seeded sampled request with penalties gives one process's
output with drafts (rejection sampling on the last rank); a request with log-probabilities decodes one
token per step beside them, its log-probabilities within fp32 rounding of batches that differ (as
tests/test_pipeline.py allows for concurrent requests); a json_schema request decodes without drafts, its
greedy tokens one process's.
"""

from __future__ import annotations

import json

import pytest
from test_speculative import generate as generate_all

from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.engine.pipeline_speculative import PipelineSpeculation
from tierlm.sampling_params import SamplingParams, StructuredOutputRequest

# a prompt longer than a step's tokens: its prefill is chunked (the draft head runs over every chunk)
PROMPTS = ["Hello there, how are you", "def parse(tokens):\n    return [t for t in tokens if t]\n" * 2,
           "The quick brown fox", "JSON please:", "Give JSON:"]
OPTIONS = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 4,
           "max_num_batched_tokens": 24, "kv_cache_memory_bytes": 32 << 20, "max_state_checkpoints": 4}
MAX_TOKENS = 10
GREEDY = ("0", "1")  # speculating greedy requests (1 with a repetition penalty)
LOGPROBS, SAMPLED, GRAMMAR = 2, 3, 4
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7,
                           presence_penalty=0.5),
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                           structured_output=StructuredOutputRequest(json_schema=json.dumps(SCHEMA)))]


def spec(k: int, token_map: str | None = None) -> str:
    config = {"method": "mtp", "num_speculative_tokens": k}
    if token_map is not None:
        config["speculative_token_map"] = token_map
    return json.dumps(config)


@pytest.fixture(scope="module")
def even_ids(demo, tmp_path_factory) -> tuple[str, set[int]]:
    """A speculative token map of the demo vocabulary's even ids."""
    from tierlm.config import ModelConfig

    ids = set(range(0, ModelConfig.from_pretrained(demo).vocab_size, 2))
    path = tmp_path_factory.mktemp("pp-map") / "map.json"
    path.write_text(json.dumps(sorted(ids)))
    return str(path), ids


def generate(llm: LLMEngine, after_step=None) -> list:
    return generate_all(llm, params(), after_step, PROMPTS)


def generate_one(llm: LLMEngine):
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                return output
    raise AssertionError("no request finished")


def logprob_rows(completion) -> list:
    return [sorted((token, entry.logprob, entry.rank) for token, entry in position.items())
            for position in completion.logprobs]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("pp-spec") / "demo", "tiny", mtp=True)


@pytest.fixture(scope="module")
def reference(demo) -> list:
    """One process, no drafts."""
    return generate(LLMEngine(EngineConfig(model=str(demo), **OPTIONS)))


class Oracle:
    """After each step, the greedy requests' drafts become their reference continuation, the first draft made
    wrong every second step (accepted runs, and rejections right after them); at step 4 one of them is
    preempted mid-decode (recomputed on every rank, then drafting again)."""

    def __init__(self, reference: list, k: int) -> None:
        self.truth = {request_id: reference[int(request_id)].token_ids for request_id in GREEDY}
        self.k, self.steps = k, 0

    def __call__(self, llm: LLMEngine) -> None:
        self.steps += 1
        if self.steps == 4:
            victim = next(r for r in llm.scheduler.running if r.request_id in self.truth)
            llm.scheduler.running.remove(victim)
            llm.scheduler._preempt(victim)  # the scheduler's own preemption (a budget would differ per rank)
        for request in llm.scheduler.running:
            if request.request_id in self.truth and request.draft_token_ids:
                drafts = list(self.truth[request.request_id][len(request.output_token_ids):][: self.k])
                if self.steps % 2 and drafts:
                    drafts[0] = (drafts[0] + 1) % llm.model_config.vocab_size
                if drafts:
                    request.draft_token_ids = drafts


@pytest.mark.parametrize("k, oracle", [(1, False), (3, True)], ids=["k1-head-drafts", "k3-forced-acceptance"])
def test_pipeline_with_drafts_gives_one_process_output(demo, reference, even_ids, k, oracle):
    """(The head-drafts case drafts from a speculative token map: the last rank's head restricted to it.)"""
    token_map, allowed = even_ids if not oracle else (None, None)
    llm = LLMEngine(EngineConfig(model=str(demo), **OPTIONS, pipeline_parallel_size=2,
                                 speculative_config=spec(k, token_map)))
    try:
        assert isinstance(llm.runner, PipelineSpeculation)
        drafted = []
        forcing = Oracle(reference, k) if oracle else (lambda llm: drafted.extend(
            t for r in llm.scheduler.running for t in r.draft_token_ids))
        got = generate(llm, forcing)
        tokens = [out.token_ids for out in got]
        assert tokens[:SAMPLED] == [out.token_ids for out in reference[:SAMPLED]]
        # a grammar request decodes without drafts here (the last rank's grammar is rank 0's bitmask only)
        assert tokens[GRAMMAR] == reference[GRAMMAR].token_ids
        # batches differ from one process's (verify rows, two ranks' threads): fp32 sums may round differently
        for row, expected in zip(logprob_rows(got[LOGPROBS]), logprob_rows(reference[LOGPROBS]), strict=True):
            assert [entry[::2] for entry in row] == [entry[::2] for entry in expected]  # tokens and ranks
            assert max(abs(a[1] - b[1]) for a, b in zip(row, expected, strict=True)) <= 1e-4
        stats = llm.stats()
        assert stats.num_draft_tokens > 0
        if oracle:  # both paths ran, and accepted drafts saved steps
            assert llm.scheduler.num_preemptions == 1
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
            assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
            assert forcing.steps < len(PROMPTS) * MAX_TOKENS
            return
        assert drafted and set(drafted) <= allowed
        # the seeded sampled request: one process's output with drafts (not without: drafts change the draws)
        one_process = generate(LLMEngine(EngineConfig(model=str(demo), **OPTIONS,
                                                      speculative_config=spec(k, token_map))))
        assert tokens[SAMPLED] == one_process[SAMPLED].token_ids != reference[SAMPLED].token_ids
        # a prefix-cache hit restores every rank's state, the draft head's caches on the last rank too
        llm.add_request(PROMPTS[1], params()[1], request_id="again")
        again = generate_one(llm)
        assert again.num_cached_tokens > 0
        assert again.outputs[0].token_ids == reference[1].token_ids
    finally:
        llm.close()


def test_the_balanced_split_counts_the_draft_head_on_the_last_rank(demo):
    """The last rank's load has the draft head, the embedding it reads and its layer's caches; every layer's
    per-request states count K more times (the per-position slots)."""
    from tierlm.config import ModelConfig
    from tierlm.memory.partition import rank_loads
    from tierlm.memory.plan import weight_bytes
    from tierlm.model.checkpoint_layout import MTPLayout

    config = ModelConfig.from_pretrained(demo)
    mtp = MTPLayout(config.num_mtp_layers)
    layers, first, last = rank_loads(config, "float32", 2, 4, 256)
    layers_k, first_k, last_k = rank_loads(config, "float32", 2, 4, 256, mtp=mtp, num_speculative_tokens=2)
    head = sum(weight_bytes(config, "float32", mtp=mtp).values()) - sum(weight_bytes(config, "float32").values())
    assert not config.tie_word_embeddings and first_k == first  # the first rank's extra: the embedding
    assert last_k > last + head + first  # the head, the embedding, and the draft layer's caches
    assert all(with_k > plain for with_k, plain in zip(layers_k, layers, strict=True))  # every layer keeps state
