"""MTP speculative decoding in the engine (engine/speculative.py): greedy output with drafts is exactly the
output without them, whether the drafts are rejected (the demo model's random draft head: the rollback
path) or accepted (drafts from an oracle that knows the greedy continuation, some of them wrong: the accept
path, partial runs, and stops and max_tokens inside an accepted run); bad configurations are refused.
With overlap scheduling greedy steps chain on the device's own outputs: forced acceptance there comes from
drafts made on the device (`device_oracle`), and stops, aborts and prefix-cache checkpoints are checked
with a step in flight. Structured-output requests speculate under their grammars: greedy tokens those of no
drafts, many concurrent requests valid, drafts the grammar forbids never accepted.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tierlm.demo_model import TRAINED_DEFAULT_DIR, build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.engine.speculative import SpeculativeConfig, SpeculativeRunner
from tierlm.sampling_params import SamplingParams

PROMPTS = ["Hello there, how are you", "The quick brown fox jumps over the lazy dog and"]
MAX_TOKENS = 12


def spec(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these tiny multi-row forwards run no faster on two, and much slower when other
    processes hold the cores (threads spinning for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("spec") / "demo", "tiny", mtp=True)


def engine(folder, speculative_config=None, **options) -> LLMEngine:
    options = {"kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 2, **options}
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                  speculative_config=speculative_config, **options))


def generate(llm: LLMEngine, params: list[SamplingParams], after_step=None, prompts: list[str] = PROMPTS) -> list:
    """Every prompt with its params; the completions in prompt order (after_step(llm) after each step)."""
    ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
        if after_step is not None:
            after_step(llm)
    return [done[i] for i in ids]


def greedy(max_tokens: int = MAX_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **fields)


@pytest.fixture(scope="module")
def reference(demo) -> list[list[int]]:
    """Greedy tokens of both prompts without speculation (batched together)."""
    return [out.token_ids for out in generate(engine(demo), [greedy(), greedy()])]


def test_rejected_drafts_roll_back_exactly(demo, reference):
    """The demo's random draft head is (nearly) never right: every step restores and recomputes."""
    llm = engine(demo, spec(1))
    assert isinstance(llm.runner, SpeculativeRunner)
    got = generate(llm, [greedy(), greedy()])
    assert [out.token_ids for out in got] == reference
    stats = llm.stats()
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


class Oracle:
    """After each step, replaces every running request's drafts with its greedy continuation (known from
    the reference), the draft at position `wrong` of every second step made wrong."""

    def __init__(self, continuations: dict[str, list[int]], k: int, wrong: int) -> None:
        self.continuations, self.k, self.wrong, self.steps = continuations, k, wrong, 0

    def __call__(self, llm: LLMEngine) -> None:
        self.steps += 1
        for request in llm.scheduler.running:
            truth = self.continuations[request.request_id]
            drafts = list(truth[len(request.output_token_ids) :][: self.k])
            if self.steps % 2 and len(drafts) > self.wrong:
                drafts[self.wrong] = (drafts[self.wrong] + 1) % llm.model_config.vocab_size
            if drafts:
                request.draft_token_ids = drafts


def test_accepted_drafts_give_the_same_tokens(demo, reference):
    llm = engine(demo, spec(3))
    oracle = Oracle({"0": reference[0], "1": reference[1]}, 3, wrong=1)
    got = generate(llm, [greedy(), greedy()], oracle)
    assert [out.token_ids for out in got] == reference
    stats = llm.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths ran
    # accepted drafts save steps: fewer than one step per token after the prompt
    assert oracle.steps < 1 + MAX_TOKENS
    # per draft position (vLLM's ..._per_pos): draft 2 is wrong every other step, so fewer get past it
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == stats.num_accepted_tokens
    assert per_pos[0] >= per_pos[1] > per_pos[2] >= 0 and per_pos[1] < stats.num_drafts
    from tierlm.server.metrics import Metrics

    text = Metrics("demo", llm.stats).render().decode()
    for position, count in enumerate(per_pos):
        line = f'tierlm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="demo",position="{position}"}}'
        assert f"{line} {float(count)}" in text


@pytest.mark.parametrize("k", [1, 3])
def test_fixed_shape_verify_steps_give_the_same_tokens(demo, reference, k):
    """The verification steps through a `StaticDecodeRunner` of 1 + K rows per request (what CUDA graphs
    replay; mode "eager" runs the same padded fixed-shape batches on CPU): max_num_seqs 3 pads the two
    requests to the prepared size, and a block-table width wider than theirs. Rejected and accepted drafts.
    Greedy steps verifying K drafts each run as one fixed-shape step (`GreedySpeculation`: verify, accept,
    draft; one CUDA graph replay on a GPU), a rejection moving the request's state slot to its kept row's:
    the finished requests give back the slots they were given."""
    llm = engine(demo, spec(k), max_num_seqs=3)
    runs = fixed_shapes(llm, k)
    oracle = Oracle({"0": reference[0], "1": reference[1]}, k, wrong=0)
    got = generate(llm, [greedy(), greedy()], oracle)
    assert [out.token_ids for out in got] == reference
    assert sorted(llm.cache_manager.free_slots) == [0, 1, 2]
    # greedy steps verifying K drafts each run on the device (`_greedy_step`), as one step of 2 requests
    assert ("step", 2) in runs
    stats = llm.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens  # counted on the device path too
    assert stats.num_accepted_tokens_per_pos[0] < stats.num_drafts  # draft 1 is wrong every other step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("k", [1, 3])
def test_graph_steps_on_a_gpu_give_the_eager_tokens(demo, k):
    """On a GPU (fp32) each greedy step verifying K drafts is one CUDA graph replay (verify, accept, roll
    back, draft, the next step's inputs): the tokens are those of no drafts, of serial steps and of eager
    speculative steps, with the head's own drafts (rejected) and with oracle drafts (accepted, some wrong;
    made on the device, so the steps overlap scheduling chains verify them)."""
    def cuda(speculative_config=None, **options):
        return LLMEngine(EngineConfig(model=str(demo), dtype="float32", device="cuda", max_num_seqs=2,
                                      kv_cache_memory_bytes=32 << 20, speculative_config=speculative_config,
                                      **options))

    from tierlm.model import static_decode
    from tierlm.model.speculative_step import OracleSpeculation

    expected = [out.token_ids for out in generate(cuda(), [greedy(), greedy()])]
    continuations = {"0": expected[0], "1": expected[1]}
    for oracle in (False, True):
        runs = []
        with pytest.MonkeyPatch.context() as patch:
            if oracle:  # the greedy graphs draft the known continuation (what chained steps verify)
                patch.setattr(static_decode, "GreedySpeculation", OracleSpeculation)
            graphs = cuda(spec(k))
        verify = graphs.runner.static_verify
        assert verify.mode == "cuda_graph" and verify.greedy_graphs

        def counted(shape, n, replay=verify.replay_greedy, runs=runs):
            runs.append(n)
            return replay(shape, n)

        verify.replay_greedy = counted
        chained = []
        for llm in (graphs, cuda(spec(k), async_scheduling=False), cuda(spec(k), enforce_eager=True)):
            after = None
            if oracle and llm is graphs:
                after, chained = device_oracle(llm, k, continuations, wrong=k - 1)
            elif oracle:
                after = Oracle(continuations, k, wrong=0)
            assert [out.token_ids for out in generate(llm, [greedy(), greedy()], after)] == expected
        assert runs and (not oracle or (chained and graphs.stats().num_accepted_tokens > 0))


def fixed_shapes(llm: LLMEngine, k: int) -> list:
    """Give the engine's speculative runner fixed-shape runners (mode "eager": what CUDA graphs replay, on
    CPU) for up to 3 requests; returns the list their runs are recorded in."""
    from tierlm.model.static_decode import StaticDecodeRunner
    from tierlm.model.static_slot_copy import StaticSlotCopy

    static = StaticDecodeRunner(llm.runner.model, llm.cache, 3, 8, "eager", sizes=[3], widths=[8],
                                rows_per_request=1 + k, greedy_speculation=True)
    runs = []
    static.run = lambda batch, run=static.run: runs.append(batch.token_ids.shape[0]) or run(batch)
    static.replay = lambda shape, rows, replay=static.replay: runs.append(rows) or replay(shape, rows)
    static.replay_greedy = lambda shape, n, replay=static.replay_greedy: runs.append(("step", n)) or replay(shape, n)
    static.replay_accept = lambda shape, n, best, replay=static.replay_accept: (
        runs.append(("accept", n)) or replay(shape, n, best))
    drafts = {}
    for rows in (1, 1 + k):
        drafts[0, rows] = StaticDecodeRunner(llm.runner.model, llm.cache, 3, 8, "eager", sizes=[3], widths=[8],
                                             draft_layer=0, rows_per_request=rows)
        drafts[0, rows].run = lambda batch, hidden, run=drafts[0, rows].run: (
            runs.append(("draft", batch.token_ids.shape[0])) or run(batch, hidden))
    llm.runner.static_verify, llm.runner.static_drafts = static, drafts
    rollback = llm.runner.static_rollback = StaticSlotCopy(llm.cache.target_slot_states, 3, llm.cache.scratch_slot,
                                                            llm.cache.device, "eager")
    rollback.copy = lambda sources, targets, copy=rollback.copy: runs.append("roll back") or copy(sources, targets)
    return runs


TRAINED = str(TRAINED_DEFAULT_DIR)  # a real MTP head (most drafts accepted)
TRAINED_TOKENS = 24


def trained_params() -> list[SamplingParams]:
    """Greedy, repetition_penalty left to the trained model's generation_config (1.05); the second request
    with frequency and presence penalties too (they change its greedy output)."""
    return [greedy(TRAINED_TOKENS), greedy(TRAINED_TOKENS, frequency_penalty=0.5, presence_penalty=0.5)]


@pytest.fixture(scope="module")
def trained_reference() -> list[list[int]]:
    return [out.token_ids for out in generate(engine(TRAINED), trained_params())]


@pytest.mark.parametrize("k, on_device", [(1, False), (3, False), (1, True), (3, True)])
def test_penalized_requests_speculate_exactly(trained_reference, k, on_device):
    """Penalized requests speculate, each verify row penalized with the drafts before it counted as output:
    the trained head's drafts are accepted and the greedy tokens are those without drafts, on the general
    path and on the device's greedy step (`_greedy_step`, through fixed-shape runners)."""
    llm = engine(TRAINED, spec(k), max_num_seqs=3 if on_device else 2)
    runs = fixed_shapes(llm, k) if on_device else []
    penalties = set()
    got = generate(llm, trained_params(), lambda llm: penalties.update(
        (r.params.repetition_penalty, r.params.presence_penalty) for r in llm.scheduler.running))
    assert [out.token_ids for out in got] == trained_reference
    assert penalties == {(1.05, 0.0), (1.05, 0.5)}
    assert 0 < llm.stats().num_accepted_tokens <= llm.stats().num_draft_tokens
    # penalized: the verify forward replays alone, then the rest of the step on the penalized logits
    assert not on_device or {2 * (1 + k), ("accept", 2)} <= set(runs)


@pytest.fixture(scope="module")
def trained_map(tmp_path_factory, trained_reference) -> tuple[str, set[int]]:
    """A speculative token map of every other distinct token (by id) of the trained model's greedy outputs,
    and its stop token: the head's drafts are right where the map holds the target's token, and the
    others can never be drafted."""
    tokens = sorted({t for out in trained_reference for t in out})
    ids = set(tokens[::2]) | {2}  # eos_token_id
    path = tmp_path_factory.mktemp("map") / "map.json"
    path.write_text(json.dumps(sorted(ids)))
    return str(path), ids


@pytest.mark.parametrize("k, on_device", [(1, False), (3, True)])
def test_a_reduced_draft_vocabulary_keeps_the_tokens(trained_reference, trained_map, k, on_device):
    """With a speculative token map the head drafts from the map alone (on the general path and the device's
    greedy step), some drafts are accepted, some targets lie outside it, and the tokens are those without
    drafts: verification reads the target's full logits."""
    path, ids = trained_map
    speculative = json.dumps({"method": "mtp", "num_speculative_tokens": k, "speculative_token_map": path})
    llm = engine(TRAINED, speculative, max_num_seqs=3 if on_device else 2)
    assert llm.runner.model.mtp.draft_head.out_features == len(ids)
    runs = fixed_shapes(llm, k) if on_device else []
    drafted = []
    got = generate(llm, trained_params(), lambda llm: drafted.extend(
        t for r in llm.scheduler.running for t in r.draft_token_ids))
    assert [out.token_ids for out in got] == trained_reference
    assert drafted and set(drafted) <= ids
    outside = [t for out in got for t in out.token_ids if t not in ids]
    assert outside and 0 < llm.stats().num_accepted_tokens < llm.stats().num_draft_tokens
    assert not on_device or ("accept", 2) in runs


def test_a_reduced_draft_vocabulary_with_sampling(demo, reference, tmp_path):
    """Sampled drafts come from the map too (q is zero outside it), a seed still reproduces the output, and
    a greedy request beside it keeps its tokens."""
    ids = set(range(0, 512, 3)) | {t for out in reference for t in out[::2]}
    path = tmp_path / "map.json"
    path.write_text(json.dumps(sorted(ids)))
    speculative = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "speculative_token_map": str(path)})
    runs, drafted = [], []
    for _ in range(2):
        llm = engine(demo, speculative)
        runs.append(generate(llm, [sampled(7), greedy()], lambda llm: drafted.extend(
            t for r in llm.scheduler.running for t in r.draft_token_ids)))
    assert runs[0][0].token_ids == runs[1][0].token_ids and len(runs[0][0].token_ids) == MAX_TOKENS
    assert all(run[1].token_ids == reference[1] for run in runs)
    assert drafted and set(drafted) <= ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_reduced_draft_vocabulary_on_a_gpu(trained_map):
    """On a GPU (fp32, the greedy steps replayed from CUDA graphs, the map's head captured in them): the tokens
    of no drafts, drafts from the map alone, some accepted."""
    path, ids = trained_map

    def cuda(speculative_config=None):
        return LLMEngine(EngineConfig(model=TRAINED, dtype="float32", device="cuda", max_num_seqs=2,
                                      kv_cache_memory_bytes=32 << 20, speculative_config=speculative_config))

    params = [greedy(TRAINED_TOKENS, repetition_penalty=1.0)] * 2  # unpenalized: the chained greedy graphs
    expected = [out.token_ids for out in generate(cuda(), params)]
    llm = cuda(json.dumps({"method": "mtp", "num_speculative_tokens": 1, "speculative_token_map": path}))
    drafted = []
    got = generate(llm, params, lambda llm: drafted.extend(t for r in llm.scheduler.running for t in r.draft_token_ids))
    assert [out.token_ids for out in got] == expected
    assert drafted and set(drafted) - {-1} <= ids and llm.stats().num_accepted_tokens > 0


def test_stops_inside_an_accepted_run(demo, reference):
    """max_tokens and a stop token id falling inside a run of accepted drafts end the request there."""
    stop_id = reference[1][4]
    expected_stop = reference[1][: reference[1].index(stop_id) + 1]
    llm = engine(demo, spec(3))
    oracle = Oracle({"0": reference[0], "1": reference[1]}, 3, wrong=2)
    got = generate(llm, [greedy(max_tokens=5), greedy(stop_token_ids=[stop_id])], oracle)
    assert got[0].token_ids == reference[0][:5] and got[0].finish_reason == "length"
    assert got[1].token_ids == expected_stop and got[1].finish_reason == "stop"
    assert llm.stats().num_accepted_tokens > 0


def device_oracle(llm: LLMEngine, k: int, continuations: dict[str, list[int]], wrong: int | None) -> tuple:
    """Forced acceptance that overlap scheduling sees too: the fixed-shape greedy steps (`fixed_shapes` on
    CPU; on a GPU an engine built with `OracleSpeculation` for its graphs) draft the known continuation on
    the device (`OracleSpeculation`: a chained step verifies drafts the host has
    not read), the host `Oracle` drafts the steps that start on the host. Returns (the after_step hook,
    the steps `launch_chained` queued)."""
    from tierlm.model.speculative_step import OracleSpeculation

    verify = llm.runner.static_verify
    if verify is None or not isinstance(verify.greedy, OracleSpeculation):  # CPU: the eager fixed shapes
        fixed_shapes(llm, k)
        llm.runner.static_verify.greedy = OracleSpeculation(llm.model, llm.cache, k)
    on_device = llm.runner.static_verify.greedy
    on_device.wrong = wrong
    on_host, told, chained = Oracle(continuations, k, wrong=0), set(), []
    launch = llm.runner.launch_chained
    llm.runner.launch_chained = lambda previous: chained.append(launch(previous)) or chained[-1]

    def after_step(llm):
        on_host(llm)
        for request in set(llm.scheduler.running) - told:
            told.add(request)
            on_device.know(request.home_slot, request.prompt_token_ids + continuations[request.request_id])
    return after_step, chained


@pytest.mark.parametrize("k", [1, 3])
def test_overlapped_steps_give_the_same_tokens(demo, reference, k):
    """Overlap scheduling with drafts: a greedy step's successor is launched on the device's own outputs
    (accepted count, bonus token, new drafts) before the host reads it; accepted and rejected drafts, the
    same tokens as no drafts, with overlap and without (no chained step then)."""
    for overlap in (True, False):
        llm = engine(demo, spec(k), max_num_seqs=3, async_scheduling=overlap)
        after_step, chained = device_oracle(llm, k, {"0": reference[0], "1": reference[1]}, wrong=k - 1)
        assert [out.token_ids for out in generate(llm, [greedy(), greedy()], after_step)] == reference
        assert bool(chained) is overlap and 0 < llm.stats().num_accepted_tokens < llm.stats().num_draft_tokens
        assert sorted(llm.cache_manager.free_slots) == [0, 1, 2] and not llm.has_unfinished_requests()


@pytest.mark.parametrize("stops", ["string", "id, max_tokens"])
def test_overlapped_steps_stop_inside_accepted_drafts(demo, stops):
    """A stop string, a stop id or max_tokens reached inside the accepted drafts of a step read back while
    the next one is in flight: the tokens after it (and that next step's) are dropped; the outputs are
    those without drafts."""
    plain = engine(demo, enable_prefix_caching=False)
    long = [out.token_ids for out in generate(plain, [greedy(20), greedy(20)])]
    if stops == "string":
        params = [greedy(20), greedy(20, stop=[plain.tokenizer.decode(long[1][5:7])])]
    else:
        params = [greedy(9), greedy(20, stop_token_ids=[long[1][14]])]
    expected = generate(engine(demo), params)
    llm = engine(demo, spec(3), max_num_seqs=3)
    after_step, chained = device_oracle(llm, 3, {"0": long[0], "1": long[1]}, wrong=None)
    behind, collect = [], llm._collect  # the requests that finish while a chained step is in flight

    def collected(request_id, collect=collect):
        output = collect(request_id)
        if output.finished and any(llm._in_flight is step for step in chained):
            behind.append(output.outputs[0].finish_reason)
        return output

    llm._collect = collected
    got = generate(llm, params, after_step)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in expected]
    assert sorted(behind) == ["length", "stop"]


def test_overlapped_steps_keep_decode_checkpoints(demo, reference):
    """A reply decoded by chained steps leaves decode-time prefix-cache checkpoints (the state at a block
    boundary saved before the step after it was queued, kept once its row was accepted): the conversation
    resent hits past its prompt, and decodes as without drafts."""
    plain = engine(demo)
    prompt, reply = plain.tokenizer.encode(PROMPTS[0]), reference[0]
    resent = prompt + reply
    assert len(prompt) < plain.cache.block_size < len(resent)  # a block boundary inside the reply
    expected = run_to_end(plain, resent)["again"].outputs[0].token_ids
    llm = engine(demo, spec(1), max_num_seqs=3)
    after_step, chained = device_oracle(llm, 1, {"0": reply, "again": expected}, wrong=0)
    assert generate(llm, [greedy()], after_step)[0].token_ids == reply and chained
    again = run_to_end(llm, resent, after_step)["again"]
    assert again.outputs[0].token_ids == expected and again.num_cached_tokens > len(prompt)


def run_to_end(llm: LLMEngine, prompt: list[int], after_step=lambda llm: None) -> dict:
    """Request "again" (4 greedy tokens of `prompt`) run to the end: {request id: final output}."""
    llm.add_request(prompt, greedy(4), request_id="again")
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
        after_step(llm)
    return done


def test_abort_while_a_step_is_in_flight(demo, reference):
    """A request aborted between a chained step's launch and its read-back: its tokens are dropped, its slot
    and blocks go back, and the other request and one admitted into the freed slot decode as without drafts."""
    llm = engine(demo, spec(1), max_num_seqs=3)
    after_step, chained = device_oracle(llm, 1, {"0": reference[0], "1": reference[1], "2": reference[0]},
                                        wrong=0)
    free_blocks = llm.cache_manager.num_free_blocks
    for prompt, request_id in zip(PROMPTS, "01", strict=True):
        llm.add_request(prompt, greedy(), request_id=request_id)
    done = {}
    while not any(llm._in_flight is step for step in chained):
        done.update({o.request_id: o for o in llm.step() if o.finished})
        after_step(llm)
    llm.abort_request("0")
    llm.add_request(PROMPTS[0], greedy(), request_id="2")
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
        after_step(llm)
    assert sorted(done) == ["1", "2"]
    assert [done[i].outputs[0].token_ids for i in "12"] == [reference[1], reference[0]]
    assert sorted(llm.cache_manager.free_slots) == [0, 1, 2] and llm.cache_manager.num_free_blocks == free_blocks


def test_penalized_logits_count_the_drafts_before_each_row():
    """Verify row j's logits (`penalized_logits`) are what the sampler edits for the request once its output
    has grown by drafts 1..j (`reference_edit_logits` of a request holding that output), for repetition,
    frequency and presence penalties: what greedy verification takes the argmax of, and sampled
    verification its target probabilities from."""
    from tierlm.engine.request import Request
    from tierlm.engine.sampler_reference import reference_edit_logits
    from tierlm.engine.sampling_plan import plan_rows
    from tierlm.engine.speculative_constraints import penalized_logits, verify_rows

    vocab, drafts = 12, [[3, 3, 7], [5]]
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0, repetition_penalty=1.0)]
    params = [p.with_defaults(None, None, None) for p in params]  # as the engine completes them
    requests = [Request(str(i), [1, 2, 9], p, frozenset(), 100) for i, p in enumerate(params)]
    for request, output in zip(requests, ([3, 4], [5]), strict=True):
        request.output_token_ids.extend(output)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    rows, before = verify_rows(requests, drafts)
    got = penalized_logits(logits, rows, before)
    expected = []
    for request, tokens in zip(requests, drafts, strict=True):
        for j in range(1 + len(tokens)):
            grown = Request(request.request_id, request.prompt_token_ids, request.params, frozenset(), 100)
            grown.output_token_ids.extend(request.output_token_ids + tokens[:j])
            row = logits[len(expected) : len(expected) + 1]
            expected.append(reference_edit_logits(row, plan_rows([grown], vocab, np.zeros(1, np.uint64)))[0])
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=0)
    unaware = penalized_logits(logits, rows, [[] for _ in rows])  # the output alone, as before drafts counted
    assert all(not torch.equal(got[j], unaware[j]) for j in (1, 2, 3))


def test_other_requests_decode_without_drafts(demo, reference):
    """A request with a logit processor (here logprobs) decodes one token per step beside a speculating one."""
    llm = engine(demo, spec(2))
    got = generate(llm, [greedy(logprobs=1), greedy()])
    assert [out.token_ids for out in got] == reference
    assert len(got[0].logprobs) == MAX_TOKENS


def count_draftless_steps(llm: LLMEngine) -> list[bool]:
    """Record, for each step the speculative runner executes serially, whether it is a decode step that
    carries no drafts (what the plain decode runner takes)."""
    steps, execute = [], llm.runner.execute

    def recorded(plan):
        steps.append(all(c.num_tokens == 1 and not c.draft_token_ids and c.samples for c in plan.chunks))
        return execute(plan)

    llm.runner.execute = recorded
    return steps


@pytest.mark.parametrize("k", [1, 2])
def test_steps_without_drafts_replay_the_decode_runner(demo, reference, monkeypatch, k):
    """Under --speculative-config a decode step that carries no drafts goes through the engine's plain decode
    runner (TIERLM_STATIC_DECODE_EAGER: the fixed shapes CUDA graphs replay, run eagerly on CPU), its rows'
    streams going to the draft head: requests with logprobs (they do not speculate), and greedy requests'
    last tokens (no room for drafts). Tokens and log-probabilities are the bits of the same runner without
    MTP; greedy tokens those of eager decoding."""
    monkeypatch.setenv("TIERLM_STATIC_DECODE_EAGER", "1")
    logprobs = [greedy(logprobs=2), greedy(logprobs=2)]
    expected = generate(engine(demo), logprobs)
    assert [out.token_ids for out in expected] == reference
    for params in (logprobs, [greedy(), greedy()]):
        llm = engine(demo, spec(k))
        plain = llm.runner.runner.static_decode
        assert plain.takes_decode_lists and plain.step == llm.model.forward_with_streams
        draftless = count_draftless_steps(llm)
        got = generate(llm, params)
        assert [out.token_ids for out in got] == reference
        assert sum(draftless) >= (MAX_TOKENS - 1 if params is logprobs else 1)
        assert llm.runner.runner.static_steps == sum(draftless)  # every one of them, and nothing else
        for out, want in zip(got, expected if params is logprobs else (), strict=False):
            assert len(out.logprobs) == MAX_TOKENS
            assert [list(p.items()) for p in out.logprobs] == [list(p.items()) for p in want.logprobs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_steps_without_drafts_replay_graphs_on_a_gpu(demo):
    """On a GPU (fp32) the speculative engine's steps without drafts are CUDA graph replays of the plain
    decode runner (captured in the verify graphs' pool): logprobs requests and greedy requests' last tokens
    give the tokens and log-probabilities of the engine without MTP."""
    def cuda(speculative_config=None):
        return LLMEngine(EngineConfig(model=str(demo), dtype="float32", device="cuda", max_num_seqs=2,
                                      kv_cache_memory_bytes=32 << 20, speculative_config=speculative_config))

    for params in ([greedy(logprobs=2), greedy(logprobs=2)], [greedy(), greedy()]):
        expected = generate(cuda(), params)
        llm = cuda(spec(1))
        plain = llm.runner.runner.static_decode
        assert plain.graphs and plain.graph_pool == llm.runner.static_verify.graph_pool
        draftless = count_draftless_steps(llm)
        got = generate(llm, params)
        assert [out.token_ids for out in got] == [out.token_ids for out in expected]
        for out, want, asked in zip(got, expected, params, strict=True):
            assert len(out.logprobs or []) == (len(out.token_ids) if asked.logprobs else 0)  # (not both empty)
            assert [list(p.items()) for p in out.logprobs or []] == [list(p.items()) for p in want.logprobs or []]
        assert sum(draftless) >= 1 and llm.runner.runner.static_steps == sum(draftless)


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle", "num_speculative_tokens": 1}', "method must be one of"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "mtp", "num_speculative_tokens": 1, "draft_model": "x"}', "unsupported field"),
    ("mtp", "not JSON"),
])
def test_bad_configs_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_refused_without_a_draft_head(tmp_path):
    plain = build_demo_model(tmp_path / "plain", "tiny")
    with pytest.raises(ValueError, match="has no MTP draft head"):
        engine(plain, spec(1))


def sampled(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=MAX_TOKENS, seed=seed)


def test_seeded_sampling_is_reproducible_with_drafts(demo, reference):
    """A seeded request draws its drafts and its verification from its own generator: the same seed gives
    the same tokens, beside a greedy request that still gives exactly the greedy tokens."""
    runs = [generate(engine(demo, spec(2)), [sampled(seed), greedy()]) for seed in (7, 7, 8)]
    assert runs[0][0].token_ids == runs[1][0].token_ids
    assert runs[0][0].token_ids != runs[2][0].token_ids
    assert all(run[1].token_ids == reference[1] for run in runs)
    assert all(len(run[0].token_ids) == MAX_TOKENS for run in runs)


def test_sampling_probs_is_what_the_sampler_draws_from():
    """The target distribution speculative decoding verifies against (`sampling_probs`) is the one the
    sampler draws from without drafts: chi-square of 20000 sampler draws over a small vocabulary."""
    from tierlm.engine.request import Request
    from tierlm.engine.sampler import Sampler
    from tierlm.engine.sampling_pass import sampling_probs

    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -1.0, -3.0, 0.9])
    for params in (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
                   SamplingParams(temperature=1.3, top_k=-1, top_p=0.8, min_p=0.0)):
        request = Request("r", [1], params, frozenset(), 100)
        expected = sampling_probs(logits[None], [request])[0]
        draws = 20000
        tokens = [s.token_id for s in Sampler(seed=3).sample(logits.repeat(draws, 1), [request] * draws, str)]
        counts = torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).double()
        support = expected > 0
        assert counts[~support].sum() == 0  # nothing outside the cut
        chi2 = ((counts[support] - draws * expected[support]) ** 2 / (draws * expected[support])).sum().item()
        assert chi2 < 30, (chi2, counts, expected)  # df <= 7: p < 1e-4


def test_sampling_probs_of_several_requests_are_each_one_s():
    """Verification takes every sampled request's rows in one `sampling_probs` pass: each row's distribution
    is the one its request gives alone (top-k, top-p over the vocabulary, min-p, greedy, side by side)."""
    from tierlm.engine.request import Request
    from tierlm.engine.sampling_pass import sampling_probs

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 3
    requests = [Request(f"r{i}", [1], params.with_defaults(None, None, None), frozenset(), 100) for i, params in
                enumerate([SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.2, top_p=0.9),
                           SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0.6, top_k=5,
                                                                                      top_p=0.5),
                           SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=300)])]
    together = sampling_probs(logits, requests)
    alone = torch.cat([sampling_probs(logits[i : i + 1], [r]) for i, r in enumerate(requests)])
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-9)
    assert (together[0] > 0).sum() == 20 and (together[4] > 0).sum() == 1


def test_prefix_cache_hits_and_preemption_keep_the_tokens(demo):
    """A prompt resent hits its checkpoint (the draft layer's rings are part of it, its K/V of the blocks);
    under a budget that forces preemption, recomputed requests speculate again: the greedy tokens stay."""
    roomy = engine(demo, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    plan = engine(demo, spec(2), max_model_len=256, max_num_seqs=4, max_state_checkpoints=2).cache_plan
    blocks = 256 // plan.block_size + 6  # room for one request of max_model_len and a little
    budget = (blocks + 1) * plan.block_bytes + plan.device_slots * plan.slot_bytes
    tight = engine(demo, spec(2), max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=budget,
                   max_state_checkpoints=2)
    tokenizer = roomy.tokenizer
    prompts = [tokenizer.encode(f"# file {i}\n" + "x = 1\n" * (5 + 3 * i)) for i in range(4)]
    prompts.append(prompts[3])  # a hit on request 3's prompt checkpoint
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(llm, after_step=None):
        ids = [llm.add_request(p, params) for p in prompts]
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o for o in llm.step() if o.finished})
            if after_step is not None:
                after_step(llm)
        return [done[i] for i in ids]

    expected = run(roomy)
    # drafts from the greedy continuation, some wrong: long accepted runs cross blocks and checkpoints
    oracle = Oracle({str(i): o.outputs[0].token_ids for i, o in enumerate(expected)}, 2, wrong=1)
    got = run(tight, oracle)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert tight.cache_plan.num_blocks == blocks and tight.scheduler.num_preemptions > 0
    stats = tight.stats()
    assert stats.prefix_cache_hits > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("k", [1, 3])
def test_offloaded_kv_gives_the_same_tokens(demo, reference, k):
    """QSA K/V in host pools (--qsa-kv-offload; the target's layers and the draft head's) through a tiny row
    cache (61 rows: evictions every step): the tokens of no drafts, with the head's own drafts (rejected:
    rolled back on the general path) and with forced acceptance on the fixed-shape greedy steps under
    overlap (accepted runs, a wrong draft each step). Rows that rejected drafts wrote are read (and cached) in their verify step and
    rewritten in the next: after every step each cached row holds its pool row's bytes (a stale copy moves
    the random model's logits, rarely its argmax). A request with logprobs decodes without drafts beside
    them: its logprobs are the bits of device pools (the same batches), and those of no drafts within
    rounding (verify rows in its batches change the matmul shapes)."""
    offload = {"qsa_kv_offload": True, "qsa_row_cache_rows": 61, "max_num_seqs": 3}
    params = [greedy(), greedy(logprobs=2)]
    plain = generate(engine(demo, **offload), params)
    on_device = generate(engine(demo, spec(k), max_num_seqs=3), params)
    own = engine(demo, spec(k), **offload)
    assert all(c.offload is not None for c in own.cache.layers + own.cache.draft_layers if c.kv is not None)
    got = generate(own, params, cached_rows_are_pool_rows)
    assert [out.token_ids for out in got] == [out.token_ids for out in plain] == reference
    assert [list(p.items()) for p in got[1].logprobs] == [list(p.items()) for p in on_device[1].logprobs]
    for a, b in zip(got[1].logprobs, plain[1].logprobs, strict=True):
        assert list(a) == list(b)
        assert [p.logprob for p in a.values()] == pytest.approx([p.logprob for p in b.values()], abs=1e-5)
    assert own.stats().num_draft_tokens > 0
    forced = engine(demo, spec(k), **offload)
    oracle, chained = device_oracle(forced, k, {"0": reference[0], "1": reference[1]}, wrong=k - 1)
    got = generate(forced, [greedy(), greedy()], lambda llm: oracle(llm) or cached_rows_are_pool_rows(llm))
    assert [out.token_ids for out in got] == reference
    assert chained and 0 < forced.stats().num_accepted_tokens < forced.stats().num_draft_tokens
    draft_hits, _ = forced.cache.draft_layers[0].offload.cache.counters()  # the stats count the head's layer too
    assert 0 < draft_hits < forced.stats().qsa_row_cache_hits == sum(kv.cache.counters()[0]
                                                                     for kv in forced.cache.offloaded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("k", [1, 3])
def test_offloaded_kv_graph_steps_on_a_gpu(demo, k):
    """On a GPU (fp32) with the K/V offloaded (pinned host pools read over UVA; the row cache planned, read
    and invalidated inside each greedy step's CUDA graph): the head's own drafts and oracle drafts (made
    on the device, chained) give the tokens of no drafts, and every cached row is its pool row after each
    step."""
    from tierlm.model import static_decode
    from tierlm.model.speculative_step import OracleSpeculation

    def cuda(speculative_config=None):
        return LLMEngine(EngineConfig(model=str(demo), dtype="float32", device="cuda", max_num_seqs=2,
                                      kv_cache_memory_bytes=32 << 20, speculative_config=speculative_config,
                                      qsa_kv_offload=True, qsa_row_cache_rows=61))

    expected = [out.token_ids for out in generate(cuda(), [greedy(), greedy()])]
    for oracle in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            if oracle:  # the greedy graphs draft the known continuation (what chained steps verify)
                patch.setattr(static_decode, "GreedySpeculation", OracleSpeculation)
            llm = cuda(spec(k))
        verify = llm.runner.static_verify
        assert verify.mode == "cuda_graph" and verify.greedy_graphs and llm.cache.offloaded
        after, chained = cached_rows_are_pool_rows, []
        if oracle:
            hook, chained = device_oracle(llm, k, {"0": expected[0], "1": expected[1]}, wrong=k - 1)
            after = lambda llm, hook=hook: hook(llm) or cached_rows_are_pool_rows(llm)
        assert [out.token_ids for out in generate(llm, [greedy(), greedy()], after)] == expected
        assert not oracle or (chained and llm.stats().num_accepted_tokens > 0)
        assert llm.stats().qsa_row_cache_hits > 0


def cached_rows_are_pool_rows(llm: LLMEngine) -> None:
    """Every row an offloaded layer's row cache holds (target and draft head) is its pool row's K and V
    (on CUDA the tags' read waits for the steps in flight)."""
    for layer in llm.cache.offloaded:
        cache = layer.cache
        slots = (cache.tags >= 0).nonzero().flatten()
        rows = cache.tags[slots].cpu()
        assert torch.equal(cache.keys[slots].cpu(), layer.host_k[rows])
        assert torch.equal(cache.values[slots].cpu(), layer.host_v[rows])


def test_generate_cli_takes_the_flag(demo, capsys):
    from tierlm.cli import main as cli_main

    args = ["generate", str(demo), "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
            "--dtype", "float32", "--device", "cpu"]
    assert cli_main(args + ["--speculative-config", spec(2)]) == 0
    assert f"tokens={MAX_TOKENS}" in capsys.readouterr().err
    assert cli_main(args + ["--speculative-config", '{"method": "mtp"}']) == 2
    assert "num_speculative_tokens must be an integer >= 1" in capsys.readouterr().err


def test_the_plan_counts_the_draft_layers_and_per_position_slots(demo):
    """The draft head's caches and the per-position state slots (K per running request) come out of the
    cache budget: each cache kind's own sizes add up to the plan's."""
    llm = engine(demo, spec(2), max_state_checkpoints=3)
    plain = engine(demo, max_state_checkpoints=3)
    plan, cache = llm.cache_plan, llm.cache
    assert plan.num_draft_layers == len(cache.draft_layers) == 1 and plan.spare_slots == 2 * 2
    layers = cache.layers + cache.draft_layers
    assert plan.block_bytes == sum(c.indexer.block_bytes + c.kv.block_bytes for c in layers if c.kv)
    assert plan.slot_bytes == cache.slot_bytes > plain.cache_plan.slot_bytes
    assert cache.num_slots == plan.num_slots + plan.spare_slots
    assert plan.device_slots == plain.cache_plan.device_slots + 4
    assert cache.checkpoints.nbytes == plan.host_checkpoint_bytes()
    assert plan.used_bytes() <= plan.budget_bytes and plan.num_blocks < plain.cache_plan.num_blocks
    assert any("4 speculative per-position states" in line for line in plan.lines())


def test_llm_and_serve_take_the_config(demo, reference):
    """`LLM(speculative_config=...)` takes vLLM's dict; `tierlm serve --speculative-config` reaches EngineConfig."""
    from tierlm.cli import build_parser
    from tierlm.entrypoints.llm import LLM
    from tierlm.server.cli import engine_config

    llm = LLM(str(demo), dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20, max_num_seqs=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.generate(PROMPTS[0], greedy())[0].outputs[0].token_ids == reference[0]
    argv = ["serve", "m", "--speculative-config", spec(3)]
    assert engine_config("m", build_parser(argv).parse_args(argv)).speculative_config == spec(3)


def test_drafts_stop_at_max_model_len(demo):
    """Near max_model_len a request verifies only the drafts that can still fit, and ends there."""
    expected = [o.token_ids for o in generate(engine(demo, max_model_len=32), [greedy(100), greedy(100)])]
    llm = engine(demo, spec(3), max_model_len=32)
    oracle = Oracle({"0": expected[0], "1": expected[1]}, 3, wrong=2)
    got = generate(llm, [greedy(100), greedy(100)], oracle)
    assert [o.token_ids for o in got] == expected
    assert all(o.finish_reason == "length" for o in got) and llm.stats().num_accepted_tokens > 0


def test_acceptance_is_logged(demo, reference, monkeypatch, caplog):
    from tierlm.engine import speculative

    monkeypatch.setattr(speculative, "LOG_INTERVAL_S", 0.0)
    llm = engine(demo, spec(3))
    with caplog.at_level("INFO", logger="tierlm"):
        generate(llm, [greedy(), greedy()], Oracle({"0": reference[0], "1": reference[1]}, 3, wrong=1))
    lines = [r.getMessage() for r in caplog.records if "drafts accepted" in r.getMessage()]
    assert lines and all("tokens per verify step" in line for line in lines)
    stats = llm.stats()
    assert stats.num_accepted_tokens == sum(int(line.split()[2]) for line in lines)


def test_the_planned_weights_include_the_draft_head(demo, capsys):
    """`tierlm plan --speculative-config` counts the draft head's weights (the checkpoint's, from its
    headers): exactly the mtp.* tensors' bytes more than the plan without drafts; in bf16, exactly the
    bytes of the head the loader places (`model.mtp`, cast to the model dtype)."""
    import re

    from safetensors import safe_open

    from tierlm.cli import main as cli_main
    from tierlm.model.loader import load_model

    def planned_weights(*flags: str) -> int:
        assert cli_main(["plan", str(demo), "--kv-cache-memory-bytes", str(32 << 20), *flags]) == 0
        return int(re.search(r"\(([\d,]+) B of weights", capsys.readouterr().out).group(1).replace(",", ""))

    item = {"F32": 4, "BF16": 2, "I64": 8}
    head = 0
    for file in demo.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in (n for n in f.keys() if n.startswith("mtp.")):  # noqa: SIM118 - safe_open is not iterable
                view = f.get_slice(name)
                head += math.prod(view.get_shape()) * item[view.get_dtype()]
    assert head > 0
    assert planned_weights("--speculative-config", spec(2)) - planned_weights() == head
    loaded = load_model(demo, "bfloat16", "cpu", load_mtp=True)[0].mtp
    placed = sum(t.numel() * t.element_size() for t in [*loaded.parameters(), *loaded.buffers()])
    bf16 = ("--dtype", "bfloat16")
    assert planned_weights(*bf16, "--speculative-config", spec(2)) - planned_weights(*bf16) == placed


# ---- structured output with drafts ----------------------------------------------------------------------

GRAMMAR_SCHEMAS = [
    {"type": "object", "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}}},
    {"type": "object", "required": ["point", "label"], "properties": {
        "point": {"type": "object", "required": ["x", "y"],
                  "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}}},
        "label": {"enum": ["a", "b", None]}}},
    {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 10, "maxItems": 12},
    {"type": "object", "required": ["unit", "sizes"], "properties": {
        "unit": {"enum": ["cm", "inch"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 12,
                  "maxItems": 14}}},
]


def json_params(schema: dict, temperature: float = 0, seed: int | None = None, **fields) -> SamplingParams:
    from tierlm.sampling_params import StructuredOutputRequest

    return SamplingParams(temperature=temperature, seed=seed, max_tokens=160,
                          structured_output=StructuredOutputRequest(json_schema=json.dumps(schema)), **fields)


def assert_valid(outputs, schemas) -> None:
    import jsonschema

    for output, schema in zip(outputs, schemas, strict=True):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)


def penalized_json() -> list[SamplingParams]:
    """Greedy under the first two schemas, the second with a presence penalty (its verify rows penalized and
    masked after the drafts before them)."""
    return [json_params(GRAMMAR_SCHEMAS[0]), json_params(GRAMMAR_SCHEMAS[1], presence_penalty=1.5)]


@pytest.fixture(scope="module")
def json_reference(demo):
    """`penalized_json`'s tokens for both prompts, without speculation."""
    return generate(engine(demo), penalized_json())


@pytest.mark.parametrize("k", [1, 3])
def test_grammar_requests_speculate_exactly(demo, json_reference, k):
    """Greedy json_schema requests speculate: drafts proposed under the grammar (the random head's, masked:
    where the grammar leaves one token they are right), every verify row penalized and masked after the
    drafts before it; the tokens are those without drafts."""
    llm = engine(demo, spec(k))
    got = generate(llm, penalized_json())
    assert [o.token_ids for o in got] == [o.token_ids for o in json_reference]
    assert_valid(got, GRAMMAR_SCHEMAS[:2])
    assert 0 < llm.stats().num_accepted_tokens < llm.stats().num_draft_tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_grammar_requests_speculate_on_a_gpu(demo):
    """On a GPU (fp32; the verify and draft forwards replayed from CUDA graphs, the greedy graph step left out
    for grammar requests) the masks go up from pinned memory: the tokens of no drafts, valid JSON."""
    def cuda(speculative_config=None):
        return LLMEngine(EngineConfig(model=str(demo), dtype="float32", device="cuda", max_num_seqs=2,
                                      kv_cache_memory_bytes=32 << 20, speculative_config=speculative_config))

    expected = generate(cuda(), penalized_json())
    for k in (1, 3):
        llm = cuda(spec(k))
        assert llm.runner.static_verify is not None
        got = generate(llm, penalized_json())
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert_valid(got, GRAMMAR_SCHEMAS[:2])
        assert llm.stats().num_accepted_tokens > 0


def test_concurrent_grammar_requests_with_drafts_stay_valid(demo):
    """Twelve json_schema requests, four running at a time (greedy and seeded sampled, different schemas), with
    drafts, for 100+ steps: no error, every output parses and validates against its own schema."""
    schemas = GRAMMAR_SCHEMAS * 3
    params = [json_params(s, *((0.9, 10 + i) if (i + i // 4) % 2 else (0, None))) for i, s in enumerate(schemas)]
    llm = engine(demo, spec(1), max_num_seqs=4)
    ids = [llm.add_request(PROMPTS[i % 2], p) for i, p in enumerate(params)]
    done, steps, running = {}, 0, 0
    while llm.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in llm.step() if o.finished})
        steps += 1
        running = max(running, len(llm.scheduler.running))
    assert_valid([done[i] for i in ids], schemas)
    assert steps >= 100 and running == 4 and llm.stats().num_accepted_tokens > 0


def test_drafts_the_grammar_forbids_are_never_accepted(demo):
    """Forced acceptance: the model favours a token the grammar mostly forbids ("x"), and the oracle's drafts
    are the greedy continuation with "x" in second place every other step: unmasked, the verify rows would
    accept it. Every verify row's mask is the grammar's after exactly the drafts before it, so "x" is
    accepted only where the grammar allows it; the tokens are those without drafts, and valid."""
    def favouring(llm: LLMEngine, token: int) -> LLMEngine:
        head = llm.model.lm_head

        def forward(hidden, forward=head.forward):
            logits = forward(hidden)
            logits[..., token] += 100.0
            return logits

        head.forward = forward
        return llm

    schemas = GRAMMAR_SCHEMAS[:2]
    x = engine(demo).tokenizer.encode("x")[0]
    expected = generate(favouring(engine(demo), x), [json_params(s) for s in schemas])
    oracle = Oracle({"0": expected[0].token_ids, "1": expected[1].token_ids}, 3, wrong=1)

    def drafts_with_x(llm: LLMEngine) -> None:
        oracle(llm)
        for request in llm.scheduler.running:
            if oracle.steps % 2 and len(request.draft_token_ids) > 1:
                request.draft_token_ids[1] = x

    llm = favouring(engine(demo, spec(3)), x)
    got = generate(llm, [json_params(s) for s in schemas], drafts_with_x)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert_valid(got, schemas)
    assert 0 < llm.stats().num_accepted_tokens < llm.stats().num_draft_tokens
