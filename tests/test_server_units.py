"""The server's parts without a model: the engine thread (on a scripted fake engine) and the CLI flags."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time

import pytest

from tierlm.cli import build_parser
from tierlm.engine import llm_engine
from tierlm.engine.llm_engine import EngineStats
from tierlm.outputs import CompletionOutput, RequestOutput
from tierlm.sampling_params import SamplingParams
from tierlm.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EnginePrompt,
    EngineRequestError,
    output_size,
)
from tierlm.server.cli import engine_config

POISON_STEP, POISON_ADD, POISON_FINISH = 666, 667, 668  # prompt tokens that make the fake engine misbehave


class FakeEngine:
    """One token per step per request; finishes at max_tokens. Poison prompts fail the step, the add or the
    request (finish_reason "error")."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.steps = self.stats_calls = 0
        self.last_step_num_tokens = 0
        self.paused: set[str] = set()

    def add_request(self, prompt, params, request_id, prompt_text=None, images=None):
        if prompt == [POISON_ADD]:
            raise ValueError("prompt 667 is not allowed")
        self.requests[request_id] = (prompt, params, [])
        return request_id

    def step(self):
        self.steps += 1
        time.sleep(0.002)
        if any(prompt == [POISON_STEP] for prompt, _, _ in self.requests.values()):
            raise RuntimeError("kernel exploded")
        outputs = []
        runnable = [r for r in self.requests.items() if r[0] not in self.paused]
        self.last_step_num_tokens = len(runnable)
        for request_id, (prompt, params, tokens) in runnable:
            tokens.append(len(tokens))
            finished = len(tokens) >= params.max_tokens or prompt == [POISON_FINISH]
            reason = ("error" if prompt == [POISON_FINISH] else "length") if finished else None
            # a delta, as the server asks for: the new token and its text
            completion = CompletionOutput(0, "t", [tokens[-1]], None, None, reason, "bad")
            outputs.append(RequestOutput(request_id, None, prompt, None, [completion], finished))
            if finished:
                del self.requests[request_id]
        return outputs

    def pause_request(self, request_id, paused):
        (self.paused.add if paused else self.paused.discard)(request_id)

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        self.stats_calls += 1
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0)


def run(scenario, **engine_options):
    """Run `scenario(engine, fake)` on a fresh AsyncEngine over a fresh fake, in a fresh event loop."""

    async def main():
        fake = FakeEngine()
        engine = AsyncEngine(fake, "fake", **engine_options)
        engine.start()
        try:
            return await scenario(engine, fake)
        finally:
            engine.stop()

    return asyncio.run(main())


async def generate(engine, request_id, prompts, max_tokens=5):
    params = SamplingParams(max_tokens=max_tokens)
    stream = await engine.submit(request_id, [EnginePrompt(p) for p in prompts], params)
    return [(index, output) async for index, output in stream]


async def until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def test_outputs_of_every_prompt_arrive_in_order():
    async def scenario(engine, fake):
        items = await generate(engine, "a", [[1], [2]], max_tokens=3)
        for index in (0, 1):
            mine = [o for i, o in items if i == index]
            assert [o.outputs[0].token_ids for o in mine] == [[0], [1], [2]] and mine[-1].finished
        assert engine.is_alive and not fake.requests
        assert b'tierlm:time_to_first_token_seconds_count{model_name="fake"} 2.0' in engine.metrics.render()

    run(scenario)


def test_a_refused_request_raises_at_submit_and_the_thread_serves_on():
    async def scenario(engine, fake):
        with pytest.raises(ValueError, match="667"):
            await engine.submit("bad", [EnginePrompt([1]), EnginePrompt([POISON_ADD])], SamplingParams())
        assert not fake.requests  # the job's first prompt was taken back
        assert (await generate(engine, "good", [[1]]))[-1][1].finished

    run(scenario)


def test_a_failing_step_fails_the_jobs_in_flight_and_marks_the_engine_dead():
    async def scenario(engine, fake):
        healthy = asyncio.ensure_future(generate(engine, "healthy", [[1]], max_tokens=10**6))
        await until(lambda: "healthy" in fake.requests)
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await generate(engine, "poison", [[POISON_STEP]])
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await healthy  # the batch it shared is suspect: it fails too
        assert not engine.is_alive and "kernel exploded" in engine.dead_reason
        with pytest.raises(EngineDeadError, match="serves no more"):  # refused, not queued
            await generate(engine, "after", [[1]])
        assert "after" not in fake.requests

    run(scenario)


def test_a_request_finished_with_error_fails_only_its_job():
    async def scenario(engine, fake):
        healthy = asyncio.ensure_future(generate(engine, "healthy", [[1]], max_tokens=20))
        with pytest.raises(EngineRequestError, match="bad"):
            await generate(engine, "broken", [[POISON_FINISH]])
        assert (await healthy)[-1][1].outputs[0].finish_reason == "length"
        assert b'finished_reason="error"' not in engine.metrics.render()

    run(scenario)


def test_leaving_a_stream_early_aborts_its_requests():
    async def scenario(engine, fake):
        prompts = [EnginePrompt([1]), EnginePrompt([2])]
        stream = await engine.submit("left", prompts, SamplingParams(max_tokens=10**6))
        async for _ in stream:
            break
        await until(lambda: sorted(fake.aborted) == ["left-0", "left-1"])
        await until(lambda: engine.stats.num_running == 0)

    run(scenario)


def test_a_dropped_stream_aborts_its_request():
    async def scenario(engine, fake):
        stream = await engine.submit("dropped", [EnginePrompt([1])], SamplingParams(max_tokens=10**6))
        del stream
        gc.collect()
        await until(lambda: fake.aborted == ["dropped"])

    run(scenario)


def test_a_cancelled_consumer_aborts_its_request():
    async def scenario(engine, fake):
        task = asyncio.ensure_future(generate(engine, "cancelled", [[1]], max_tokens=10**6))
        await until(lambda: "cancelled" in fake.requests)
        task.cancel()
        await until(lambda: fake.aborted == ["cancelled"])

    run(scenario)


def test_a_stream_nobody_reads_is_paused_at_its_bound_and_resumed_as_it_is_read():
    bound = 10 * output_size(RequestOutput("x", None, [1], None, [CompletionOutput(0, "t", [0], None, None)]))

    async def scenario(engine, fake):
        other = asyncio.ensure_future(generate(engine, "other", [[1]], max_tokens=300))
        stream = await engine.submit("stalled", [EnginePrompt([1])], SamplingParams(max_tokens=10**6))
        await until(lambda: "stalled" in fake.paused)
        assert (await other)[-1][1].finished  # the rest of the batch goes on
        generated = len(fake.requests["stalled"][2])
        await asyncio.sleep(0.1)
        assert len(fake.requests["stalled"][2]) == generated  # paused: no compute, no new output
        assert bound < stream._job.pending_bytes <= bound + bound // 10 + 1000
        assert b"tierlm:num_streams_throttled{model_name=\"fake\"} 1.0" in engine.metrics.render()
        received = 0
        async for _ in stream:  # reading lets it run again
            received += 1
            if received == 3 * generated:
                break
        assert received == 3 * generated  # it ran on as it was read
        stream.close()
        await until(lambda: fake.aborted == ["stalled"])

    run(scenario, max_stream_buffer_bytes=bound)


def test_a_stream_paused_past_the_stall_timeout_is_ended():
    async def scenario(engine, fake):
        stream = await engine.submit("stalled", [EnginePrompt([1])], SamplingParams(max_tokens=10**6))
        await until(lambda: fake.aborted == ["stalled"])
        assert b"tierlm:streams_ended_stalled_total{model_name=\"fake\"} 1.0" in engine.metrics.render()
        with pytest.raises(EngineRequestError, match="read nothing for 0.2 s"):
            async for _ in stream:
                pass

    run(scenario, max_stream_buffer_bytes=1, stream_stall_timeout_s=0.2)


# ---- tierlm serve flags -------------------------------------------------------------------------------


def parse(*argv):
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_engine_flags_reach_engine_config():
    args = parse("m", "--max-model-len", "64", "--max-num-seqs", "2", "--no-enable-prefix-caching",
                 "--kv-cache-memory-bytes", "1000000", "--enforce-eager", "--dtype", "float32", "--seed", "3")
    config = engine_config("m", args)
    expected = {"model": "m", "max_model_len": 64, "max_num_seqs": 2, "enforce_eager": True,
                "dtype": "float32", "seed": 3, "enable_prefix_caching": False, "kv_cache_memory_bytes": 1000000}
    expected = {k: v for k, v in expected.items() if k in {f.name for f in dataclasses.fields(config)}}
    assert {k: getattr(config, k) for k in expected} == expected
    defaults = engine_config("m", parse())
    assert defaults == llm_engine.EngineConfig(model="m")


def test_flags_an_older_engine_config_lacks_are_reported_and_dropped(monkeypatch, capsys):
    @dataclasses.dataclass(frozen=True)
    class OlderConfig:
        model: str
        max_model_len: int | None = None

    monkeypatch.setattr(llm_engine, "EngineConfig", OlderConfig)
    config = engine_config("m", parse("--max-model-len", "64", "--gpu-memory-utilization", "0.5"))
    assert config == OlderConfig(model="m", max_model_len=64)
    assert "--gpu-memory-utilization is ignored" in capsys.readouterr().err


def test_metrics_report_the_row_cache_hit_rate():
    from tierlm.server.metrics import Metrics

    stats = EngineStats(0, 0, 0.0, 0, 0, 0, qsa_row_cache_hits=3, qsa_row_cache_misses=1)
    rendered = Metrics("m", lambda: stats).render()
    assert b'tierlm:qsa_row_cache_hit_rate{model_name="m"} 0.75' in rendered
    assert b'tierlm:qsa_row_cache_hits_total{model_name="m"} 3.0' in rendered
    empty = Metrics("m", lambda: EngineStats(0, 0, 0.0, 0, 0, 0)).render()
    assert b'tierlm:qsa_row_cache_hit_rate{model_name="m"} 0.0' in empty


def test_a_busy_engine_is_not_asked_for_stats_after_every_step():
    async def scenario(engine, fake):
        await generate(engine, "long", [[1]], max_tokens=200)  # 200 steps of 2 ms and more
        await until(lambda: engine.stats.num_running == 0)  # the idle engine's snapshot is fresh
        assert fake.steps == 200 and fake.stats_calls < 20

    run(scenario)


def test_integers_with_a_zero_fraction_are_integers_and_nothing_else_is():
    """JSON Schema's "integer" includes 3.0 (schemathesis sends such bodies); 3.5, "3" and true stay refused."""
    from pydantic import ValidationError

    from tierlm.server.protocol import ChatCompletionRequest, CompletionRequest

    request = CompletionRequest.model_validate(
        {"prompt": [[1.0, 2]], "n": 2.0, "seed": -3.0, "max_tokens": 4.0, "stop_token_ids": [7.0]})
    assert (request.prompt, request.n, request.seed, request.max_tokens, request.stop_token_ids) == (
        [[1, 2]], 2, -3, 4, [7])
    assert isinstance(request.n, int) and isinstance(request.prompt[0][0], int)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 8.0, "top_logprobs": 2.0})
    assert (chat.max_completion_tokens, chat.top_logprobs) == (8, 2)
    for body in ({"prompt": [1.5]}, {"prompt": "x", "n": "2"}, {"prompt": [True]}, {"prompt": "x", "n": 3.5},
                 {"prompt": "x", "seed": 2.0**64}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)
    # the bounds stay in the JSON schema as JSON Schema's keywords
    schema = CompletionRequest.model_json_schema()["properties"]
    assert (schema["n"]["minimum"], schema["n"]["maximum"]) == (1, 128)
    assert schema["prompt"]["oneOf"][2]["items"]["minimum"] == 0
