"""Run one scheduled step: build the `ForwardBatch`, run the model, sample, collect log-probabilities.

Takes the scheduler's plain `SchedulerOutput`, returns a `StepResult`: {request: sampled token} for
chunks that reach their request's last token, and {request: why} for requests whose own part of the step
failed (their logits row, sampling parameters or grammar): those end alone, the rest of the batch goes
on. Logits are computed only for rows that need them: the last row of each sampling chunk, plus every
prompt row of requests that asked for prompt log-probabilities. The sampling rows stay on the device and
are sampled together (`Sampler.sample`); only prompt log-probability rows are copied to the host whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler, position_logprobs
from tierlm.engine.scheduler import SchedulerOutput
from tierlm.engine.trace import NoTrace
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.model_cache import ModelCache

logger = logging.getLogger("tierlm")


@dataclass
class StepResult:
    sampled: dict[Request, int] = field(default_factory=dict)
    # speculative decoding: the drafts a request accepted, which come before its sampled token
    accepted: dict[Request, list[int]] = field(default_factory=dict)
    failed: dict[Request, str] = field(default_factory=dict)  # request -> why its part of the step failed


class ModelRunner:
    def __init__(
        self, model, cache: ModelCache, sampler: Sampler, decode_token, static_decode=None, ngram_store=None
    ) -> None:
        self.model = model
        self.cache = cache
        self.static_decode = static_decode  # a StaticDecodeRunner, or None to run every step eagerly
        self.ngram_store = ngram_store  # an NgramStore when PLE tables are memory-mapped files
        self.sampler = sampler
        self.decode_token = decode_token  # token id -> text, for Logprob.decoded_token
        self.device = cache.device
        self.trace = NoTrace()  # the engine's StepTrace under --trace
        self.static_steps = 0  # forwards run by static_decode (a pipeline's measurements read it)

    def execute(self, step: SchedulerOutput) -> StepResult:
        trace = self.trace
        with trace.phase("prepare batch"):
            batch, wanted = self.prepare(step)
        with trace.phase("launch forward"), trace.gpu("forward"):
            logits = self.forward(batch)  # always run: the chunk fills the cache even with no rows
        with trace.phase("sample"):
            return self.sample(wanted, logits)

    def prepare(self, step: SchedulerOutput, device=None) -> tuple[ForwardBatch, list[tuple]]:
        """The step's batch (on `device`, default the cache's), and which of its logits rows each chunk
        needs: (chunk, first row, count). A chunk's draft tokens (speculative decoding) follow its tokens."""
        rows, row, wanted = [], 0, []  # wanted: (chunk, first logits row, number of rows)
        for chunk in step.chunks:
            request = chunk.request
            if request.prompt_logprobs is not None and chunk.start < request.num_prompt_tokens - 1:
                # rows predicting prompt tokens start+1 .. min(end, P-1), and the sampling row if any
                count = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens) - chunk.start
                wanted.append((chunk, len(rows), count))
                rows.extend(range(row, row + count))
            elif chunk.samples:
                # with drafts (speculative decoding): the last token's row and every draft's
                count = 1 + len(chunk.draft_token_ids)
                wanted.append((chunk, len(rows), count))
                rows.extend(range(row + chunk.num_tokens - 1, row + chunk.num_tokens - 1 + count))
            row += chunk.num_tokens + len(chunk.draft_token_ids)
        batch = ForwardBatch.build(
            [c.request.token_slice(c.start, c.start + c.num_tokens) + c.draft_token_ids for c in step.chunks],
            [c.start for c in step.chunks],
            [c.request.state_slot for c in step.chunks],
            [c.request.block_ids for c in step.chunks],
            self.cache.block_size,
            device=device or self.device,
            logits=rows,
        )
        if self.ngram_store is not None:
            batch.ple_embeddings = self._ple_embeddings(step)
        return batch, wanted

    def sample(self, wanted: list[tuple], logits: torch.Tensor) -> StepResult:
        """Sample (and record log-probabilities) from the logits rows `prepare` asked for, on their device
        (only the sampled ids and requested log-probabilities come back to the host)."""
        result = StepResult()
        samplers: list[tuple[Request, int]] = []  # (request, its sampling row of `logits`)
        for chunk, first, count in wanted:
            request = chunk.request
            try:
                if request.prompt_logprobs is not None and chunk.start < request.num_prompt_tokens - 1:
                    block = logits[first : first + count].float().cpu()
                    self._record_prompt_logprobs(request, chunk.start, block)
            except Exception as exc:  # noqa: BLE001 (this request's own part: it fails alone)
                logger.exception("prompt logprobs of request %s failed", request.request_id)
                result.failed[request] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
                continue
            if chunk.samples:
                samplers.append((request, first + count - 1))
        if samplers:
            requests = [request for request, _ in samplers]
            rows = logits[torch.tensor([row for _, row in samplers], device=logits.device)]
            for request, outcome in zip(requests, self.sampler.sample(rows, requests, self.decode_token), strict=True):
                if outcome.error is not None:
                    result.failed[request] = outcome.error
                    continue
                result.sampled[request] = outcome.token_id
                if request.logprobs is not None:
                    request.logprobs.append(outcome.logprobs)
                    request.cumulative_logprob += outcome.logprobs[outcome.token_id].logprob
        return result

    def _ple_embeddings(self, step: SchedulerOutput) -> dict[int, torch.Tensor]:
        """Gather this step's PLE rows from the mapped tables; advise freshly sampled tokens' pages first."""
        store = self.ngram_store
        per_chunk, fresh = [], []
        for chunk in step.chunks:
            request = chunk.request
            previous = request.token_slice(max(0, chunk.start - store.context_len), chunk.start)
            tokens = np.asarray(request.token_slice(chunk.start, chunk.start + chunk.num_tokens), dtype=np.int64)
            rows = store.rows_for(store.context_of(previous), tokens)
            per_chunk.append(rows)
            if chunk.start >= request.num_prompt_tokens:  # a sampled token: nothing prefetched it
                fresh.append(rows)
        if fresh:  # one call for all of them, right before the gather
            store.advise_rows([np.concatenate(layer) for layer in zip(*fresh)], merge=False)
        return store.gather([np.concatenate(layer) for layer in zip(*per_chunk)])

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model (or a pipeline stage) on the batch: logits, or the next stage's input."""
        if self.static_decode is not None and self.static_decode.can_run(batch):
            self.static_steps += 1
            return self.static_decode.run(batch)
        return self.model(batch, self.cache)

    def _record_prompt_logprobs(self, request, start: int, block: torch.Tensor) -> None:
        logprobs = torch.log_softmax(block, dim=-1)
        top = request.params.prompt_logprobs
        for offset in range(block.shape[0]):
            target = start + offset + 1
            if target < request.num_prompt_tokens and len(request.prompt_logprobs) == target:
                token = request.prompt_token_ids[target]
                request.prompt_logprobs.append(position_logprobs(logprobs[offset], token, top, self.decode_token))
