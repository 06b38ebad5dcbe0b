"""Turn the logits rows of a step's sampling requests into their next tokens, on the logits' device, in
one batched pass, and report log-probabilities.

`Sampler.launch` plans the step on the host (engine/sampling_plan.py), packs the plan and queues the pass
(engine/sampling_pass.py; on CUDA replayed from a CUDA graph per shape, engine/sampler_graphs.py: one
replay instead of 40-70 kernel launches) and the copy of its results to the host, without reading any
device value back, so the host can go on while the device samples; `collect` waits for the copies and
builds the outcomes (`sample` does both). Plain greedy rows without log-probabilities skip the plan: the
argmax of their logits (and a static decode step's graph takes it itself: `taken_argmax`). Only the
sampled ids, a status per row and the log-probabilities asked for come back. A row it cannot sample
(NaN, every token masked) or whose preparation failed is that request's failure (`Sampled.error`),
which ends this request alone (the engine finishes it with reason "error"), never the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampler_graphs import SamplingGraphs, sampler_graphs_enabled
from tierlm.engine.sampling_noise import seeded_keys
from tierlm.engine.sampling_pass import (
    STATUS_MASKED,
    STATUS_NAN,
    PackedPlan,
    argmax_status,
    eager_pass,
    prompt_bitmasks,
    sampling_pass,
)
from tierlm.engine.sampling_plan import plain_greedy, plan_rows
from tierlm.outputs import Logprob, PositionLogprobs


@dataclass
class Sampled:
    """One row's outcome: its token and log-probabilities, or why it failed."""

    token_id: int | None = None
    logprobs: PositionLogprobs | None = None
    error: str | None = None


def position_logprobs(logprobs: torch.Tensor, token_id: int, top: int, decode) -> PositionLogprobs:
    """{token_id: its Logprob, then the `top` most likely tokens}; ranks are 1-based (a host row)."""
    chosen = logprobs[token_id]
    entries = {token_id: Logprob(float(chosen), int((logprobs > chosen).sum()) + 1, decode(token_id))}
    if top:
        values, ids = logprobs.topk(top)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            entries.setdefault(tid, Logprob(value, rank, decode(tid)))
    return entries


@dataclass
class PendingSample:
    """A launched sampling pass: its device results, and their host copies (ready once `ready` is)."""

    requests: list[Request]
    failed: dict[int, str]  # row -> why its preparation failed
    wanted: list[int]  # rows that report log-probabilities
    tokens: torch.Tensor  # [rows] the sampled ids on the device (what a next step can take as input)
    device_ids: torch.Tensor  # [2, rows] ids and statuses on the device (a pipeline's last rank sends them)
    host_ids: torch.Tensor  # [2, rows] ids and statuses, on the host
    host_logprobs: tuple[torch.Tensor, ...]  # chosen, ranks, top values, top ids of every row (when any asks)
    ready: torch.cuda.Event | None  # recorded after the copies (None on CPU: they are done)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued (pinned, non-blocking) on CUDA; read it after the pass's event."""
    if tensor.device.type != "cuda":
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)


def _ready_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class Sampler:
    def __init__(self, seed: int = 0, graphs: bool = True) -> None:
        """graphs: on CUDA, replay passes from CUDA graphs (`SamplingGraphs`; TIERLM_NO_SAMPLER_GRAPHS=1
        turns them off)."""
        self._keys = np.random.default_rng(seed % (1 << 64))  # unseeded rows' noise keys, fresh each step
        self.graphs = SamplingGraphs(sampling_pass) if graphs and sampler_graphs_enabled() else None

    def row_keys(self, requests: list[Request]) -> np.ndarray:
        """Each row's uint64 noise key: a seeded request's from (its seed, the output position drawn), an
        unseeded one's from this sampler's generator."""
        # the generator's raw 64-bit words: what integers(0, 2**64, dtype=np.uint64) returns for the full
        # range (the same stream), without its bounds handling (~1 us instead of ~12 per step)
        keys = self._keys.bit_generator.random_raw(len(requests))
        seeded = [i for i, r in enumerate(requests) if r.params.seed is not None]
        if seeded:
            keys[seeded] = seeded_keys([requests[i].params.seed for i in seeded],
                                       [len(requests[i].output_token_ids) for i in seeded])
        return keys

    def sample(self, logits: torch.Tensor, requests: list[Request], decode) -> list[Sampled]:
        """One token per row of `logits` [rows, vocab] (row i is requests[i]'s), on the logits' device."""
        return self.collect(self.launch(logits, requests), decode)

    def launch(self, logits: torch.Tensor, requests: list[Request], previous: PendingSample | None = None
               ) -> PendingSample:
        """Queue the pass on the logits' device and the copy of its results to the host, without waiting
        for either (nothing here reads a device value back); `collect` reads them. previous: the pass of
        the step in flight (overlap scheduling), whose ids are the placeholders of penalized requests."""
        device = logits.device
        keys = self.row_keys(requests)  # drawn for every batch: later draws do not depend on the rows' kinds
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        failed = {}
        if not wanted and all(plain_greedy(request) for request in requests):
            # what the pass does for them, unplanned: the argmax of the logits in their own dtype (fp32 orders
            # and ties bf16 values the same), no fp32 copy
            _, tokens, status = argmax_status(logits, logits)
            outputs = (torch.stack([tokens, status]),)
        else:
            plan = plan_rows(requests, logits.shape[1], keys, pinned=device.type == "cuda",
                             previous=None if previous is None else previous.requests)
            failed = plan.failed
            packed = PackedPlan(plan, max(requests[i].params.logprobs for i in wanted) if wanted else None,
                         0 if previous is None else len(previous.requests))
            earlier = previous.tokens if packed.shape.pending else None
            prompts = prompt_bitmasks(plan, device)
            outputs = None
            if self.graphs is not None and device.type == "cuda":
                outputs = self.graphs.run(packed.shape, logits, packed.words, plan.bitmask, earlier, prompts)
            if outputs is None:
                outputs = eager_pass(packed, plan, logits.float(), earlier, prompts)
            else:  # the ids outlive the next replay (the next step's input)
                outputs = (outputs[0].clone(), *outputs[1:])
        device_ids = outputs[0]
        return PendingSample(requests, failed, wanted, device_ids[0], device_ids, _to_host(device_ids),
                             tuple(_to_host(t) for t in outputs[1:]), _ready_event(device))

    def taken_argmax(self, requests: list[Request], device_ids: torch.Tensor, host_ids: torch.Tensor,
                     ready: torch.cuda.Event | None) -> PendingSample:
        """The pass of rows that are all plain greedy, without log-probabilities, whose argmax and status the
        static decode graph took (`greedy_readback`): device_ids [2, rows] (ids, statuses), host_ids their
        copy, ready its event. The rows' noise keys are drawn as `launch` draws them, so later draws are
        those of the same steps without the graph's argmax."""
        self.row_keys(requests)
        return PendingSample(requests, {}, [], device_ids[0], device_ids, host_ids, (), ready)

    def collect(self, pending: PendingSample, decode) -> list[Sampled]:
        """The outcomes of a launched pass (waits for its copy to the host)."""
        if pending.ready is not None:
            pending.ready.synchronize()
        requests, failed, wanted = pending.requests, pending.failed, pending.wanted
        results = [Sampled() for _ in requests]
        for i, (token_id, state) in enumerate(zip(*pending.host_ids.tolist(), strict=True)):
            if i in failed:
                results[i].error = failed[i]
            elif state == STATUS_NAN:
                results[i].error = "the model's logits for this request contain NaN"
            elif state == STATUS_MASKED:
                results[i].error = "no token is allowed next (every logit is masked or -inf)"
            else:
                results[i].token_id = token_id
        if wanted:  # the pass computed every row's; the rows that asked read theirs
            lp_host = [column.tolist() for column in pending.host_logprobs]
            for i in wanted:
                if results[i].error is None:
                    results[i].logprobs = _entries(results[i].token_id, requests[i].params.logprobs,
                                                   *(column[i] for column in lp_host), decode)
        return results


def _entries(token_id: int, top: int, chosen: float, rank: int, values: list[float], ids: list[int],
             decode) -> PositionLogprobs:
    entries = {token_id: Logprob(chosen, rank, decode(token_id))}
    for position, (value, tid) in enumerate(zip(values[:top], ids[:top]), start=1):
        entries.setdefault(tid, Logprob(value, position, decode(tid)))
    return entries
