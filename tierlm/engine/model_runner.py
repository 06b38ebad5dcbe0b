"""Run one scheduled step: build the `ForwardBatch`, run the model, sample, collect log-probabilities.

Takes the scheduler's plain `SchedulerOutput`, returns a `StepResult`: {request: sampled token} for
chunks that reach their request's last token, and {request: why} for requests whose own part of the step
failed (their logits row, sampling parameters or grammar): those end alone, the rest of the batch goes
on. Logits are computed only for rows that need them: the last row of each sampling chunk, plus every
prompt row of requests that asked for prompt log-probabilities. The sampling rows stay on the device and
are sampled together (`Sampler.sample`); only prompt log-probability rows are copied to the host whole.

`execute` is `finish(launch(step))`. `launch` queues the step's forward and sampling without reading a
device value back; `finish` waits for the sampled ids. Between the two the engine may schedule and launch
the next step (overlap scheduling): an input that is still a placeholder (engine/request.py) is the
previous launched step's sampled id for that request, taken on the device. A decode-only step that fits
the `StaticDecodeRunner` goes to it as host lists (`stage_decode`, then `replay`), without a `ForwardBatch`;
when its rows are all plain greedy without log-probabilities, the argmax its graph took is their sample
(`greedy_readback`: one replay and one small copy into a reused pinned buffer per step).
A request with images (engine/images.py) always runs eagerly: its rows take M-RoPE positions (decode
rows: position + the prompt's delta) and its prefill chunks the vision tower's features.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from tierlm.engine.images import chunk_image_rows
from tierlm.engine.readbacks import Readbacks
from tierlm.engine.request import Request
from tierlm.engine.sampler import PendingSample, Sampler, position_logprobs
from tierlm.engine.sampling_plan import plain_greedy
from tierlm.engine.scheduler import ScheduledChunk, SchedulerOutput
from tierlm.engine.trace import NoTrace
from tierlm.model.forward_batch import ForwardBatch, on_device
from tierlm.model.model_cache import ModelCache

logger = logging.getLogger("tierlm")


@dataclass
class StepResult:
    sampled: dict[Request, int] = field(default_factory=dict)
    # speculative decoding: the drafts a request accepted, which come before its sampled token
    accepted: dict[Request, list[int]] = field(default_factory=dict)
    failed: dict[Request, str] = field(default_factory=dict)  # request -> why its part of the step failed


@dataclass(eq=False)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `ModelRunner.finish` reads it back."""

    step: SchedulerOutput
    sampling: list[Request]  # the requests of its sampling rows, in row order
    pending: PendingSample | None  # None: no row sampled
    result: StepResult  # what is known at launch: requests whose prompt log-probabilities failed
    # overlap scheduling: the requests that count this step's token as a placeholder (the engine's)
    placeholders: set[Request] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.row_of = {request: row for row, request in enumerate(self.sampling)}

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens


class ModelRunner:
    def __init__(
        self, model, cache: ModelCache, sampler: Sampler, decode_token, static_decode=None, ngram_store=None,
        encoder_cache=None,
    ) -> None:
        self.model = model
        self.encoder_cache = encoder_cache  # an EncoderCache: image features across requests (engine/encoder.py)
        self.cache = cache
        self.static_decode = static_decode  # a StaticDecodeRunner, or None to run every step eagerly
        self.ngram_store = ngram_store  # an NgramStore when PLE tables are memory-mapped files
        self.sampler = sampler
        self.decode_token = decode_token  # token id -> text, for Logprob.decoded_token
        self.device = cache.device
        self.trace = NoTrace()  # the engine's StepTrace under --trace
        self.static_steps = 0  # forwards run by static_decode (a pipeline's measurements read it)
        self._readbacks: Readbacks | None = None  # made at the first step whose argmax the static graph took

    def execute(self, step: SchedulerOutput) -> StepResult:
        return self.finish(self.launch(step))

    def launch(self, step: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling. previous: the step launched before, whose sampled ids
        this one's placeholder inputs are (required when the step has any)."""
        logits, wanted, _, static = self._run_forward(step, previous)
        with self.trace.phase("sample"):
            if static and self.static_decode.argmax_readback is not None and all(
                    plain_greedy(chunk.request) and chunk.request.params.logprobs is None for chunk in step.chunks):
                return self._launch_taken_argmax(step)
            return self._launch_sampling(step, wanted, logits, previous)

    def _launch_taken_argmax(self, step: SchedulerOutput) -> LaunchedStep:
        """A static step of plain greedy rows: the argmax its graph took (`StaticDecodeRunner.greedy_readback`)
        copied to the host (one copy into a reused pinned buffer, `Readbacks`), nothing else launched."""
        static, requests = self.static_decode, [chunk.request for chunk in step.chunks]
        if self._readbacks is None:
            self._readbacks = Readbacks(static.max_batch, 2, self.device)
        readback = static.argmax_readback[: len(requests)]
        host, ready = self._readbacks.copy(readback)
        return LaunchedStep(step, requests, self.sampler.taken_argmax(requests, readback.T, host.T, ready),
                            StepResult())

    def run_forward(self, step: SchedulerOutput, previous: LaunchedStep | None = None):
        """Queue the step's forward (the model, or a pipeline stage): (its output, which logits rows each
        chunk wants: (chunk, first row, count), the batch's input ids on the device with the placeholders
        taken from `previous`'s sampled ids)."""
        return self._run_forward(step, previous)[:3]

    def _run_forward(self, step: SchedulerOutput, previous: LaunchedStep | None = None):
        """`run_forward`'s three, and whether the static runner ran it."""
        trace = self.trace
        with trace.phase("prepare batch"):
            sources = self._placeholder_sources(step, previous)
            if self.fits_static(step):  # host lists straight into the graph's buffers
                staged = self._stage_static(step, sources, previous)
                wanted = [(chunk, row, 1) for row, chunk in enumerate(step.chunks)]
            else:
                staged = None
                batch, wanted = self.prepare(step)
                if sources:
                    rows, taken = zip(*sources.items())
                    batch.token_ids[on_device(list(rows), batch.token_ids.device)] = (
                        previous.pending.tokens[on_device(list(taken), batch.token_ids.device)])
        with trace.phase("launch forward"), trace.gpu("forward"):
            # always run: a chunk fills the cache even with no logits rows
            if staged:
                self.static_steps += 1
                return self.static_decode.replay(*staged), wanted, self.static_decode.token_ids[: staged[1]], True
            return self.forward(batch), wanted, batch.token_ids, False

    def finish(self, launched: LaunchedStep) -> StepResult:
        """The launched step's sampled tokens and log-probabilities (waits for their copy to the host)."""
        result = launched.result
        if launched.pending is None:
            return result
        outcomes = self.sampler.collect(launched.pending, self.decode_token)
        for request, outcome in zip(launched.sampling, outcomes, strict=True):
            if request.is_finished:  # aborted, or (overlap) finished by the step before: discarded
                continue
            if outcome.error is not None:
                result.failed[request] = outcome.error
                continue
            result.sampled[request] = outcome.token_id
            if request.logprobs is not None:
                request.logprobs.append(outcome.logprobs)
                request.cumulative_logprob += outcome.logprobs[outcome.token_id].logprob
        return result

    @staticmethod
    def _placeholder_sources(step: SchedulerOutput, previous: LaunchedStep | None) -> dict[int, int]:
        """{packed row of a placeholder input: its row in `previous`'s sampled ids}. A request has at most
        one unknown input, its last token, sampled by the step launched just before."""
        sources, row = {}, 0
        for chunk in step.chunks:
            request = chunk.request
            end = chunk.start + chunk.num_tokens
            if end > request.num_known_tokens:
                if previous is None or request not in previous.row_of or end - request.num_known_tokens != 1:
                    raise RuntimeError(f"request {request.request_id}: inputs up to {end} scheduled, but only "
                                       f"{request.num_known_tokens} are known and the step before did not sample it")
                sources[row + chunk.num_tokens - 1] = previous.row_of[request]
            row += chunk.num_tokens + len(chunk.draft_token_ids)
        return sources

    def fits_static(self, step: SchedulerOutput) -> bool:
        """A decode-only step (one sampling token per request) the static runner takes as host lists."""
        runner = self.static_decode
        return (runner is not None and self.ngram_store is None and 0 < len(step.chunks) <= runner.max_batch
                and all(c.num_tokens == 1 and not c.draft_token_ids and c.samples and c.request.mrope is None
                        for c in step.chunks))

    def _stage_static(self, step: SchedulerOutput, sources: dict[int, int], previous: LaunchedStep | None):
        chunks: list[ScheduledChunk] = step.chunks
        positions = [c.start for c in chunks]
        static = self.static_decode
        staged = static.stage_decode(
            [c.request.token_slice(p, p + 1)[0] for c, p in zip(chunks, positions, strict=True)], positions,
            [c.request.state_slot for c in chunks], [c.request.block_ids for c in chunks],
            [sources.get(row, -1) for row in range(len(chunks))] if sources else None,
        )
        if sources:  # read after the other inputs are queued (a pipeline's rank 0 waits for them at the read)
            tokens = previous.pending.tokens
            static.previous_tokens[: tokens.shape[0]].copy_(tokens)
        return staged

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
        images = any(c.request.mrope is not None for c in step.chunks)
        batch = ForwardBatch.build(
            [c.request.token_slice(c.start, c.start + c.num_tokens) + c.draft_token_ids for c in step.chunks],
            [c.start for c in step.chunks],
            [c.request.state_slot for c in step.chunks],
            [c.request.block_ids for c in step.chunks],
            self.cache.block_size,
            device=device or self.device,
            logits=rows,
            mrope=[c.request.mrope for c in step.chunks] if images else None,
            compress_ratio=self.cache.config.indexer_compress_ratio or 1,
        )
        if images:
            self._add_image_features(step, batch)
        if self.ngram_store is not None:
            batch.ple_embeddings = self._ple_embeddings(step)
        return batch, wanted

    def _add_image_features(self, step: SchedulerOutput, batch: ForwardBatch) -> None:
        """The features of the image rows the step's chunks reach (the vision tower runs on an image at
        the first chunk that reaches it: engine/images.py), into the batch."""
        pieces, row = [], 0
        for chunk in step.chunks:
            request = chunk.request
            if request.images:
                pieces += chunk_image_rows(self.model, request, chunk.start, chunk.start + chunk.num_tokens, row,
                                           self.encoder_cache)
            row += chunk.num_tokens + len(chunk.draft_token_ids)
        if pieces:
            batch.image_features = torch.cat([features for features, _ in pieces])
            batch.image_rows = on_device([r for _, rows in pieces for r in rows], batch.token_ids.device)

    def sample(self, wanted: list[tuple], logits: torch.Tensor) -> StepResult:
        """Sample (and record log-probabilities) from the logits rows `prepare` asked for, on their device
        (only the sampled ids and requested log-probabilities come back to the host)."""
        return self.finish(self.launch_sampling(wanted, logits))

    def launch_sampling(self, wanted: list[tuple], logits: torch.Tensor) -> LaunchedStep:
        """`sample` without the read back: queued, for `finish` to read (a pipeline's last rank launches
        the next step first)."""
        return self._launch_sampling(None, wanted, logits)

    def _launch_sampling(self, step, wanted: list[tuple], logits: torch.Tensor,
                         previous: LaunchedStep | None = None) -> LaunchedStep:
        """Prompt log-probabilities (read back now), then the sampling rows' pass queued (previous: the step
        in flight, whose sampled ids a penalized request counts as its last output)."""
        result = StepResult()
        samplers: list[tuple[Request, int]] = []  # (request, its sampling row of `logits`)
        for chunk, first, count in wanted:
            request = chunk.request
            try:
                if request.prompt_logprobs is not None and chunk.start < request.num_prompt_tokens - 1:
                    block = logits[first : first + count].float().cpu()
                    self._record_prompt_logprobs(request, chunk.start, block)
            except Exception as exc:  # this request's own part: it fails alone
                logger.exception("prompt logprobs of request %s failed", request.request_id)
                result.failed[request] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
                continue
            if chunk.samples:
                samplers.append((request, first + count - 1))
        requests = [request for request, _ in samplers]
        pending = None
        if samplers:
            picked = [row for _, row in samplers]
            rows = logits[: len(picked)] if picked == list(range(len(picked))) else logits[
                on_device(picked, logits.device)]
            pending = self.sampler.launch(rows, requests, None if previous is None else previous.pending)
        return LaunchedStep(step, requests, pending, result)

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
