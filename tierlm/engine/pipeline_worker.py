"""A pipeline rank other than 0: its stage, run on rank 0's step descriptions (see `engine/pipeline.py`).

The loop: receive a `StepMessage` from rank 0; post the receive of the previous stage's output (hidden
state and input ids in one device buffer) at once (deferred receive: the copy overlaps what follows);
replay rank 0's cache operations on this rank's layers; move the batch to the device (a decode step:
its host lists into the static runner's buffers, queued before the stream waits for the hidden state;
the input ids are taken from the received buffer on the device); wait for the receive (on CUDA only the stream waits); run the layers; send the output on. The
last rank samples and sends the sampled ids and their statuses to rank 0's device (its next step may
already wait for them there, and rank 0 reads the step's tokens there). It reads a step back into its
mirrors only after it has launched the next one (or when a message that is not a step comes: rank 0 sends
`answer` when it waits for the newest step's answer): between two steps it blocks on its inbox, never on
its device, so its host prepares step t+1 while its device samples step t. A step that reports
log-probabilities or had a row fail is then answered on rank 0's host (`StageResult`).

The last rank samples with the engine's own `ModelRunner` sampling on mirrors of the requests (`_Mirror`:
parameters, output tokens), on its device, so sampling is the code PP=1 runs: the same ops on the same
values and noise keys, and only the ids and log-probabilities come to the host. A mirror's output ids are
read back before a step whose sampling reads them (penalties, bad words).
Structured-output rows come with rank 0's grammar bitmask. A speculative decoding step (its message
carries `drafts`) is verified, drafted and answered at once (`engine/pipeline_speculative.py`). Messages
from rank 0 arrive in an `Inbox` (receives always posted), so rank 0 can send the next micro-batch while
this rank works.

Exit status: 0 when rank 0 says stop (or on Ctrl-C), EXIT_PEER_LOST when another rank went away first
(a send or receive failed), 1 when this rank failed itself (its error is printed, and the last rank
also sends it to rank 0).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tierlm.distributed.group import (
    CONTROL_TAG,
    EXIT_PEER_LOST,
    RESULT_TAG,
    PipelineGroup,
    rank_device,
    torchrun_rank,
)
from tierlm.engine.model_runner import LaunchedStep, ModelRunner
from tierlm.engine.pipeline_messages import (
    ROW_FAILED,
    BlockLists,
    DecodeRows,
    SampleSpec,
    StageResult,
    StepMessage,
    pack_stage_output,
    reports_logprobs,
    sampled_ids_buffer,
    stage_buffer,
    unpack_stage_input,
)
from tierlm.engine.request import PLACEHOLDER, Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.stage_setup import Stage, build_stage, memory_report
from tierlm.engine.stream_clock import StreamClock
from tierlm.model.forward_batch import on_device

logger = logging.getLogger("tierlm")


class _PeerLost(Exception):
    """A send or receive failed: another rank is gone."""


def _comm(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses
        raise _PeerLost(str(exc)) from None


def worker_main(rank: int, world_size: int, init_method: str, config) -> None:
    """A rank's whole life (spawned by rank 0: see `__main__` below; or torchrun ranks > 0, through
    `serve_if_worker`). Never returns: the process exits with the status the module docstring gives."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    device = rank_device(config.device, rank)
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = None
    try:
        group = _comm(PipelineGroup.join, rank, world_size, device, init_method, config.pipeline_timeout_s)
        stage = build_stage(config, group)
        run_worker(group, stage, config)
    except KeyboardInterrupt:
        os._exit(0)
    except _PeerLost as exc:
        logger.error("another pipeline rank went away (%s); rank %d stops", exc, rank)
        os._exit(EXIT_PEER_LOST)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # no interpreter teardown: the groups' threads may still be blocked on a gone peer


def serve_if_worker(config) -> None:
    """Under torchrun, every rank runs the command: ranks > 0 serve their stage here and exit."""
    launched = torchrun_rank()
    if launched is not None and launched[0] != 0:
        worker_main(launched[0], launched[1], "env://", config)


@dataclass(eq=False)
class _Chunk:
    """What `ModelRunner.sample` reads of a scheduled chunk, over its mirror request (and `SpeculativeRunner`:
    with its drafts, engine/pipeline_speculative.py)."""

    request: Request
    start: int
    num_tokens: int
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)


class _Mirror:
    """The last rank's copy of each request's sampling state, kept in step with rank 0 by the messages."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: dict[int, Request] = {}

    def update(self, message: StepMessage) -> None:
        for key in message.released:
            self.requests.pop(key, None)
        for new in message.new_requests:
            request = Request(new.request_id, new.prompt_token_ids, new.params, new.eos_token_ids,
                              new.max_model_len, output_token_ids=list(new.output_token_ids),
                              bad_words_token_ids=new.bad_words_token_ids)
            if new.has_grammar:
                from tierlm.engine.structured_output import BitmaskGrammar  # xgrammar is slow to import

                request.structured_output = BitmaskGrammar(None)
            self.requests[new.key] = request

    def reads_outputs(self, unread: _Sampling, message: StepMessage) -> bool:
        """Whether the step's sampling reads the output ids of a request the unread step sampled (penalties,
        bad words): those must be read back first."""
        for spec in message.samples:
            request = self.requests.get(spec.key)  # None: new in this message
            # the cheap test first: a step of requests without penalties or bad words builds nothing
            if spec.samples and request is not None and _reads_outputs(request) and request in unread.launched.row_of:
                return True
        return False

    def launch(self, runner: ModelRunner, message: StepMessage, logits: torch.Tensor) -> _Sampling:
        """Queue the sampling of the step's rows on the device (as one process does: `ModelRunner`); prompt
        log-probabilities are read at once."""
        wanted, before, specs = [], {}, message.samples
        for spec in specs:
            request = self.requests[spec.key]
            request.num_computed_tokens = spec.start
            if request.structured_output is not None:
                request.structured_output.bitmask = None if spec.bitmask is None else torch.from_numpy(spec.bitmask)
            before[spec.key] = len(request.prompt_logprobs) if request.prompt_logprobs is not None else 0
            wanted.append((_Chunk(request, spec.start, spec.num_tokens, spec.samples), spec.first, spec.count))
        launched = runner.launch_sampling(wanted, logits)
        # each sampled id counts from now on, filled in when read back: a step launched before then sees
        # the output length one process sees (min_tokens), as the engine's placeholders do
        rows = {}
        for request in launched.sampling:
            rows[request] = len(request.output_token_ids)
            request.output_token_ids.append(PLACEHOLDER)
        prompt_logprobs = {}
        for spec in specs:
            request = self.requests[spec.key]
            if request.prompt_logprobs is not None and len(request.prompt_logprobs) > before[spec.key]:
                prompt_logprobs[spec.key] = request.prompt_logprobs[before[spec.key]:]
        requests = [self.requests[spec.key] for spec in specs]  # kept: a key may be released before read back
        reports = any(reports_logprobs(request.params) for request in requests)
        return _Sampling(message.step, specs, requests, launched, rows, prompt_logprobs, reports)

    def sampled_ids(self, sampling: _Sampling) -> torch.Tensor:
        """The launched step's sampled ids and statuses as rank 0 receives them (`sampled_ids_buffer`),
        column k the k-th sampling spec's: the sampler's own [2, rows] result when every spec's row was
        sampled (the usual step: nothing more queued); else a buffer where a request whose prompt
        log-probabilities failed (it has no sampling row) keeps a 0 column (it reports prompt
        log-probabilities, so its step is answered), and a row whose preparation failed gets the status
        ROW_FAILED."""
        requests = [request for spec, request in zip(sampling.specs, sampling.requests, strict=True) if spec.samples]
        launched, pending = sampling.launched, sampling.launched.pending
        if pending is not None and not pending.failed and launched.sampling == requests:
            return pending.device_ids
        out = sampled_ids_buffer(len(requests), self.device)
        if pending is None:
            return out
        if launched.sampling == requests:
            out.copy_(pending.device_ids)
            columns = list(range(len(requests)))
        else:
            index = {request: k for k, request in enumerate(requests)}
            columns = [index[r] for r in launched.sampling]
            out[:, on_device(columns, out.device)] = pending.device_ids
        if pending.failed:  # rare: the sampler's own preparation of a row raised (its grammar)
            out[1, on_device([columns[row] for row in pending.failed], out.device)] = ROW_FAILED
        return out

    def finish(self, runner: ModelRunner, sampling: _Sampling) -> StageResult:
        """The launched sampling read back (waits for its ids) into the mirrors, and as the answer to rank
        0 (sent only when the step reports log-probabilities or a row failed)."""
        result = runner.finish(sampling.launched)
        out = StageResult(step=sampling.step, prompt_logprobs=sampling.prompt_logprobs)
        for spec, request in zip(sampling.specs, sampling.requests, strict=True):
            key = spec.key
            if request in result.failed:
                out.failed[key] = result.failed[request]
            elif request in result.sampled:
                token = out.sampled[key] = result.sampled[request]
                request.output_token_ids[sampling.rows[request]] = token
                if request.logprobs is not None:
                    out.logprobs[key] = request.logprobs[-1]
                    out.cumulative_logprob[key] = request.cumulative_logprob
        return out


def _reads_outputs(request: Request) -> bool:
    """Whether sampling the request reads its output ids on the host (the engine does not overlap it)."""
    return request.params.has_penalties or bool(request.bad_words_token_ids)


@dataclass
class _Sampling:
    """A step's sampling on the last rank, launched on the device and not read back yet."""

    step: int  # rank 0's number of the step
    specs: list[SampleSpec]
    requests: list[Request]  # each spec's mirror
    launched: LaunchedStep
    rows: dict[Request, int]  # each sampling request's place in its output ids (a placeholder until read)
    prompt_logprobs: dict[int, list]
    reports: bool  # a request reports (prompt) log-probabilities: rank 0 waits for the answer


# where a worker's host time goes, summed over steps (`PipelineDriver.worker_stats`): waiting for the
# next step's message; host work while the hidden state's receive is posted (cache ops, the batch, a
# decode step's inputs into the static runner's buffers); on
# CPU the wait for the hidden state; launching the layers (CPU: running them) and sending the result on;
# the last rank: launching the sampling and the ids' send to rank 0's device; then, for the step before
# (launched one step earlier), the wait for its device to have sampled it (CUDA: usually done by then;
# time here is the host held by its device), reading it back and, when it has one, sending its answer to
# rank 0's host. Beside them (on CUDA, the stream's time): stall_seconds (waiting for the hidden state
# after the host work), layers_seconds (the layers), and static_steps (forwards replayed from the static
# decode runner)
WORKER_PHASES = ("idle_seconds", "host_seconds", "receive_wait_seconds", "forward_seconds", "sample_seconds",
                 "read_wait_seconds", "send_seconds")


def run_worker(group: PipelineGroup, stage: Stage, config) -> None:
    """Follow rank 0's messages until it says stop. The last rank reads a step's sampled ids back only
    once it has launched the next step (or a message that is not a step comes): between steps it waits
    for rank 0's next message, not for its device, so its host prepares the next step while its device
    samples this one."""
    rank, device = group.rank, group.device
    mc = stage.model_config
    decode = None
    if group.is_last:
        from tierlm.model.loader import resolve_model_path
        from tierlm.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(resolve_model_path(config.model))
        decode = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
    runner = ModelRunner(stage.model, stage.cache, Sampler(config.seed), decode, stage.static_decode)
    mirror = _Mirror(device) if group.is_last else None
    drafts = None  # speculative decoding: the last rank verifies and drafts (engine/pipeline_speculative.py)
    if group.is_last and config.speculative_config is not None:
        from tierlm.engine.pipeline_speculative import LastRankDrafts
        from tierlm.engine.speculative import SpeculativeConfig

        drafts = LastRankDrafts(runner, SpeculativeConfig.parse(config.speculative_config), stage.plan.num_slots,
                                config.seed)
    width, dtype = mc.hc_count * mc.hidden_size, stage.cache.dtype
    stall, layers = StreamClock(device), StreamClock(device)
    # rank 0 sends up to world_size steps ahead of the last rank: each finds its receive posted
    inbox = group.inbox(0, depth=group.world_size)
    block_lists = BlockLists()  # each request's block list, from the decode steps' changes
    stats = dict.fromkeys(WORKER_PHASES, 0.0) | {"steps": 0}
    sending: list = []  # the previous step's sends and their buffers (waited for before the next ones)
    unread: _Sampling | None = None  # the last rank: a step whose sampling is launched, not read back yet
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stats[phase] += now - clock
        clock = now

    def send(*works_and_buffers) -> None:
        nonlocal sending
        for work in sending[::2]:
            _comm(work.wait)
        sending = list(works_and_buffers)

    def answer() -> None:
        """Read the unread step's ids back into the mirrors and, if it reports log-probabilities or a row
        failed, send rank 0 its answer (otherwise rank 0 reads its tokens on its device)."""
        nonlocal unread
        sampling, unread = unread, None
        pending = sampling.launched.pending
        if pending is not None and pending.ready is not None:
            pending.ready.synchronize()
        lap("read_wait_seconds")
        with _failure_told_to_rank0(group):
            result = mirror.finish(runner, sampling)
        if sampling.reports or result.failed:
            _answer_rank0(group, result)
        lap("send_seconds")

    while True:
        message: StepMessage = _comm(inbox.get)
        if message.kind in ("step", "answer"):
            lap("idle_seconds")
        else:  # a control message: the wait for it is no step's
            clock = time.perf_counter()
        if unread is not None and (message.kind != "step" or message.drafts is not None
                                   or mirror.reads_outputs(unread, message)):
            answer()  # a step whose sampling reads a request's output ids: those on the host first
        if message.kind == "stop":
            return
        if message.kind == "answer":
            continue
        if message.kind == "stats":
            _comm(group.send_object, dict(stats, rank=rank, stall_seconds=stall.total(), layers_seconds=layers.total(),
                                          static_steps=runner.static_steps, **memory_report(stage)), 0, CONTROL_TAG)
            clock = time.perf_counter()
            continue
        if message.kind == "echo":
            _echo(group, message, dtype)
            clock = time.perf_counter()
            continue
        rows = (message.decode or message.batch).num_tokens
        received = stage_buffer(rows, width, dtype, device)
        receive = _comm(group.irecv, received, rank - 1)  # posted before the host work it overlaps
        for name, args in message.cache_ops:
            getattr(stage.cache, name)(*args)
        if mirror is not None:
            mirror.update(message)
        block_lists.forget(message.released)
        tables = None if message.decode is None else block_lists.apply(message.decode.tables)
        # a decode step's inputs go up before the stream waits for the hidden state: off the path from the
        # previous stage's output to this stage's layers
        staged = None if message.decode is None else _stage_decode(runner, message.decode, tables)
        batch = None if message.batch is None else message.batch.batch(device)
        lap("host_seconds")
        with stall.timed():
            _comm(receive.wait)
        hidden, token_ids = unpack_stage_input(received, rows, width, dtype)
        lap("receive_wait_seconds")
        if mirror is None:
            with layers.timed():
                out = pack_stage_output(_run_layers(runner, staged, batch, hidden, token_ids), token_ids)
            send(_comm(group.isend, out, rank + 1), out)
            lap("forward_seconds")
            stats["steps"] += 1
            continue
        if message.drafts is not None:  # a speculative step: verified, drafted and answered now
            with _failure_told_to_rank0(group):
                batch.token_ids, batch.stage_input = token_ids, hidden
                with layers.timed():
                    result = drafts.step(mirror, message, batch)
            lap("forward_seconds")
            _answer_rank0(group, result)
            lap("send_seconds")
            stats["steps"] += 1
            continue
        with _failure_told_to_rank0(group):
            with layers.timed():
                logits = _run_layers(runner, staged, batch, hidden, token_ids)
            lap("forward_seconds")
            # on the device, as one process samples; the ids go to rank 0's device at once (its next step
            # may already wait for them there), to its host with the log-probabilities when read back
            sampling = mirror.launch(runner, message, logits)
            ids = mirror.sampled_ids(sampling)
            send(_comm(group.send_ids, ids), ids)
            lap("sample_seconds")
        if unread is not None:  # the step before, now that this one is launched behind it
            answer()
        unread = sampling  # read back once the next step is launched, or a message that is not a step comes
        stats["steps"] += 1


@contextmanager
def _failure_told_to_rank0(group: PipelineGroup):
    """The last rank: an error of its own inside (not a lost peer) goes to rank 0 as an answer's error before
    it ends this process, so rank 0 reports what failed on which rank, not only that the rank went away."""
    try:
        yield
    except _PeerLost:
        raise
    except Exception as exc:
        _answer_rank0(group, StageResult(error=f"{type(exc).__name__}: {exc}"))
        raise


def _answer_rank0(group: PipelineGroup, result: StageResult) -> None:
    """The last rank's answer to a step, to rank 0's result thread (its own group: rank 0 waits for it there)."""
    _comm(group.send_object, result, 0, RESULT_TAG, group.result_group)


def _stage_decode(runner: ModelRunner, rows: DecodeRows, tables: list[list[int]]) -> tuple:
    """A decode step's host lists (`tables`: the rows' block lists, rebuilt from the message's changes) into
    the static runner's buffers; each row's input id is taken from the previous stage's buffer
    (`_run_layers`)."""
    n = rows.num_tokens
    return runner.static_decode.stage_decode([0] * n, rows.positions, rows.slots, tables, list(range(n)))


def _run_layers(runner: ModelRunner, staged: tuple | None, batch, hidden: torch.Tensor,
                token_ids: torch.Tensor) -> torch.Tensor:
    """This rank's layers on the step: a decode step staged by `_stage_decode`, replayed from the static
    runner with the hidden state and input ids of the previous stage's buffer; else the batch."""
    if staged is None:
        batch.token_ids, batch.stage_input = token_ids, hidden
        return runner.forward(batch)
    static, n = runner.static_decode, staged[1]
    static.stage_input[:n].copy_(hidden)
    static.previous_tokens[:n].copy_(token_ids)  # what the rows' token sources (0 .. n-1) point at
    runner.static_steps += 1
    return static.replay(*staged)


def _echo(group: PipelineGroup, message: StepMessage, dtype: torch.dtype) -> None:
    """Rank 1: send a hidden state straight back to rank 0, as many times as it says (transfer measurement)."""
    tensor = torch.empty(message.echo_shape, dtype=dtype, device=group.device)
    for _ in range(message.echo_repeats):
        _comm(group.irecv(tensor, 0).wait)
        _comm(group.isend(tensor, 0).wait)


if __name__ == "__main__":  # spawned by `PipelineDriver`: RANK WORLD_SIZE INIT_METHOD, the config on stdin
    import pickle

    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], pickle.load(sys.stdin.buffer))
