"""The engine behind an asyncio server: one thread owns the `LLMEngine`, the event loop only talks to it.

The engine is not thread-safe, so every call on it happens on the engine thread. Handlers `submit` a
job (the prompts of one HTTP request, one engine request each, sharing `SamplingParams`) through a
thread-safe inbox and get a `RequestStream`; aborts and resumes go through the same inbox. The thread
applies what is in the inbox, runs `step()` while any request can run (it sleeps on the inbox when
none can), and hands each job's outputs, deltas of what is new (`RequestOutputKind.DELTA`), to that
job's asyncio queue with `loop.call_soon_threadsafe`.

Failure is per job: `add_request` refusing fails the job with its message (a ValueError is the client's
fault: HTTP 400); a sequence that finishes with reason "error" (its logits, sampling or grammar) fails
its job alone with `EngineRequestError` (500). A `step()` that raises has broken the engine itself: every
job in flight fails, the engine is marked dead (`dead_reason`, /health answers 503) and every later
submit is refused with `EngineDeadError` (503) instead of serving from a half-broken state. Failures
cross the threads as `JobFailure` records (kind and message), never as exception objects, so no
traceback keeps a refused prompt alive.

Bounded delivery: a job's outbox holds the deltas its client has not read yet, counted in estimated
bytes. Past `max_stream_buffer_bytes` the job's requests are paused (they keep their memory but take no
compute) until the client has read down to half the bound; a job paused for `stream_stall_timeout_s`
is ended. So a client that stops reading costs O(bound) memory, not O(tokens^2).

A stream that is closed, cancelled or dropped before its last output aborts its job, which frees the
engine's memory for it at once. Per-request latency metrics (TTFT, inter-token, end-to-end) are
measured here, on the engine thread, when outputs leave `step()`; the latest `EngineStats` snapshot is
kept for the metrics collector.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from tierlm.engine.llm_engine import EngineStats, LLMEngine, PromptTooLongError
from tierlm.multimodal.image_processor import ProcessedImage
from tierlm.outputs import RequestOutput
from tierlm.sampling_params import RequestOutputKind, SamplingParams
from tierlm.server.metrics import Metrics

logger = logging.getLogger("tierlm.server")

_ACCEPTED = object()  # delivered once all of a job's prompts are queued in the engine
_STOP = object()
STATS_INTERVAL_S = 0.25  # while the engine is busy, /metrics' engine gauges are at most this old
DEFAULT_STREAM_BUFFER_BYTES = 4 << 20
DEFAULT_STALL_TIMEOUT_S = 60.0


class EngineRequestError(RuntimeError):
    """The engine failed while serving this request (HTTP 500); the server keeps running."""


class EngineDeadError(RuntimeError):
    """The engine itself failed; nothing more can be served (HTTP 503, /health 503)."""


@dataclass(frozen=True)
class JobFailure:
    """Why a job failed, as plain data: the loop side raises a fresh exception from it."""

    kind: str  # "invalid" (400), "prompt_too_long" (400), "request" (500), "engine" (503)
    message: str

    def exception(self) -> Exception:
        types = {"invalid": ValueError, "prompt_too_long": PromptTooLongError, "request": EngineRequestError,
                 "engine": EngineDeadError}
        return types[self.kind](self.message)


@dataclass(frozen=True)
class EnginePrompt:
    token_ids: list[int]
    text: str | None = None  # the prompt's text, reported back in RequestOutput.prompt
    images: list[ProcessedImage] = field(default_factory=list)  # in prompt order, their markers widened


def output_size(output: RequestOutput) -> int:
    """An estimate of the bytes a delta holds in Python objects (text, token ids, log-probabilities)."""
    size = 512
    for completion in output.outputs:
        size += 64 + len(completion.text) + 32 * len(completion.token_ids)
        for entries in completion.logprobs or ():
            size += 64 + 200 * len(entries)
    for entries in output.prompt_logprobs or ():
        size += 64 + 200 * len(entries or ())
    return size


@dataclass(eq=False)
class _Job:
    """One HTTP request's engine requests, as both threads see them."""

    request_id: str
    prompts: Sequence[EnginePrompt]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue  # (prompt index, RequestOutput, size) | _ACCEPTED | JobFailure, read on the loop
    arrival: float = field(default_factory=time.monotonic)
    done: bool = False  # set on the loop once every prompt finished or the job failed
    unfinished: int = 0  # engine thread: its engine requests not finished yet
    # bounded delivery: each counter has one writer (the engine thread delivers, the loop consumes)
    delivered_bytes: int = 0
    consumed_bytes: int = 0
    paused_at: float | None = None  # engine thread: when its requests were paused, None while running
    resume_asked: bool = False  # loop thread: a resume is in the inbox

    @property
    def pending_bytes(self) -> int:
        return self.delivered_bytes - self.consumed_bytes

    def engine_id(self, index: int) -> str:
        return f"{self.request_id}-{index}" if len(self.prompts) > 1 else self.request_id

    def deliver(self, item, size: int = 0) -> None:
        """Called on the engine thread."""
        self.delivered_bytes += size
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
    """The outputs of a submitted job: `async for index, output in stream`, deltas per prompt.

    Leaving the loop early, `close()`, cancellation or garbage collection abort the unfinished requests.
    """

    def __init__(self, engine: AsyncEngine, job: _Job) -> None:
        self._engine = engine
        self._job = job
        self._remaining = len(job.prompts)
        self._finalizer = weakref.finalize(self, engine._abort_if_running, job)

    def close(self) -> None:
        self._finalizer()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        job = self._job
        try:
            while self._remaining:
                item = await job.outbox.get()
                if isinstance(item, JobFailure):
                    job.done = True
                    raise item.exception()
                index, output, size = item
                job.consumed_bytes += size
                self._engine._resume_if_drained(job)
                if output.finished:
                    self._remaining -= 1
                    job.done = not self._remaining
                yield index, output
        finally:
            self.close()


class AsyncEngine:
    """Owns the engine thread: `start()` it, `submit()` from the event loop, `stop()` at shutdown."""

    def __init__(
        self, engine: LLMEngine, model_name: str, max_stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES,
        stream_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        if max_stream_buffer_bytes < 1:
            raise ValueError(f"--max-stream-buffer-bytes must be at least 1, got {max_stream_buffer_bytes}")
        if not stream_stall_timeout_s > 0:
            raise ValueError(f"--stream-stall-timeout must be positive, got {stream_stall_timeout_s}")
        self.engine = engine
        self.max_stream_buffer_bytes = max_stream_buffer_bytes
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.stats: EngineStats = engine.stats()  # replaced (never mutated) by the engine thread
        self._stats_at = time.monotonic()
        self.metrics = Metrics(model_name, lambda: self.stats)
        self.dead_reason: str | None = None  # set once a step has failed: the engine serves no more
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine request id -> its book-keeping (engine thread only)
        self._paused: set[_Job] = set()  # engine thread only
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
        return self._thread.is_alive() and self.dead_reason is None

    async def submit(
        self, request_id: str, prompts: Sequence[EnginePrompt], params: SamplingParams
    ) -> RequestStream:
        """Queue the prompts in the engine; raises what `add_request` refused (then nothing is queued)."""
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        job = _Job(request_id, prompts, params, asyncio.get_running_loop(), asyncio.Queue())
        stream = RequestStream(self, job)
        self._inbox.put(("add", job))
        try:
            item = await job.outbox.get()
        except BaseException:
            stream.close()
            raise
        if isinstance(item, JobFailure):
            job.done = True
            raise item.exception()
        return stream

    def _abort_if_running(self, job: _Job) -> None:
        if not job.done:
            job.done = True
            self._inbox.put(("abort", job))

    def _resume_if_drained(self, job: _Job) -> None:
        if job.paused_at is not None and not job.resume_asked and job.pending_bytes <= self._low_mark:
            job.resume_asked = True
            self._inbox.put(("resume", job))

    @property
    def _low_mark(self) -> int:
        return self.max_stream_buffer_bytes // 2

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        waiting = False  # the last step could run nothing: sleep on the inbox until something changes
        while True:
            busy = self.engine.has_unfinished_requests() and self.dead_reason is None
            for command in self._take_commands(block=not busy or waiting, timeout=self._stall_wait()):
                if command is _STOP:
                    return
                kind, job = command
                if kind == "add":
                    self._add(job)
                elif kind == "resume":
                    self._resume(job)
                else:
                    self._fail(job, None)
            self._end_stalled()
            if self.engine.has_unfinished_requests() and self.dead_reason is None:
                self._step()
                waiting = self.engine.last_step_num_tokens == 0
            # a snapshot reads device counters: not after every step of a busy engine, always once it is idle
            now = time.monotonic()
            if not self.engine.has_unfinished_requests() or now - self._stats_at >= STATS_INTERVAL_S:
                self.stats, self._stats_at = self.engine.stats(), now

    def _take_commands(self, block: bool, timeout: float | None) -> list:
        commands = []
        if block:
            try:
                commands.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _stall_wait(self) -> float | None:
        """How long the thread may sleep on the inbox before a paused job's stall timeout is due."""
        if not self._paused:
            return None
        due = min(job.paused_at for job in self._paused) + self.stream_stall_timeout_s
        return max(0.0, due - time.monotonic())

    def _add(self, job: _Job) -> None:
        if self.dead_reason is not None:
            job.deliver(JobFailure("engine", f"the engine has failed and serves no more: {self.dead_reason}"))
            return
        failure = None
        try:
            for index, prompt in enumerate(job.prompts):
                engine_id = job.engine_id(index)
                self.engine.add_request(prompt.token_ids, job.params, engine_id, prompt_text=prompt.text,
                                        images=prompt.images)
                self._tracked[engine_id] = _Tracked(job, index)
                job.unfinished += 1
        except PromptTooLongError as exc:
            failure = JobFailure("prompt_too_long", str(exc))
        except ValueError as exc:
            failure = JobFailure("invalid", str(exc))
        except Exception as exc:  # the job fails, the thread carries on
            logger.exception("adding request %s failed", job.request_id)
            failure = JobFailure("request", f"the engine could not take the request: {exc}")
        if failure is not None:
            self._fail(job, failure)
            return
        job.deliver(_ACCEPTED)

    def _fail(self, job: _Job, failure: JobFailure | None) -> None:
        """Abort the job's requests in the engine; deliver `failure` unless None (the client is gone)."""
        for index in range(len(job.prompts)):
            engine_id = job.engine_id(index)
            if self._tracked.pop(engine_id, None) is not None:
                self.engine.abort_request(engine_id)
        self._paused.discard(job)
        if failure is not None:
            job.deliver(failure)

    def _pause(self, job: _Job) -> None:
        job.paused_at, job.resume_asked = time.monotonic(), False
        self._paused.add(job)
        for index in range(len(job.prompts)):
            self.engine.pause_request(job.engine_id(index), True)
        self.metrics.throttled(len(self._paused))

    def _resume(self, job: _Job) -> None:
        job.resume_asked = False
        if job not in self._paused or job.pending_bytes > self._low_mark:
            return
        job.paused_at = None
        self._paused.discard(job)
        for index in range(len(job.prompts)):
            self.engine.pause_request(job.engine_id(index), False)
        self.metrics.throttled(len(self._paused))

    def _end_stalled(self) -> None:
        now = time.monotonic()
        for job in [j for j in self._paused if now - j.paused_at >= self.stream_stall_timeout_s]:
            logger.warning("request %s: its client read nothing for %.0f s; ending it",
                           job.request_id, self.stream_stall_timeout_s)
            self.metrics.stalled()
            message = (f"the client read nothing for {self.stream_stall_timeout_s:g} s with "
                       f"{job.pending_bytes} bytes of output waiting; the request was ended")
            self._fail(job, JobFailure("request", message))
        self.metrics.throttled(len(self._paused))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; the engine is dead, failing the %d requests in flight",
                             len(self._tracked))
            self.dead_reason = f"{type(exc).__name__}: {exc}"
            failure = JobFailure("engine", f"the engine failed during a step: {self.dead_reason}")
            for job in {t.job: None for t in self._tracked.values()}:
                self._fail(job, failure)
            return
        now = time.monotonic()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
            if failed is not None:
                self._fail(tracked.job, JobFailure("request", f"the engine failed this request: {failed.stop_reason}"))
                continue
            self._record(tracked, output, now)
            job = tracked.job
            if output.finished:
                del self._tracked[output.request_id]
                job.unfinished -= 1
            size = output_size(output)
            job.deliver((tracked.index, output, size), size)
            if not job.unfinished:
                self._paused.discard(job)
            elif job.pending_bytes > self.max_stream_buffer_bytes and job.paused_at is None:
                self._pause(job)

    def _record(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.token_ids) for c in output.outputs)  # the outputs are deltas
        if new_tokens > 0:
            if tracked.last_token_time is None:
                self.metrics.first_token(now - tracked.job.arrival, len(output.prompt_token_ids))
            else:
                self.metrics.next_token(now - tracked.last_token_time)
            self.metrics.generated(new_tokens)
            tracked.num_output_tokens += new_tokens
            tracked.last_token_time = now
        if output.finished:
            self.metrics.finished(now - tracked.job.arrival, [c.finish_reason for c in output.outputs])
