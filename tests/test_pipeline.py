"""Pipeline parallelism on CPU (gloo ranks as processes, demo model, fp32): the same tokens and
log-probabilities as one process, with chunked prefill, preemption, prefix caching, structured output
and QSA K/V offload; a rank that dies, or the last rank's own error, ends generation with an error naming
it, and a killed rank ends `tierlm serve` (exit 2, the error naming it); the layer split and
`tierlm plan --pipeline-parallel-size`.

Starting ranks costs seconds on a small machine, so one PP=3 engine serves several tests; the PP=2
engines that fail come after it (one pipeline per process).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from serve_process import serving

import tierlm
from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model
from tierlm.distributed.group import PipelineError
from tierlm.memory.partition import PartitionError, balanced_partition, check_partition
from tierlm.sampling_params import StructuredOutputRequest

# chunked prefill (prompts longer than a step's tokens), prefix caching on
OPTIONS = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 24,
           "max_state_checkpoints": 4}
PARTITION = (1, 1, 2)  # the QSA layer (3) on the last rank
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


@pytest.fixture(scope="module", autouse=True)
def static_decode_eager():
    """Decode steps through the static runners on every rank and in one process alike (eager on CPU): the
    pipeline's decode steps go to them as host lists, with their input ids from the device."""
    os.environ["TIERLM_STATIC_DECODE_EAGER"] = "1"
    yield
    del os.environ["TIERLM_STATIC_DECODE_EAGER"]


@pytest.fixture(scope="module")
def single(demo_dir):
    return LLM(str(demo_dir), **OPTIONS)


@pytest.fixture(scope="module")
def pp3(demo_dir, single):
    # a budget that holds one request of max_model_len and a few blocks more: concurrent requests preempt
    blocks = 256 // single.engine.cache_plan.block_size
    llm = LLM(str(demo_dir), **OPTIONS, pipeline_parallel_size=3, pp_layer_partition=",".join(map(str, PARTITION)),
              kv_cache_memory_bytes=_budget_for_blocks(demo_dir, blocks))
    assert llm.engine.overlap and llm.engine.runner.static_decode is not None
    yield llm
    llm.engine.close()


def _budget_for_blocks(demo_dir, blocks: int) -> int:
    """--kv-cache-memory-bytes that gives the rank holding the QSA layer (the last) `blocks` blocks."""
    from tierlm.config import ModelConfig
    from tierlm.engine.llm_engine import EngineConfig, engine_cache_plan
    from tierlm.memory.partition import layouts

    config = ModelConfig.from_pretrained(demo_dir)
    plans = [engine_cache_plan(EngineConfig(str(demo_dir), **OPTIONS), config, "float32", "cpu", 0, stage=layout)
             for layout in layouts(config, PARTITION)]
    budget = (blocks + 1) * plans[-1].block_bytes + plans[-1].device_slots * plans[-1].slot_bytes
    assert all(plan.device_slots * plan.slot_bytes <= budget for plan in plans)  # every rank's slots fit
    return budget


def _logprob_rows(completion):
    return [sorted((token, entry.logprob, entry.rank) for token, entry in position.items())
            for position in completion.logprobs]


def test_one_request_gives_bit_identical_tokens_and_logprobs(single, pp3):
    """One request at a time, so every step batches the same rows in both: nothing may differ."""
    prompt = "def parse(tokens):\n    " * 6  # 4 prefill chunks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    expected, got = single.generate(prompt, params)[0], pp3.generate(prompt, params)[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert _logprob_rows(got.outputs[0]) == _logprob_rows(expected.outputs[0])
    assert got.outputs[0].cumulative_logprob == expected.outputs[0].cumulative_logprob
    assert got.prompt_logprobs == expected.prompt_logprobs
    assert got.outputs[0].text == expected.outputs[0].text


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "micro-batches"])
def test_concurrent_requests_with_preemption_match_one_process(single, pp3, overlap):
    """With overlap scheduling the next step takes the last rank's ids on rank 0's device; without it,
    micro-batches in flight split the requests differently from one process's batches. Either way fp32
    sums may round differently in the last bits: tokens equal, log-probabilities within 1e-4."""
    tokenizer = single.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(f"# file {i}\n" + "x = 1\n" * (6 + 3 * i))} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    preempted = pp3.engine.scheduler.num_preemptions
    pp3.engine.overlap = overlap  # between steps: nothing in flight
    try:
        expected, got = single.generate(prompts, params), pp3.generate(prompts, params)
    finally:
        pp3.engine.overlap = True
    assert pp3.engine.scheduler.num_preemptions > preempted
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for row_a, row_b in zip(_logprob_rows(a.outputs[0]), _logprob_rows(b.outputs[0])):
            assert max(abs(x[1] - y[1]) for x, y in zip(row_a, row_b)) <= 1e-4


def test_prefix_cache_hit_restores_every_ranks_state(single, pp3):
    prompt = {"prompt_token_ids": single.get_tokenizer().encode("import collections\n" * 12)}
    expected = single.generate(prompt, GREEDY)[0]
    first, second = pp3.generate(prompt, GREEDY)[0], pp3.generate(prompt, GREEDY)[0]
    assert second.num_cached_tokens > 0  # the second skips its prompt's blocks: every rank restored its layers
    for got in (first, second):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert _logprob_rows(got.outputs[0]) == _logprob_rows(expected.outputs[0])


def test_structured_output_seeded_sampling_penalties_and_bad_words(single, pp3):
    """The last rank samples with every field rank 0 was given: a grammar, a seed, penalties, bad words."""
    schema = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}
    constrained = SamplingParams(temperature=0, max_tokens=80,
                                 structured_output=StructuredOutputRequest(json_schema=json.dumps(schema)))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)
    # greedy, it starts ' tra ("': the ban of the word's second token reads the first from its output ids
    penalized = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                               bad_words=['tra ("'])
    prompts = ["JSON please:", "def f(x):", "defaultsvert identr importcommandabc"]
    params = [constrained, seeded, penalized]
    expected = single.generate(prompts, params)
    got = pp3.generate(prompts, params)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert '("' not in got[2].outputs[0].text[:8]  # the bad word's ban held
    assert got[0].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(got[0].outputs[0].text)["x"], int)


def test_qsa_kv_offload_then_a_killed_rank_ends_generation_with_an_error_naming_it(demo_dir, single, pp3):
    pp3.engine.close()  # one pipeline per process
    llm = LLM(str(demo_dir), **OPTIONS, pipeline_parallel_size=2, qsa_kv_offload=True, qsa_row_cache_rows=61)
    engine = llm.engine
    try:
        assert engine.cache_plan.kv_offload
        prompt = "import os\n" * 9  # prefilled in 2 chunks
        a, b = llm.generate(prompt, GREEDY)[0], single.generate(prompt, GREEDY)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _logprob_rows(a.outputs[0]) == _logprob_rows(b.outputs[0])
        engine.add_request("def f(x):", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(engine.pipeline.processes[0].pid, signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(PipelineError, match="pipeline rank 1 killed by SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - began < 30
    finally:
        engine.close()
    assert [process.poll() is not None for process in engine.pipeline.processes] == [True]  # no rank left behind


# the last rank fails with an error of its own: rank 0 spawns its workers with this process's environment,
# so this sitecustomize on PYTHONPATH patches them as they start (tierlm has no failure hook of its own)
LAST_RANK_FAILS = """
from tierlm.engine.model_runner import ModelRunner

real, calls = ModelRunner.{method}, []


def failing(self, *args, **kwargs):
    calls.append(None)
    if len(calls) == {call}:
        raise RuntimeError("injected failure in ModelRunner.{method}")
    return real(self, *args, **kwargs)


ModelRunner.{method} = failing
"""
FAILURE_GUARD_S = 90  # the issue asks for 30 s; the guard leaves room for a loaded machine


@pytest.mark.parametrize("method", ["launch_sampling", "finish"], ids=["in-a-step", "reading-a-step-back"])
def test_an_error_on_the_last_rank_ends_generation_with_it_and_the_rank(demo_dir, tmp_path, monkeypatch, method):
    """The last rank's own error, raised in a step (its sampling launched) or while it reads a step back
    (the step before, once the next is launched), reaches rank 0 with its text and the rank named, and no
    rank is left behind. Runs after the tests of the PP=3 engine (one pipeline per process)."""
    # fails at its 4th call: mid-request, after its prefill and a few tokens
    (tmp_path / "sitecustomize.py").write_text(LAST_RANK_FAILS.format(method=method, call=4))
    # it imports tierlm before `python -m` puts the working folder on the path: this tierlm, not another install
    tierlm_root = str(Path(tierlm.__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), tierlm_root,
                                                                    os.environ.get("PYTHONPATH")])))
    engine = LLM(str(demo_dir), **OPTIONS, pipeline_parallel_size=2).engine
    try:
        engine.add_request("def f(x):", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        began, outputs = time.monotonic(), []
        with pytest.raises(PipelineError, match=rf"pipeline rank 1 .*RuntimeError: injected failure in "
                                                rf"ModelRunner\.{method}"):
            while engine.has_unfinished_requests():
                outputs += engine.step()
        assert time.monotonic() - began < FAILURE_GUARD_S
        assert outputs and not any(output.finished for output in outputs)  # it failed mid-request
    finally:
        engine.close()
    assert [process.poll() is not None for process in engine.pipeline.processes] == [True]


def _pipeline_workers(server_pid: int) -> list[int]:
    """The pids of a server's pipeline workers: its children that run pipeline_worker (/proc: Linux)."""
    workers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the state
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
        if parent == server_pid and b"tierlm.engine.pipeline_worker" in command:
            workers.append(int(stat.parent.name))
    return workers


def test_a_killed_last_rank_ends_the_server_with_an_error_naming_it(demo_dir, tmp_path):
    """`tierlm serve --pipeline-parallel-size 2`, its last rank killed while a request streams: the stream
    ends without finishing, and the server stops and exits with an error naming the rank (status 2)."""
    flags = [str(demo_dir), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
             "--pipeline-parallel-size", "2"]
    log_path = tmp_path / "server.log"
    with serving(flags, log_path) as server:
        [worker] = _pipeline_workers(server.pid)
        body = {"model": demo_dir.name, "prompt": "def f(x):", "max_tokens": 240, "temperature": 0,
                "ignore_eos": True, "stream": True}
        finish_reasons = []
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=FAILURE_GUARD_S) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: {"):
                        if not finish_reasons:  # its first token is out: the rank dies mid-request
                            os.kill(worker, signal.SIGKILL)
                            began = time.monotonic()
                        finish_reasons.append(json.loads(line[6:]).get("choices", [{}])[0].get("finish_reason"))
        except httpx.TransportError:  # the server went away before the stream's end
            pass
        status = server.popen.wait(timeout=FAILURE_GUARD_S)
        assert finish_reasons, "no token streamed before the server ended"
        assert time.monotonic() - began < FAILURE_GUARD_S
    assert "length" not in finish_reasons  # killed mid-request
    assert status == 2  # the CLI's error status, not a signal's
    assert "tierlm serve: error: pipeline rank 1 killed by SIGKILL" in log_path.read_text()


def test_balanced_partition_and_given_partitions():
    # equal layers: the ends' extra bytes push layers away from the first and last ranks
    assert balanced_partition([10] * 12, 0, 0, [1, 1, 1]) == (4, 4, 4)
    assert balanced_partition([10] * 12, 25, 15, [1, 1, 1]) == (3, 5, 4)
    # a rank with twice the memory takes twice the layers
    assert balanced_partition([10] * 9, 0, 0, [2, 1]) == (6, 3)
    check_partition((16, 17, 15), 48, 3)
    for counts, problem in [((16, 17), "2 entries"), ((16, 17, 14), "sums to 47"), ((48, 0, 0), "at least one")]:
        with pytest.raises(PartitionError, match=problem):
            check_partition(counts, 48, 3)


def test_plan_prints_one_line_per_rank(demo_dir, capsys):
    from tierlm.cli import main

    assert main(["plan", str(demo_dir), "--dtype", "float32", "--max-model-len", "256",
                 "--pipeline-parallel-size", "3", "--pp-layer-partition", "2,1,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ranks = [line for line in lines if line.startswith("rank ") and " on cpu: " in line]
    assert [line.split(":")[1].split(";")[0].strip() for line in ranks] == [
        "layers 0-1 (2) + embedding", "layers 2-2 (1)", "layers 3-3 (1) + lm_head"]
    assert main(["plan", str(demo_dir), "--pipeline-parallel-size", "2", "--pp-layer-partition", "3,2"]) == 2
    assert "sums to 5, but the model has 4 layers" in capsys.readouterr().err


def test_scheduler_leaves_batches_in_flight_alone(demo_dir):
    """Requests of a batch in flight are not scheduled again, nor preempted when blocks run out."""
    from tierlm.config import ModelConfig
    from tierlm.engine.cache_manager import CacheManager
    from tierlm.engine.request import Request
    from tierlm.engine.scheduler import Scheduler
    from tierlm.model.model_cache import ModelCache

    cache = ModelCache(ModelConfig.from_pretrained(demo_dir), num_slots=4, num_blocks=7, block_size=16,
                       dtype=__import__("torch").float32)
    scheduler = Scheduler(CacheManager(cache, 4), max_num_seqs=4, max_num_batched_tokens=256)
    requests = [Request(str(i), [1] * 30, SamplingParams(max_tokens=40), frozenset(), 256) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    first = scheduler.schedule(max_requests=2)
    assert [c.request for c in first.chunks] == requests[:2]
    second = scheduler.schedule(busy={c.request for c in first.chunks})
    assert [c.request for c in second.chunks] == [requests[2]]  # 6 of 7 blocks taken now
    for chunk in first.chunks + second.chunks:
        chunk.request.num_computed_tokens += chunk.num_tokens
        chunk.request.output_token_ids.append(5)
    requests[1].output_token_ids += [5] * 33  # 64 tokens: 2 more blocks, and 1 is free
    third = scheduler.schedule(busy={requests[0], requests[2]})
    # the newest running request (2) is in flight: the newest one not in flight is requests[1] itself
    assert third.chunks == [] and third.preempted == [requests[1]]
    assert requests[0] in scheduler.running and requests[2] in scheduler.running
