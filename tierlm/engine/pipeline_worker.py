"""A pipeline rank other than 0: its stage, run on rank 0's step descriptions (see `engine/pipeline.py`).

The loop: receive a `StepMessage` from rank 0; post the receive of the previous stage's hidden state at
once (deferred receive: the copy overlaps what follows); replay rank 0's cache operations on this
rank's layers; move the batch to the device; wait for the hidden state; run the layers; send the
result on (the last rank: sample, and send the tokens and log-probabilities to rank 0).

The last rank samples with the engine's own `ModelRunner.sample` on mirrors of the requests (`_Mirror`:
parameters, output tokens), on its device, so sampling is the code PP=1 runs: the same
ops on the same values and noise keys, and only the ids and log-probabilities come to the host.
Structured-output rows come with rank 0's grammar bitmask. Messages from rank 0 arrive in an `Inbox`
(receives always posted), so rank 0 can send the next micro-batch while this rank works.

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
from dataclasses import dataclass

import torch

from tierlm.distributed.group import (
    CONTROL_TAG,
    EXIT_PEER_LOST,
    RESULT_TAG,
    PipelineGroup,
    rank_device,
    torchrun_rank,
)
from tierlm.engine.model_runner import ModelRunner
from tierlm.engine.pipeline_messages import SampleSpec, StageResult, StepMessage
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.stage_setup import Stage, build_stage, memory_report
from tierlm.engine.stream_clock import StreamClock

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


@dataclass
class _Chunk:
    """What `ModelRunner.sample` reads of a scheduled chunk."""

    request: Request
    start: int
    num_tokens: int
    samples: bool


class _Mirror:
    """The last rank's copy of each request's sampling state, kept in step with rank 0 by the messages."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}

    def update(self, message: StepMessage) -> None:
        for key in message.released:
            self.requests.pop(key, None)
        for new in message.new_requests:
            request = Request(new.request_id, new.prompt_token_ids, new.params, new.eos_token_ids,
                              new.max_model_len, output_token_ids=list(new.output_token_ids))
            if new.has_grammar:
                from tierlm.engine.structured_output import BitmaskGrammar  # xgrammar is slow to import

                request.structured_output = BitmaskGrammar(None)
            self.requests[new.key] = request

    def sample(self, runner: ModelRunner, specs: list[SampleSpec], logits: torch.Tensor) -> StageResult:
        wanted, before = [], {}
        for spec in specs:
            request = self.requests[spec.key]
            request.num_computed_tokens = spec.start
            if request.structured_output is not None:
                request.structured_output.bitmask = None if spec.bitmask is None else torch.from_numpy(spec.bitmask)
            before[spec.key] = len(request.prompt_logprobs) if request.prompt_logprobs is not None else 0
            wanted.append((_Chunk(request, spec.start, spec.num_tokens, spec.samples), spec.first, spec.count))
        result = runner.sample(wanted, logits)
        out = StageResult()
        for spec in specs:
            key, request = spec.key, self.requests[spec.key]
            if request.prompt_logprobs is not None and len(request.prompt_logprobs) > before[key]:
                out.prompt_logprobs[key] = request.prompt_logprobs[before[key]:]
            if request in result.failed:
                out.failed[key] = result.failed[request]
            elif request in result.sampled:
                token = out.sampled[key] = result.sampled[request]
                request.output_token_ids.append(token)
                if request.logprobs is not None:
                    out.logprobs[key] = request.logprobs[-1]
                    out.cumulative_logprob[key] = request.cumulative_logprob
        return out


# where a worker's host time goes, summed over steps (`PipelineDriver.worker_stats`): waiting for the
# next step's message; host work while the hidden state's receive is posted (cache ops, the batch); on
# CPU the wait for the hidden state; launching the layers (CPU: running them) and sending the result on;
# the last rank: sampling (on CUDA this waits for the layers) and sending the ids to rank 0. Beside
# them (on CUDA, the stream's time): stall_seconds (waiting for the hidden state after the host work),
# layers_seconds (the layers), and static_steps (forwards replayed from the static decode runner)
WORKER_PHASES = ("idle_seconds", "host_seconds", "receive_wait_seconds", "forward_seconds", "sample_seconds",
                 "send_seconds")


def run_worker(group: PipelineGroup, stage: Stage, config) -> None:
    rank, device = group.rank, group.device
    mc = stage.model_config
    decode = None
    if group.is_last:
        from tierlm.model.loader import resolve_model_path
        from tierlm.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(resolve_model_path(config.model))
        decode = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
    runner = ModelRunner(stage.model, stage.cache, Sampler(config.seed), decode, stage.static_decode)
    mirror = _Mirror() if group.is_last else None
    width, dtype = mc.hc_count * mc.hidden_size, stage.cache.dtype
    stall, layers = StreamClock(device), StreamClock(device)
    # rank 0 sends up to world_size steps ahead of the last rank: each finds its receive posted
    inbox = group.inbox(0, depth=group.world_size)
    stats = dict.fromkeys(WORKER_PHASES, 0.0) | {"steps": 0}
    pending_send = None
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stats[phase] += now - clock
        clock = now

    while True:
        message: StepMessage = _comm(inbox.get)
        if message.kind == "stop":
            return
        if message.kind == "stats":
            _comm(group.send_object, dict(stats, rank=rank, stall_seconds=stall.total(), layers_seconds=layers.total(),
                                          static_steps=runner.static_steps, **memory_report(stage)), 0, CONTROL_TAG)
            clock = time.perf_counter()
            continue
        if message.kind == "echo":
            _echo(group, message, dtype)
            clock = time.perf_counter()
            continue
        lap("idle_seconds")
        hidden = torch.empty(message.batch.num_tokens, width, dtype=dtype, device=device)
        receive = _comm(group.irecv, hidden, rank - 1)  # posted before the host work it overlaps
        for name, args in message.cache_ops:
            getattr(stage.cache, name)(*args)
        if mirror is not None:
            mirror.update(message)
        batch = message.batch.batch(device)
        lap("host_seconds")
        with stall.timed():
            _comm(receive.wait)
        batch.stage_input = hidden
        lap("receive_wait_seconds")
        if mirror is None:
            with layers.timed():
                out = runner.forward(batch).clone()  # not a CUDA graph's output buffer: the next replay reuses it
            if pending_send is not None:
                _comm(pending_send[0].wait)
            pending_send = (_comm(group.isend, out, rank + 1), out)
            lap("forward_seconds")
        else:
            try:
                with layers.timed():
                    logits = runner.forward(batch)
                lap("forward_seconds")
                # on the device, as one process samples: only the ids and log-probabilities come back
                result = mirror.sample(runner, message.samples, logits)
                lap("sample_seconds")
            except Exception as exc:
                _comm(group.send_object, StageResult(error=f"{type(exc).__name__}: {exc}"), 0, RESULT_TAG,
                      group.result_group)
                raise
            _comm(group.send_object, result, 0, RESULT_TAG, group.result_group)
            lap("send_seconds")
        stats["steps"] += 1


def _echo(group: PipelineGroup, message: StepMessage, dtype: torch.dtype) -> None:
    """Rank 1: send a hidden state straight back to rank 0, as many times as it says (transfer measurement)."""
    tensor = torch.empty(message.echo_shape, dtype=dtype, device=group.device)
    for _ in range(message.echo_repeats):
        _comm(group.irecv(tensor, 0).wait)
        _comm(group.isend(tensor, 0).wait)


if __name__ == "__main__":  # spawned by `PipelineDriver`: RANK WORLD_SIZE INIT_METHOD, the config on stdin
    import pickle

    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], pickle.load(sys.stdin.buffer))
