"""Scheduling: who sends what when, for the warmup runs and the measured runs.

A run is a list of conversations, each a list of user messages (one per `--turns`). A conversation
sends its turns one after another and resends the whole history each time, the assistant's previous
answers included, as a coding agent does (with --image / --image-size the first user message carries
an image before its text: tools/bench/images.py, drawn before the run starts); if a turn fails, the turns it would have led to cannot be
built and are recorded as failed too, so `completed + failed` is always conversations x turns.

Conversations start either closed loop (`--concurrency N`: N workers, each starting its next
conversation when the previous one finished) or open loop (`--request-rate R`: conversation starts
are a Poisson process of rate R per second, seeded by `--seed` and the run index, never waiting for
answers).

Output tokens come from the server's `usage` when it reports them, else from the tokenizer, else
one per chunk of output text; input tokens likewise from `usage`, else the tokenizer, else the
4-characters-per-token estimate.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx
from rich.progress import Progress

from tierlm.tools.bench.client import (
    GenerationSettings,
    ServerTarget,
    StreamedReply,
    StreamingClient,
    render_transcript,
    scrape_tierlm_metrics,
)
from tierlm.tools.bench.images import first_user_message
from tierlm.tools.bench.stats import RequestRecord, RunMeasurement
from tierlm.tools.bench.workload import PromptPlan, TokenCounter


@dataclass(frozen=True)
class Schedule:
    """Closed loop (`concurrency`) or open loop (`request_rate`); exactly one is set."""

    concurrency: int | None
    request_rate: float | None
    seed: int


@dataclass
class BenchmarkOutcome:
    measured: list[RunMeasurement]
    notes: list[str]
    server_metrics_before: dict[str, float] | None
    server_metrics_after: dict[str, float] | None


def measure_reply(
    reply: StreamedReply,
    run_started: float,
    run: int,
    conversation: int,
    turn: int,
    messages: list[dict],
    counter: TokenCounter,
) -> RequestRecord:
    """The record of one reply, with its token counts taken from the best source at hand."""
    if reply.usage_prompt_tokens is not None:
        input_tokens = reply.usage_prompt_tokens
    else:
        input_tokens = counter.count(render_transcript(messages))
    if reply.error:
        output_tokens = 0
    elif reply.usage_completion_tokens is not None:
        output_tokens = reply.usage_completion_tokens
    elif counter.exact:
        output_tokens = counter.count(reply.all_output_text)
    else:
        output_tokens = len(reply.token_times)
    return RequestRecord(
        run=run,
        conversation=conversation,
        turn=turn,
        ttft_s=reply.token_times[0] - reply.sent_at if reply.token_times else 0.0,
        e2el_s=reply.finished_at - reply.sent_at,
        token_times_s=[t - run_started for t in reply.token_times],
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        error=reply.error,
    )


class Runner:
    """Sends the conversations of a run, closed or open loop, through one `StreamingClient`."""

    def __init__(
        self, client: StreamingClient, counter: TokenCounter, schedule: Schedule, progress: Progress | None,
        images=None,
    ):
        self.images = images  # an ImageFile or GeneratedImages (tools/bench/images.py), or None
        self.client = client
        self.counter = counter
        self.schedule = schedule
        self.progress = progress

    async def run(self, index: int, conversations: list[list[str]], label: str) -> RunMeasurement:
        """Run `conversations`; `index` names the run in its records and seeds its arrivals."""
        records: list[RequestRecord] = []
        total = sum(len(turns) for turns in conversations)
        image_urls = [self.images.url(turns[0]) if self.images else None for turns in conversations]
        task = self.progress.add_task(label, total=total) if self.progress else None
        started = time.perf_counter()

        def keep(record: RequestRecord) -> None:
            records.append(record)
            if task is not None:
                self.progress.advance(task)

        async def converse(number: int, user_turns: list[str]) -> None:
            history: list[dict] = []
            for turn, user_text in enumerate(user_turns):
                messages = history + [first_user_message(user_text, image_urls[number] if turn == 0 else None)]
                reply = await self.client.complete(messages)
                record = measure_reply(reply, started, index, number, turn, messages, self.counter)
                keep(record)
                if not record.ok:
                    for later in range(turn + 1, len(user_turns)):
                        keep(_skipped(index, number, later, turn))
                    return
                history = messages + [{"role": "assistant", "content": reply.text}]

        if self.schedule.request_rate is None:
            pending = iter(enumerate(conversations))

            async def worker() -> None:
                for number, user_turns in pending:
                    await converse(number, user_turns)

            workers = min(self.schedule.concurrency, len(conversations))
            await asyncio.gather(*(worker() for _ in range(workers)))
        else:
            arrivals = random.Random(f"{self.schedule.seed}:arrivals:{index}")
            due = 0.0  # the first conversation starts at once, the next after exponential gaps
            tasks = []
            for number, user_turns in enumerate(conversations):
                delay = started + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(converse(number, user_turns)))
                due += arrivals.expovariate(self.schedule.request_rate)
            await asyncio.gather(*tasks)

        duration = time.perf_counter() - started
        if task is not None:
            self.progress.remove_task(task)
        records.sort(key=lambda r: (r.conversation, r.turn))
        return RunMeasurement(index=index, records=records, duration_s=duration)


def _skipped(run: int, conversation: int, turn: int, failed_turn: int) -> RequestRecord:
    return RequestRecord(
        run=run,
        conversation=conversation,
        turn=turn,
        ttft_s=0.0,
        e2el_s=0.0,
        error=f"not sent: turn {failed_turn} of this conversation failed",
    )


async def run_benchmark(
    target: ServerTarget,
    settings: GenerationSettings,
    plan: PromptPlan,
    counter: TokenCounter,
    schedule: Schedule,
    warmup_runs: int,
    measured_runs: int,
    timeout_s: float,
    progress: Progress | None,
    images=None,
) -> BenchmarkOutcome:
    """Warmup runs (discarded), a `/metrics` snapshot, the measured runs, another snapshot."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: no proxy from the environment sits between the benchmark and the server.
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as http:
        runner = Runner(StreamingClient(http, target, settings), counter, schedule, progress, images)
        # Warmup runs are numbered -1, -2, ... and measured runs 0, 1, ...; the plan counts them all.
        for warmup in range(warmup_runs):
            await runner.run(-1 - warmup, plan.for_run(warmup), f"warmup {warmup + 1}/{warmup_runs}")
        before = await scrape_tierlm_metrics(http, target)
        measured = []
        for number in range(measured_runs):
            prompts = plan.for_run(warmup_runs + number)
            measured.append(await runner.run(number, prompts, f"run {number + 1}/{measured_runs}"))
        after = await scrape_tierlm_metrics(http, target)
    return BenchmarkOutcome(measured, runner.client.notes, before, after)
