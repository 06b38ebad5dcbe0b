"""Overlap scheduling (async_scheduling) changes when the host reads a step back, never what is sampled:
the same tokens, log-probabilities, texts and finish reasons as serial steps, for a mix of requests that
stop on a stop id, a stop string, EOS and max_tokens, arrive mid-run, sample with a seed, take penalties
(their last output id read on the device from the step in flight), hit the prefix cache, or get
preempted; through the eager forward and through the static decode runner's host-list path."""

from __future__ import annotations

import math

import pytest
import torch

from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.model.static_decode import StaticDecodeRunner
from tierlm.sampling_params import SamplingParams

OPTIONS = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 32}
LONG = "def parse(tokens):\n    return [t for t in tokens if t]\n" * 2  # > one block: a prefix-cache hit later


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small batches: one torch thread (two spin against each other on a busy two-core host: 10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


def make_engine(demo_dir, overlap: bool, static: bool, eos: frozenset[int] = frozenset(), **options) -> LLMEngine:
    """static: decode steps through the StaticDecodeRunner's host-list path (CUDA: the engine's own CUDA
    graphs; CPU: the same runner run eagerly)."""
    options = {**OPTIONS, **options}
    if options["device"] == "cuda" and not static:
        options["enforce_eager"] = True
    engine = LLMEngine(EngineConfig(str(demo_dir), **options, async_scheduling=overlap))
    assert engine.overlap is overlap
    if static and options["device"] == "cpu" and engine.runner.static_decode is None:
        engine.runner.static_decode = StaticDecodeRunner(
            engine.model, engine.cache, engine.config.max_num_seqs,
            math.ceil(engine.max_model_len / engine.cache.block_size), "eager")
    engine.eos_token_ids = engine.eos_token_ids | eos
    return engine


def run_script(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> dict[str, object]:
    """Add each (id, prompt, params) at its step; run until all finish; {id: final RequestOutput}."""
    finals, step = {}, 0
    while any(at >= step for at in arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, ()):
            engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        step += 1
    return finals


def outcome(output) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
             None if c.logprobs is None else [sorted((t, e.logprob, e.rank) for t, e in p.items()) for p in c.logprobs])
            for c in output.outputs]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 16, "ignore_eos": True, **kwargs})


def script(stop_id: int | None = None, stop_text: str | None = None) -> dict[int, list[tuple]]:
    """The requests and the steps they arrive at (without a stop id or text: those two run to max_tokens)."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=14, ignore_eos=True,
                            logprobs=1)
    return {
        0: [("length", LONG, greedy(logprobs=2)),
            ("stop-id", "import os\nimport sys\n", greedy(max_tokens=40, stop_token_ids=[stop_id] if stop_id else None)),
            ("stop-string", "class Parser:\n", greedy(max_tokens=40, stop=[stop_text] if stop_text else None))],
        2: [("eos", "x = ", SamplingParams(temperature=0, max_tokens=40, logprobs=1))],
        3: [("penalties", "for i in range(", greedy(max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5))],
        4: [("seeded-penalties", "import re\n", SamplingParams(
            temperature=0.9, top_k=30, seed=5, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3,
            max_tokens=12, ignore_eos=True))],
        5: [("seeded", "def main():\n", seeded)],
        7: [("prefix-hit", LONG + "# more\n", greedy(max_tokens=10, logprobs=3))],
        9: [("n2", "while True:\n", SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))],
    }


@pytest.fixture(scope="module")
def stops(demo_dir):
    """A stop id, a stop string and an EOS id that the greedy outputs really meet (from a serial run)."""
    engine = make_engine(demo_dir, overlap=False, static=False)
    base = run_script(engine, {0: [("a", "import os\nimport sys\n", greedy(max_tokens=40)),
                                   ("b", "class Parser:\n", greedy(max_tokens=40)),
                                   ("c", "x = ", greedy(max_tokens=40))]})
    stop_id = base["a"].outputs[0].token_ids[6]
    text = base["b"].outputs[0].text
    stop_text = text[len(text) // 3 : len(text) // 3 + 3]
    eos = base["c"].outputs[0].token_ids[4]
    return stop_id, stop_text, eos


def run_both(demo_dir, static: bool, arrivals: dict, eos: frozenset[int] = frozenset(), **options
             ) -> tuple[dict, dict]:
    runs = {}
    for overlap in (False, True):
        engine = make_engine(demo_dir, overlap, static, eos=eos, **options)
        runs[overlap] = run_script(engine, arrivals)
        assert engine.cache_manager.hit_tokens > 0  # "prefix-hit" started after cached blocks
        assert not engine.has_unfinished_requests()
    assert sorted(runs[False]) == sorted(runs[True])
    return runs[False], runs[True]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_overlap_is_bit_identical_when_requests_end_on_max_tokens(demo_dir, static):
    """A request's last token is known to be its last at launch: it leaves the batch then, so every step
    batches the same rows as the serial run and nothing may differ, log-probabilities included."""
    serial, overlapped = run_both(demo_dir, static, script())
    assert {out.outputs[0].finish_reason for out in serial.values()} == {"length"}
    for request_id in serial:
        assert outcome(overlapped[request_id]) == outcome(serial[request_id]), request_id


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_overlap_gives_the_serial_tokens_around_stops(demo_dir, stops, static):
    """A request that stops on a stop id, a stop string or EOS has one more row computed by the step
    launched behind it (discarded); that step, and the admission of a waiting request, then batch other
    rows than the serial run's, and fp32 CPU matmuls round the last bits by batch (as in test_pipeline.py):
    tokens, texts and finish reasons are identical, log-probabilities within 1e-5."""
    stop_id, stop_text, eos = stops
    serial, overlapped = run_both(demo_dir, static, script(stop_id, stop_text), eos=frozenset({eos}))
    reasons = {rid: out.outputs[0].finish_reason for rid, out in serial.items()}
    assert reasons["stop-id"] == reasons["stop-string"] == reasons["eos"] == "stop"  # the stops were met
    assert reasons["length"] == reasons["seeded"] == "length"
    assert serial["stop-id"].outputs[0].stop_reason == stop_id
    for request_id in serial:
        got, expected = outcome(overlapped[request_id]), outcome(serial[request_id])
        assert [c[:4] for c in got] == [c[:4] for c in expected], request_id
        for c_got, c_expected in zip(got, expected):
            if c_expected[5] is None:
                continue
            assert [[(t, r) for t, _, r in p] for p in c_got[5]] == [[(t, r) for t, _, r in p] for p in c_expected[5]]
            values = [(a[1], b[1]) for p, q in zip(c_got[5], c_expected[5]) for a, b in zip(p, q)]
            assert max(abs(a - b) for a, b in values) <= 1e-5, request_id


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("static", [False, True], ids=["eager", "cuda_graph"])
def test_overlap_on_the_gpu_is_bit_identical_when_requests_end_on_max_tokens(demo_dir, static):
    """On CUDA the next step really is queued behind the one running: the same outputs, bit for bit."""
    serial, overlapped = run_both(demo_dir, static, script(), device="cuda")
    for request_id in serial:
        assert outcome(overlapped[request_id]) == outcome(serial[request_id]), request_id


@pytest.mark.parametrize("device", ["cpu", pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_argmax_in_the_decode_graph_gives_the_sampler_outputs(demo_dir, monkeypatch, device, overlap):
    """Decode steps of plain greedy rows take the argmax the engine's decode graph computed after its forward
    (one replay and one copy; CPU: TIERLM_STATIC_DECODE_EAGER, the same runner run eagerly): the outputs
    are those of the sampler's pass after the replay (TIERLM_NO_GRAPH_ARGMAX=1), greedy requests alone and
    then beside an unseeded sampled one (its draws unchanged: the skipped passes drew their keys too) and
    one with log-probabilities (the sampler's pass)."""
    arrivals = {0: [("a", "import os\n", greedy(max_tokens=12)), ("b", "class Parser:\n", greedy(max_tokens=9))],
                14: [("sampled", "x = ", SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)),
                     ("logprobs", "def main():\n", greedy(max_tokens=6, logprobs=2)),
                     ("c", "while True:\n", greedy(max_tokens=8))]}
    monkeypatch.setenv("TIERLM_STATIC_DECODE_EAGER", "1")
    runs, taken = {}, {}
    for in_graph in (True, False):
        if not in_graph:
            monkeypatch.setenv("TIERLM_NO_GRAPH_ARGMAX", "1")
        engine = make_engine(demo_dir, overlap, static=True, device=device, enable_prefix_caching=False)
        assert (engine.runner.static_decode.argmax_readback is not None) is in_graph
        taken[in_graph] = []
        launch = engine.runner._launch_taken_argmax
        engine.runner._launch_taken_argmax = lambda step, launch=launch, calls=taken[in_graph]: (
            calls.append(len(step.chunks)) or launch(step))
        runs[in_graph] = run_script(engine, arrivals)
    assert 2 in taken[True] and not taken[False]
    assert sorted(runs[True]) == sorted(runs[False]) == ["a", "b", "c", "logprobs", "sampled"]
    for request_id in runs[False]:
        assert outcome(runs[True][request_id]) == outcome(runs[False][request_id]), request_id


def test_overlap_under_preemption_gives_the_serial_outputs(demo_dir):
    """Few blocks: requests are preempted (one of them while its step is in flight) and recomputed."""
    prompts = [f"# file {i}\n" + "x = 1\n" * (4 + 3 * i) for i in range(4)]
    arrivals = {0: [(f"r{i}", p, greedy(max_tokens=30, logprobs=1)) for i, p in enumerate(prompts)]}
    runs, preemptions = {}, {}
    for overlap in (False, True):
        engine = make_engine(demo_dir, overlap, static=True, enable_prefix_caching=False)
        engine.cache_manager.free_blocks = type(engine.cache_manager.free_blocks)(range(9))  # 9 blocks of 16
        runs[overlap] = run_script(engine, arrivals)
        preemptions[overlap] = engine.scheduler.num_preemptions
    assert preemptions[False] > 0 and preemptions[True] > 0
    for request_id in runs[False]:
        assert outcome(runs[True][request_id]) == outcome(runs[False][request_id]), request_id


def test_steps_with_host_side_sampling_state_stay_serial(demo_dir):
    """A request with bad_words needs its last id on the host: its steps are read back at once. One with
    penalties reads it on the device: its steps stay in flight, and its tokens are the serial run's
    (test_overlap_is_bit_identical_when_requests_end_on_max_tokens)."""
    engine = make_engine(demo_dir, overlap=True, static=False)
    engine.add_request("for i in range(", greedy(max_tokens=5, bad_words=["zzz qq"]), request_id="b")
    while engine.has_unfinished_requests():
        engine.step()
        assert engine._in_flight is None
    for params in (greedy(max_tokens=5), greedy(max_tokens=5, frequency_penalty=0.5, repetition_penalty=1.2)):
        engine.add_request("for i in range(", params)
        in_flight = 0
        while engine.has_unfinished_requests():
            engine.step()
            in_flight += engine._in_flight is not None
        assert in_flight >= 4


def test_switches(demo_dir, monkeypatch):
    assert make_engine(demo_dir, overlap=True, static=False).overlap
    monkeypatch.setenv("TIERLM_NO_ASYNC_SCHEDULING", "1")
    engine = LLMEngine(EngineConfig(str(demo_dir), **OPTIONS))
    assert not engine.overlap


def test_decode_checkpoints_saved_in_flight_are_hit_with_the_right_state(demo_dir):
    """A decode-time checkpoint is copied right after the step reaching its boundary, before that block's
    last id is known, and keyed when it is: a prompt that continues the output hits it, with the same
    cached tokens and the same continuation as serial."""
    results = {}
    for overlap in (False, True):
        engine = make_engine(demo_dir, overlap, static=True)
        first = run_script(engine, {0: [("first", LONG, greedy(max_tokens=24))]})["first"]
        prompt = engine.tokenizer.encode(LONG) + first.outputs[0].token_ids + [5, 6]
        before = engine.cache_manager.hit_tokens
        second = run_script(engine, {0: [("second", prompt, greedy(max_tokens=8, logprobs=1))]})["second"]
        results[overlap] = (engine.cache_manager.hit_tokens - before, outcome(first), outcome(second))
        manager = engine.cache_manager
        rows = manager.cache.checkpoints.count if manager.cache.checkpoints else 0
        assert len(manager.free_checkpoints) + len(manager.checkpoints) == min(rows, engine.cache_plan.num_checkpoints)
    hits = results[False][0]
    assert hits > len(engine.tokenizer.encode(LONG))  # past the prompt: a decode checkpoint
    assert results[True] == results[False]
