"""The engine behind an asyncio server: one thread owns the `LLMEngine`, the event loop only talks to it.

The engine is not thread-safe, so every call on it happens on the engine thread. Handlers `submit` a
job (the prompts of one HTTP request, one engine request each, sharing `SamplingParams`) through a
thread-safe inbox and get a `RequestStream`; aborts go through the same inbox. The thread applies what
is in the inbox, runs `step()` while any request is unfinished (it sleeps on the inbox when idle), and
hands each job's outputs to that job's asyncio queue with `loop.call_soon_threadsafe`.

Failure is per job: `add_request` raising fails the job with that exception (a ValueError is the
client's fault: HTTP 400); a sequence that finishes with reason "error" fails its job with
`EngineRequestError`; a `step()` that raises fails every job in flight (the batch they shared is
suspect) and the thread keeps serving. A stream that is closed, cancelled or dropped before its last
output aborts its job, which frees the engine's memory for it at once.

Per-request latency metrics (TTFT, inter-token, end-to-end) are measured here, on the engine thread,
when outputs leave `step()`; the latest `EngineStats` snapshot is kept for the metrics collector.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from tierlm.engine.llm_engine import EngineStats, LLMEngine
from tierlm.outputs import RequestOutput
from tierlm.sampling_params import SamplingParams
from tierlm.server.metrics import Metrics

logger = logging.getLogger("tierlm.server")

_ACCEPTED = object()  # delivered once all of a job's prompts are queued in the engine
_STOP = object()
STATS_INTERVAL_S = 0.25  # while the engine is busy, /metrics' engine gauges are at most this old


class EngineRequestError(RuntimeError):
    """The engine failed while serving this request (HTTP 500); the server keeps running."""


@dataclass(frozen=True)
class EnginePrompt:
    token_ids: list[int]
    text: str | None = None  # the prompt's text, reported back in RequestOutput.prompt


@dataclass(eq=False)
class _Job:
    """One HTTP request's engine requests, as both threads see them."""

    request_id: str
    prompts: Sequence[EnginePrompt]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue  # (prompt index, RequestOutput) | _ACCEPTED | BaseException, read on the loop
    arrival: float = field(default_factory=time.monotonic)
    done: bool = False  # set on the loop once every prompt finished or the job failed

    def engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}" if len(self.prompts) > 1 else self.request_id

    def deliver(self, item) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


@dataclass(eq=False)
class _Tracked:
    """The engine thread's book-keeping for one engine request."""

    job: _Job
    index: int
    num_output_tokens: int = 0
    last_token_time: float | None = None


class RequestStream:
    """The outputs of a submitted job: `async for index, output in stream`, cumulative snapshots per prompt.

    Leaving the loop early, `close()`, cancellation or garbage collection abort the unfinished requests.
    """

    def __init__(self, engine: AsyncEngine, job: _Job) -> None:
        self._job = job
        self._remaining = len(job.prompts)
        self._finalizer = weakref.finalize(self, engine._abort_if_running, job)

    def close(self) -> None:
        self._finalizer()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._remaining:
                item = await self._job.outbox.get()
                if isinstance(item, BaseException):
                    self._job.done = True
                    raise item
                index, output = item
                if output.finished:
                    self._remaining -= 1
                    self._job.done = not self._remaining
                yield index, output
        finally:
            self.close()


class AsyncEngine:
    """Owns the engine thread: `start()` it, `submit()` from the event loop, `stop()` at shutdown."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.stats: EngineStats = engine.stats()  # replaced (never mutated) by the engine thread
        self._stats_at = time.monotonic()
        self.metrics = Metrics(model_name, lambda: self.stats)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine request id -> its book-keeping (engine thread only)
        self._thread = threading.Thread(target=self._run, name="tierlm-engine", daemon=True)
        # OpenMP's thread count is per thread: carry the creator's setting over to the engine thread
        self._torch_threads = torch.get_num_threads()

    # ---- the event loop's side ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(
        self, request_id: str, prompts: Sequence[EnginePrompt], params: SamplingParams
    ) -> RequestStream:
        """Queue the prompts in the engine; raises what `add_request` raised (then nothing is queued)."""
        job = _Job(request_id, prompts, params, asyncio.get_running_loop(), asyncio.Queue())
        stream = RequestStream(self, job)
        self._inbox.put(("add", job))
        try:
            item = await job.outbox.get()
        except BaseException:
            stream.close()
            raise
        if isinstance(item, BaseException):
            job.done = True
            raise item
        return stream

    def _abort_if_running(self, job: _Job) -> None:
        if not job.done:
            job.done = True
            self._inbox.put(("abort", job))

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        while True:
            for command in self._take_commands(block=not self.engine.has_unfinished_requests()):
                if command is _STOP:
                    return
                kind, job = command
                if kind == "add":
                    self._add(job)
                else:
                    self._fail(job, None)
            if self.engine.has_unfinished_requests():
                self._step()
            # a snapshot reads device counters: not after every step of a busy engine, always once it is idle
            now = time.monotonic()
            if not self.engine.has_unfinished_requests() or now - self._stats_at >= STATS_INTERVAL_S:
                self.stats, self._stats_at = self.engine.stats(), now

    def _take_commands(self, block: bool) -> list:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, job: _Job) -> None:
        try:
            for index, prompt in enumerate(job.prompts):
                engine_id = job.engine_id(index)
                self.engine.add_request(prompt.token_ids, job.params, engine_id, prompt_text=prompt.text)
                self._tracked[engine_id] = _Tracked(job, index)
        except Exception as exc:  # noqa: BLE001 (the job fails, the thread carries on)
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", job.request_id)
                exc = EngineRequestError(f"the engine could not take the request: {exc}")
            self._fail(job, exc)
            return
        job.deliver(_ACCEPTED)

    def _fail(self, job: _Job, error: BaseException | None) -> None:
        """Abort the job's requests in the engine; deliver `error` unless None (the client is gone)."""
        for index in range(len(job.prompts)):
            engine_id = job.engine_id(index)
            if self._tracked.pop(engine_id, None) is not None:
                self.engine.abort_request(engine_id)
        if error is not None:
            job.deliver(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001
            logger.exception("engine step failed; failing the %d requests in flight", len(self._tracked))
            for job in {t.job: None for t in self._tracked.values()}:
                self._fail(job, EngineRequestError(f"the engine failed during a step: {exc}"))
            return
        now = time.monotonic()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
            if failed is not None:
                error = EngineRequestError(f"the engine failed this request: {failed.stop_reason}")
                self._fail(tracked.job, error)
                continue
            self._record(tracked, output, now)
            if output.finished:
                del self._tracked[output.request_id]
            tracked.job.deliver((tracked.index, output))

    def _record(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new_tokens = num_tokens - tracked.num_output_tokens
        if new_tokens > 0:
            if tracked.last_token_time is None:
                self.metrics.first_token(now - tracked.job.arrival, len(output.prompt_token_ids))
            else:
                self.metrics.next_token(now - tracked.last_token_time)
            self.metrics.generated(new_tokens)
            tracked.num_output_tokens = num_tokens
            tracked.last_token_time = now
        if output.finished:
            self.metrics.finished(now - tracked.job.arrival, [c.finish_reason for c in output.outputs])
