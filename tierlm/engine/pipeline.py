"""Pipeline parallelism: the model's layers split between processes, one scheduler in the first.

Rank 0 is the engine: tokenizer, scheduler, cache manager, text side, and the first stage (embedding
and the first layers). Every other rank runs `pipeline_worker.run_worker`: it holds its own layers
(the last rank also the final mixer and lm_head), its own `ModelCache`, cache plan, host pools and
static decode runner, and follows rank 0's step descriptions. Each step (`launch`, then `finish`):
1. rank 0 schedules a batch and sends every rank a `StepMessage`: the batch (a decode step that fits the
   static decode runners as host lists, `DecodeRows`, which every rank writes into its runner's buffers
   in one copy; else a `ForwardBatch` on the CPU); slot and block numbers are rank 0's cache manager's,
   the same on every rank; the cache operations rank 0's cache manager made since the last message
   (reset a slot, save or restore a prefix-cache checkpoint: each rank applies them to its own layers
   before the forward, so they land between the same two forwards everywhere), and for the last rank
   what to sample;
2. rank 0 runs its layers and sends the multi-stream residual [N, hc * hidden], packed on its device with
   the batch's input ids, to rank 1, which runs its layers (its input ids from that buffer) and sends it
   on; each rank posts its receive as soon as the step message is in, before its host work, so the copy
   overlaps that work (deferred receive);
3. the last rank computes the logits, samples them on its device (as one process does) and sends the
   sampled ids with each row's status straight to rank 0's device (`PipelineGroup.send_ids`); rank 0
   reads the step's tokens there (on CUDA a pinned copy queued on a side stream as they arrive). Only a
   step whose requests report log-probabilities (or prompt log-probabilities), or whose rows failed, is
   also answered on rank 0's host (`StageResult`, `pipeline_messages.reports_logprobs`): a greedy
   decode step costs no host-to-host message back, and rank 0 never waits for the last rank's host.
   The last rank reads a step back (into its mirrors; the answer, if any) only once it has launched the
   next step, or when a message that is not a step comes (rank 0 sends `answer` when it waits for the
   answer of the newest step it launched): it blocks on its inbox, never on its device, so its host
   prepares step t+1 while its device samples step t.
Overlap scheduling (the engine's, on by default): rank 0 launches step t+1 before it has read step t's
tokens; the inputs of t+1 that t samples (placeholders) are taken on rank 0's device from the ids the
last rank sent there, and reach the other ranks with the hidden state. So no host sits between the
ranks' devices: with one stream a token costs the two stages' layers, the sampling and two small copies,
while the hosts prepare the next step. Without overlap, micro-batches are in flight instead (below).
Every rank keeps its receives of the messages posted ahead (`distributed.group.Inbox`): a gloo send
waits for the receiver's receive, so without them rank 0 could not send the next step while the last
rank still works on the previous one. `timing` (rank 0) and `worker_stats` (the others) say where each
rank's time goes, phase by phase (bench/pipeline_decode.py prints them).

Sampling on the last rank: its sampler keeps a mirror of each request's sampling state (parameters,
output tokens: a seeded row's noise comes from its seed and position; `pipeline_worker._Mirror`).
Structured output: rank 0's grammar matcher gives the allowed-token bitmask of each constrained row,
which is sent with the step: vocab/8 bytes a row (31 KB for a 248k vocabulary) against 4 x vocab (1 MB)
to send the fp32 logits row back and sample on rank 0.

Micro-batches (`step`, when overlap scheduling is off): up to pipeline_parallel_size batches are in
flight (vLLM's virtual engines), each with about 1/N of the running requests; a request is in one batch
at a time (`Scheduler.schedule(busy=)`). TIERLM_PP_MAX_IN_FLIGHT=1 turns this off (one batch at a time).

Failure: every collective has `pipeline_timeout_s`; rank 0 waits for results on a thread and watches
the worker processes it spawned (also between steps), so a dead rank ends the step with a `PipelineError`
naming it (and calls `on_failure`: the server stops, then exits with that error). Under torchrun rank 0 cannot
watch the others' processes: a rank that dies shows as the last rank's connection lost (torchrun names
the rank that failed).

MTP speculative decoding: the draft head on the last rank; its steps run serially through
`run_with_drafts` (`engine/pipeline_speculative.py`).

Start-up (every rank) is `stage_setup.build_stage`. Not supported yet: memory-mapped PLE tables.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tierlm.distributed.group import (
    CONTROL_TAG,
    EXIT_PEER_LOST,
    RESULT_TAG,
    PipelineError,
    PipelineGroup,
    describe_exit,
    free_tcp_address,
    rank_device,
)
from tierlm.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from tierlm.engine.pipeline_messages import (
    BatchArrays,
    BlockListChanges,
    DecodeRows,
    DraftChunk,
    NewRequest,
    SampleSpec,
    StageResult,
    StepMessage,
    pack_stage_output,
    reports_logprobs,
    sampled_ids_buffer,
)
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.scheduler import Scheduler, SchedulerOutput
from tierlm.engine.stage_setup import build_stage
from tierlm.engine.stream_clock import StreamClock

logger = logging.getLogger("tierlm")

RESULT_POLL_S = 0.2  # how often rank 0 checks its workers while it waits for a result
WATCH_INTERVAL_S = 1.0  # how often rank 0 checks its workers between steps
# where rank 0's pipeline time goes on the host, summed over steps (`timing`): scheduling (micro-batches;
# with overlap scheduling the engine schedules); waiting for the previous step's sampled ids (with
# overlap, on CPU: the host waits; on CUDA the stream waits, queued in "own layers" once the step's other
# inputs are); building the step message; pickling and sending it to every rank; its own layers (inputs into the static runner's buffers or the batch to the
# device, the layers launched, their output and ids packed and sent on, the ids' receive posted);
# reading the step's sampled ids back (and waiting for the last rank's answer when it has one)
DRIVER_PHASES = ("schedule_seconds", "ids_wait_seconds", "prepare_seconds", "send_seconds", "forward_seconds",
                 "wait_seconds")


def _first_line(exc: BaseException) -> str:
    """An error's first line, without gloo's advice (the rank it names is what matters here)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(". This is typically caused")[0]


def _rank_exit(rank: int, exitcode: int | None) -> str:
    return f"pipeline rank {rank} {describe_exit(exitcode)}"


# ---- rank 0 ------------------------------------------------------------------------------------------
class RecordingCache:
    """Rank 0's `ModelCache` as the cache manager sees it: every slot reset and checkpoint save or
    restore runs here and is also recorded, to be replayed by the other ranks on their layers."""

    RECORDED = ("reset_slot", "save_checkpoint", "restore_checkpoint", "copy_target_states")

    def __init__(self, cache) -> None:
        self._cache = cache
        self.ops: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        attribute = getattr(self._cache, name)
        if name in self.RECORDED:
            def recorded(*args):
                self.ops.append((name, args))
                return attribute(*args)
            return recorded
        return attribute

    def drain(self) -> list[tuple[str, tuple]]:
        ops, self.ops = self.ops, []
        return ops


class _SampledOnDevice:
    """A step's sampled ids as rank 0 receives them from the last rank, on its device (row k: the k-th
    sampling chunk's): what the next step's placeholder inputs are taken from (`ModelRunner`'s
    `previous.pending.tokens`). The first read of `tokens` makes this device's stream wait for their
    receive (`wait`; CUDA), so the next step's other inputs are queued before that wait, off the path from
    the last rank's sampling to this rank's layers."""

    def __init__(self, ids: torch.Tensor, wait) -> None:
        self._ids, self._wait = ids, wait

    @property
    def tokens(self) -> torch.Tensor:
        if self._wait is not None:
            self._wait, wait = None, self._wait
            wait()
        return self._ids


@dataclass(eq=False)
class PipelineStep(LaunchedStep):
    """A step in the pipeline as rank 0 sees it: launched on every rank, its answer not read yet."""

    requests: dict[int, Request] = field(default_factory=dict)  # by key, the requests whose rows come back
    sends: list = field(default_factory=list)  # the step message's sends and the stage output's
    output: torch.Tensor | None = None  # the packed stage output being sent, kept alive until then
    ids_receive: object = None  # the sampled ids' receive (None once waited for)
    number: int = 0  # StepMessage.step
    ids: torch.Tensor | None = None  # [2, max rows] the sampled ids and statuses, on this device
    host_ids: tuple | None = None  # CUDA: (their pinned host copy, its event), queued as they arrive


class _HostIds:
    """CUDA: rank 0's host copies of the sampled ids, a ring of pinned buffers; each step's is copied on a
    side stream as soon as its receive is in (never behind the next step's layers on the main stream),
    with an event the host polls."""

    def __init__(self, max_rows: int, depth: int, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        # flat: a step's [2, rows] is a contiguous view (a column slice of [2, max_rows] is strided, which torch
        # copies through a pageable temporary: a copy the host waits for)
        self.buffers = [(torch.empty(2 * max_rows, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                        for _ in range(depth)]
        self.turn = 0

    def start(self, receive, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        self.turn = (self.turn + 1) % len(self.buffers)
        host, ready = self.buffers[self.turn]
        with torch.cuda.stream(self.stream):
            receive.wait()  # this stream waits for the ids (NCCL: the host does not)
            host = host[: ids.numel()].view_as(ids)
            host.copy_(ids, non_blocking=True)
            ready.record()
        return host, ready


class PipelineDriver:
    """Rank 0's side: starts the workers, builds rank 0's stage, and runs steps through the pipeline."""

    def __init__(self, config, tokenizer_decode=None) -> None:
        from tierlm.distributed.group import torchrun_rank

        self.config = config
        self.world_size = config.pipeline_parallel_size
        self.processes: list[subprocess.Popen] = []  # the ranks > 0 this process spawned (none under torchrun)
        self.failure: str | None = None  # why the pipeline broke (then every step raises it)
        self.closing = self.closed = False
        self._failing = threading.Lock()
        self._receiver: threading.Thread | None = None
        launched = torchrun_rank()
        if launched is not None:
            init_method, (rank, world) = "env://", launched
            if world != self.world_size:
                raise ValueError(f"--pipeline-parallel-size {self.world_size} but torchrun started {world} processes")
            assert rank == 0, "ranks other than 0 run pipeline_worker.run_worker"
        else:
            init_method = free_tcp_address()
            self._spawn_workers(init_method)
        device = rank_device(config.device, 0)
        if device.type == "cpu":  # the ranks share the cores: OpenMP threads that spin on a taken core stall
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        try:
            self.group = PipelineGroup.join(0, self.world_size, device, init_method, config.pipeline_timeout_s)
            self.stage = build_stage(config, self.group)
        except Exception as exc:
            named = None
            if self.processes and not isinstance(exc, ValueError):  # not rank 0's own refusal: who went away?
                try:
                    self._fail(f"starting the pipeline failed: {_first_line(exc)}")
                except PipelineError as error:
                    named = error
            self.close()
            if named is not None:
                raise named from exc
            raise
        for line in self.stage.summaries:
            logger.info("pipeline %s", line)
        self.runner = ModelRunner(self.stage.model, self.stage.cache, Sampler(config.seed), tokenizer_decode,
                                  self.stage.static_decode)
        env = os.environ.get("TIERLM_PP_MAX_IN_FLIGHT")
        self.max_in_flight = int(env) if env else self.world_size
        self.cache = RecordingCache(self.stage.cache)
        self.in_flight: deque[PipelineStep] = deque()  # launched, oldest first
        self.keys: dict[Request, int] = {}  # requests the last rank mirrors
        self._next_key = 0
        self.on_failure = None  # called once the pipeline has failed (from any thread): the server stops
        self._timing = dict.fromkeys(DRIVER_PHASES, 0.0) | {"steps": 0}
        self._layers = StreamClock(self.stage.cache.device)
        # a step's pinned ids copy is reused max_in_flight + 1 steps later: by then it was read (`finish`)
        device = self.stage.cache.device
        depth = max(self.max_in_flight, 2) + 1
        self._host_ids = _HostIds(config.max_num_seqs, depth, device) if device.type == "cuda" else None
        self._launched = 0  # steps launched (StepMessage.step)
        self._block_changes = BlockListChanges()  # what the other ranks hold of each request's block list
        self._peer_error: str | None = None  # the last rank's error, or its connection lost (result thread)
        self._last_rank_error: str | None = None  # the last rank's own error, as its answer said (result thread)
        self._peer_failed = threading.Event()
        self._results: queue.Queue = queue.Queue()
        # posted before any step is sent: the last rank's answers never wait for this process
        self._result_inbox = self.group.inbox(self.world_size - 1, RESULT_TAG, self.group.result_group,
                                              depth=self.world_size)
        self._receiver = threading.Thread(target=self._receive_results, name="pipeline-results", daemon=True)
        self._receiver.start()
        if self.processes:
            threading.Thread(target=self._watch_workers, name="pipeline-watchdog", daemon=True).start()
        atexit.register(self.close)

    # ---- start and stop ----
    def _spawn_workers(self, init_method: str) -> None:
        """One `python -m tierlm.engine.pipeline_worker` per rank > 0 (a fresh interpreter: nothing of the
        caller's main module is imported again), the engine config pickled on its stdin."""
        for rank in range(1, self.world_size):
            process = subprocess.Popen(
                [sys.executable, "-m", "tierlm.engine.pipeline_worker", str(rank), str(self.world_size), init_method],
                stdin=subprocess.PIPE,
            )
            process.stdin.write(pickle.dumps(self.config))
            process.stdin.close()
            self.processes.append(process)

    def close(self) -> None:
        """Stop the workers (a stop message, then their processes) and leave the groups; idempotent."""
        if self.closed:
            return
        self.closing = True  # the watchdog ignores the exits that follow
        group = getattr(self, "group", None)  # None when joining failed
        if group is not None and self.failure is None:
            try:
                for rank in range(1, self.world_size):
                    group.send_object(StepMessage(kind="stop"), rank)
            except Exception as exc:  # noqa: BLE001 - a rank already gone: its process is ended below
                logger.debug("stopping the pipeline: %s", _first_line(exc))
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.terminate()
                process.wait(timeout=5)
        if self._receiver is not None:
            self._receiver.join(timeout=5)  # its receive fails once the last rank is gone
        if group is not None:
            group.close()
        self.closed = True

    # ---- steps ----
    @property
    def busy(self) -> set[Request]:
        return {chunk.request for entry in self.in_flight for chunk in entry.step.chunks}

    def step(self, scheduler: Scheduler) -> tuple[int, list[tuple[SchedulerOutput, StepResult]]]:
        """Micro-batches (without overlap scheduling): launch batches while fewer than max_in_flight are
        out, then take back the oldest. Returns (tokens launched, [(the plan that came back, its result)])."""
        self._check_alive()
        launched = 0
        while len(self.in_flight) < self.max_in_flight:
            began = time.perf_counter()
            share = len(scheduler.running) + len(scheduler.waiting)
            room = max(1, math.ceil(min(share, scheduler.max_num_seqs) / self.max_in_flight))
            plan = scheduler.schedule(busy=self.busy, max_requests=room)
            self._timing["schedule_seconds"] += time.perf_counter() - began
            if not plan.chunks:
                break
            self.launch(plan)
            launched += plan.num_tokens
        if not self.in_flight:
            return launched, []
        oldest = self.in_flight[0]
        return launched, [(oldest.step, self.finish(oldest))]

    def launch(self, plan: SchedulerOutput, previous: PipelineStep | None = None) -> PipelineStep:
        """Send every rank the step, queue this rank's layers and the send of their output, and post the
        receive of its sampled ids; nothing here waits for the device. previous: the step launched before,
        whose sampled ids (on this device) this one's placeholder inputs are (overlap scheduling)."""
        self._check_alive()
        runner, waited = self.runner, time.perf_counter()
        if previous is not None and previous.host_ids is None:  # CPU: the host waits (CUDA: at first read)
            self._wait_ids(previous)
        began = time.perf_counter()
        message = self._new_message()
        static = runner.fits_static(plan)  # every rank runs it from its static runner, given host lists
        if static:
            wanted = [(chunk, row, 1) for row, chunk in enumerate(plan.chunks)]
        else:
            batch, wanted = runner.prepare(plan, device="cpu")
            message.batch = BatchArrays.of(batch)
        requests = self._add_samples(message, wanted)
        sampling = [chunk.request for chunk, _, _ in wanted if chunk.samples]
        if static:  # after the loop: every request has its key
            chunks, changes = plan.chunks, self._block_changes
            message.decode = DecodeRows([c.start for c in chunks], [c.request.state_slot for c in chunks],
                                        [changes.change(self.keys[c.request], c.request.block_ids) for c in chunks])
        sent = time.perf_counter()
        sends = self._send_all(message)
        launched = time.perf_counter()
        with self._layers.timed():
            hidden, _, token_ids = runner.run_forward(plan, previous)
            # the ids go with the hidden state: placeholders resolved on this device reach every rank
            output = pack_stage_output(hidden, token_ids)
        ids = sampled_ids_buffer(len(sampling), self.stage.cache.device, zeroed=False)  # the receive fills it
        try:
            sends.append(self.group.isend(output, 1))
            receive = self.group.recv_ids(ids)
        except Exception as exc:  # noqa: BLE001
            self._fail(f"sending the hidden state to rank 1 failed: {_first_line(exc)}")
        host_ids = None if self._host_ids is None else self._host_ids.start(receive, ids)
        # CUDA: the next step's stream waits for the ids when it first reads them (CPU: `launch` waited)
        sampled = _SampledOnDevice(ids[0], None if host_ids is None else functools.partial(self._wait_receive, receive))
        entry = PipelineStep(plan, sampling, sampled, StepResult(), requests=requests, sends=sends,
                             output=output, ids_receive=receive, number=self._launched, ids=ids, host_ids=host_ids)
        self.in_flight.append(entry)
        timing, done = self._timing, time.perf_counter()
        timing["ids_wait_seconds"] += began - waited
        timing["prepare_seconds"] += sent - began
        timing["send_seconds"] += launched - sent
        timing["forward_seconds"] += done - launched
        timing["steps"] += 1
        return entry

    def _new_message(self, **fields) -> StepMessage:
        """The next step's message (numbered; the cache operations since the last one, the requests released),
        the released requests' block lists forgotten."""
        self._launched += 1
        message = StepMessage(step=self._launched, cache_ops=self.cache.drain(), released=self._release_finished(),
                              **fields)
        self._block_changes.forget(message.released)
        return message

    def _key(self, request: Request, message: StepMessage) -> int:
        """The request's key; a request new to the last rank is added to the message (`NewRequest`)."""
        key = self.keys.get(request)
        if key is None:
            key = self.keys[request] = self._next_key
            self._next_key += 1
            message.new_requests.append(NewRequest(
                key, request.request_id, request.prompt_token_ids, request.params, request.eos_token_ids,
                request.max_model_len, list(request.known_output_token_ids), request.structured_output is not None,
                request.bad_words_token_ids,
            ))
        return key

    def _add_samples(self, message: StepMessage, wanted: list[tuple]) -> dict[int, Request]:
        """The logits rows each chunk wants (`SampleSpec`, with a constrained row's grammar bitmask) into the
        message; returns those chunks' requests by key."""
        requests = {}
        for chunk, first, count in wanted:
            request = chunk.request
            key = self._key(request, message)
            grammar = request.structured_output
            bitmask = grammar.token_bitmask() if grammar is not None and chunk.samples else None
            bitmask = None if bitmask is None else bitmask.numpy()
            message.samples.append(SampleSpec(key, first, count, chunk.start, chunk.num_tokens, chunk.samples, bitmask))
            requests[key] = request
        return requests

    def run_with_drafts(self, plan: SchedulerOutput, batch, wanted: list[tuple]) -> StageResult:
        """A speculative decoding step (engine/pipeline_speculative.py), run to its end: every rank gets the
        batch (verify rows, per-position slots) and each chunk's `DraftChunk`; rank 0 runs its layers and
        sends them on; the last rank verifies, drafts, and answers on the host, by request key (`keys`).
        Serial: no step may be in flight."""
        self._check_alive()
        if self.in_flight:
            raise RuntimeError("a speculative pipeline step runs alone: steps are in flight")
        message = self._new_message(batch=BatchArrays.of(batch))
        self._add_samples(message, wanted)
        message.drafts = []
        for chunk in plan.chunks:
            request = chunk.request
            message.drafts.append(DraftChunk(self._key(request, message), chunk.start, chunk.num_tokens, chunk.samples,
                                             list(chunk.draft_token_ids), request.state_slot, request.home_slot,
                                             list(request.block_ids)))
        sends = self._send_all(message)
        with self._layers.timed():
            on_device = message.batch.batch(self.stage.cache.device)
            output = pack_stage_output(self.runner.forward(on_device), on_device.token_ids)
        try:
            sends.append(self.group.isend(output, 1))
        except Exception as exc:  # noqa: BLE001
            self._fail(f"sending the hidden state to rank 1 failed: {_first_line(exc)}")
        answer = self._wait_result()
        self._wait_sends(sends)
        self._check_answer(answer, message.step)
        self._timing["steps"] += 1
        return answer

    def finish(self, entry: PipelineStep) -> StepResult:
        """The step's sampled tokens (read from the sampled ids on this device) and, when a request reports
        log-probabilities or a row failed, the last rank's answer (`reports_logprobs`; answers come in
        order: `entry` is the oldest step in flight). Requests finished meanwhile are left out."""
        if not self.in_flight or self.in_flight[0] is not entry:
            raise RuntimeError("pipeline steps are read back in the order they were launched")
        self.in_flight.popleft()
        began = time.perf_counter()
        tokens, statuses = self._read_ids(entry)
        answer = None
        if any(statuses) or any(reports_logprobs(request.params) for request in entry.requests.values()):
            if not self.in_flight:  # no later step: the last rank reads this one back when told to
                self._send_last(StepMessage(kind="answer"))
            answer = self._wait_result()
        self._wait_sends(entry.sends)
        self._timing["wait_seconds"] += time.perf_counter() - began
        result = StepResult()
        if answer is None:  # every row sampled, nothing more to report: the ids are the answer
            for request, token in zip(entry.sampling, tokens, strict=True):
                if not request.is_finished:  # aborted, or (overlap) finished by the step before: discarded
                    result.sampled[request] = token
            return result
        self._check_answer(answer, entry.number)
        for key, request in entry.requests.items():
            if not request.is_finished:  # aborted, or (overlap) finished by the step before: discarded
                take_answer(answer, key, request, result)
        return result

    def _wait_sends(self, sends: list) -> None:
        """A step's sends waited for: every rank has received its message and hidden state."""
        try:
            for work in sends:
                work.wait()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"sending a step or its hidden state failed: {_first_line(exc)}")

    def _check_answer(self, answer: StageResult, step: int) -> None:
        """Fail on the last rank's error, or on an answer to another step than `step`."""
        if answer.error is not None:
            self._fail(self._last_rank_failed(answer.error))
        if answer.step != step:
            self._fail(f"pipeline rank {self.world_size - 1} answered step {answer.step} where rank 0 expected "
                       f"step {step}'s answer")

    def _wait_ids(self, entry: PipelineStep) -> None:
        """The step's sampled ids on this device (CPU: the host waits for them)."""
        if entry.ids_receive is None:
            return
        self._wait_receive(entry.ids_receive)
        entry.ids_receive = None

    def _wait_receive(self, receive) -> None:
        """A receive of sampled ids waited for (on CUDA the current stream waits, not the host)."""
        try:
            receive.wait()
        except Exception as exc:  # noqa: BLE001
            self._fail(self._lost_last_rank(exc))

    def _read_ids(self, entry: PipelineStep) -> tuple[list[int], list[int]]:
        """The step's sampled ids and their statuses, one per sampling row, on the host (CPU: waits for
        their receive; CUDA: polls their copy's event, watching the last rank meanwhile)."""
        rows = len(entry.sampling)
        if entry.host_ids is None:
            self._wait_ids(entry)
            return entry.ids[:, :rows].tolist()
        host, ready = entry.host_ids
        deadline = time.monotonic() + self.config.pipeline_timeout_s
        check = time.monotonic() + RESULT_POLL_S
        while not ready.query():  # a few hundred microseconds: polled (a dead last rank never sends them)
            if self._peer_error is not None:
                self._fail(self._peer_error)
            if time.monotonic() > check:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"no sampled ids from pipeline rank {self.world_size - 1} in "
                               f"{self.config.pipeline_timeout_s:g} s (pipeline_timeout_s)")
                check = time.monotonic() + RESULT_POLL_S
            time.sleep(0)
        return host[:, :rows].tolist()

    def _send_last(self, message: StepMessage) -> None:
        last = self.world_size - 1
        try:
            self.group.send_object(message, last)
        except Exception as exc:  # noqa: BLE001
            self._fail(f"sending to pipeline rank {last} failed: {_first_line(exc)}")

    def _release_finished(self) -> list[int]:
        """The keys of requests that finished (or were aborted) and are in no batch in flight: the last rank
        drops its mirrors of them."""
        busy = self.busy
        done = [request for request in self.keys if request.is_finished and request not in busy]
        return [self.keys.pop(request) for request in done]

    def _send_all(self, message: StepMessage) -> list:
        """Start sending a step to every other rank; the sends are waited for when its answer is back."""
        sends = []
        for rank in range(1, self.world_size):
            try:
                sends += self.group.post_object(message, rank)
            except Exception as exc:  # noqa: BLE001
                self._fail(f"sending a step to rank {rank} failed: {_first_line(exc)}")
        return sends

    # ---- waiting, and failures ----
    def _receive_results(self) -> None:
        """The result thread: the last rank's answers, in order, into a queue (an error ends it; the last
        rank's error, or the lost connection, is also kept for a wait on the sampled ids)."""
        while True:
            try:
                answer = self._result_inbox.get()
            except Exception as exc:  # noqa: BLE001
                self._peer_error = self._peer_error or self._lost_last_rank(exc)
                self._peer_failed.set()
                self._results.put(exc)
                return
            if answer.error is not None:
                self._peer_error = self._last_rank_error = self._last_rank_failed(answer.error)
                self._peer_failed.set()
            self._results.put(answer)

    def _wait_result(self) -> StageResult:
        deadline = time.monotonic() + self.config.pipeline_timeout_s
        while True:
            try:
                answer = self._results.get(timeout=RESULT_POLL_S)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"no result from pipeline rank {self.world_size - 1} in "
                               f"{self.config.pipeline_timeout_s:g} s (pipeline_timeout_s)")
                continue
            if isinstance(answer, Exception):
                self._fail(self._lost_last_rank(answer))
            return answer

    def _watch_workers(self) -> None:
        """Between steps too (an idle server): a worker that exits unasked fails the pipeline (and calls
        on_failure) within WATCH_INTERVAL_S."""
        while not self.closing and self.failure is None:
            time.sleep(WATCH_INTERVAL_S)
            exited = self._exited_worker()
            if exited is not None and not self.closing and self.failure is None:
                try:
                    self._fail(exited)
                except PipelineError:
                    return

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise PipelineError(self.failure)
        exited = self._exited_worker()
        if exited is not None:
            self._fail(exited)

    def _exited_worker(self) -> str | None:
        """The first spawned worker that has exited, as a failure naming it ("pipeline rank 1 killed by
        SIGKILL"); None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return _rank_exit(rank, process.returncode)
        return None

    def _lost_last_rank(self, exc: BaseException) -> str:
        return f"lost the connection to pipeline rank {self.world_size - 1}: {_first_line(exc)}"

    def _last_rank_failed(self, error: str) -> str:
        """The last rank's own error (`StageResult.error`) as a failure naming it."""
        return f"pipeline rank {self.world_size - 1} failed during a step: {error}"

    def _fail(self, why: str) -> None:
        """Name the rank that went first (a worker that saw another go exits with EXIT_PEER_LOST), stop
        the others, raise."""
        with self._failing:
            self._record_failure(why)
        raise PipelineError(self.failure)

    def _record_failure(self, why: str) -> None:
        if self.failure is None:
            deadline = time.monotonic() + 3.0
            while self.processes and time.monotonic() < deadline and all(p.poll() is None for p in self.processes):
                time.sleep(0.05)
            dead = [(rank, p.returncode) for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]
            if any(rank == self.world_size - 1 for rank, _ in dead):
                # it sends its own error before it exits, but the result thread may read it only after a send
                # or a poll has seen the rank go: that error, not what its going caused here, is the failure
                self._peer_failed.wait(timeout=1.0)
            why = self._last_rank_error or why
            first = sorted(dead, key=lambda item: item[1] == EXIT_PEER_LOST)  # who saw another go: last
            if first:
                named = _rank_exit(*first[0])
                why = why if why.startswith(named) else f"{named} ({why})"
            self.failure = why
            logger.error("%s; stopping the pipeline", why)
            for process in self.processes:
                if process.poll() is None:
                    process.terminate()
            if self.on_failure is not None:
                self.on_failure()

    # ---- measurements (bench/pipeline_decode.py) ----
    @property
    def timing(self) -> dict:
        """Rank 0's seconds per phase (DRIVER_PHASES) summed over its steps, its stream's time in its
        layers (layers_seconds: syncs on CUDA), the steps, and how many ran from the static decode runner."""
        return dict(self._timing, layers_seconds=self._layers.total(), static_steps=self.runner.static_steps)

    def worker_stats(self) -> list[dict]:
        """Each worker's counters: host work, time waiting for the hidden state, forward, steps."""
        stats = []
        for rank in range(1, self.world_size):
            self.group.send_object(StepMessage(kind="stats"), rank)
            stats.append(self.group.recv_object(rank, tag=CONTROL_TAG))
        return stats

    def echo_seconds(self, shape: tuple[int, ...], dtype: torch.dtype, repeats: int = 20) -> float:
        """Round trip of a hidden state of `shape` between ranks 0 and 1, halved: one stage-to-stage copy."""
        if self.in_flight:
            raise RuntimeError("echo_seconds between steps only: batches are in flight")
        tensor = torch.zeros(shape, dtype=dtype, device=self.stage.cache.device)
        self.group.send_object(StepMessage(kind="echo", echo_shape=tuple(shape), echo_repeats=repeats), 1)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.group.isend(tensor, 1).wait()
            self.group.irecv(tensor, 1).wait()
            if tensor.device.type == "cuda":
                torch.cuda.synchronize(tensor.device)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] / 2


def take_answer(answer, key, request: Request, result: StepResult) -> bool:
    """The last rank's answer (`StageResult`) for the request keyed `key` into the request and `result`: a
    failure, or its prompt log-probabilities, sampled id and log-probabilities; False when it failed."""
    if key in answer.failed:
        result.failed[request] = answer.failed[key]
        return False
    if key in answer.prompt_logprobs:
        request.prompt_logprobs.extend(answer.prompt_logprobs[key])
    if key in answer.sampled:
        result.sampled[request] = answer.sampled[key]
        if key in answer.logprobs:
            request.logprobs.append(answer.logprobs[key])
            request.cumulative_logprob = answer.cumulative_logprob[key]
    return True
