"""MTP speculative decoding under pipeline parallelism: rank 0's step (`PipelineSpeculation`) and the last
rank's (`LastRankDrafts`), as the seed placed them: the draft head on the last rank.

A step (serial: launched and read back before the next one is scheduled):
1. Rank 0 prepares the batch as one process does (a verify chunk's 1 + K rows: its last token and its K
   drafts; every chunk's per-position slots, `ForwardBatch.position_slots`) and sends it to every rank
   with each chunk's `DraftChunk` (drafts, slots, blocks) and the cache operations since the last step
   (`PipelineDriver.run_with_drafts`).
2. Every rank runs its layers on it; a layer with per-request state (GDN, PLE, n-gram context) keeps the
   state after each verify row in that row's position slot, as in one process.
3. The last rank samples the rows without drafts (its mirrors, as any pipeline step), verifies the drafts,
   runs the draft head over every kept row and proposes each request's next K drafts: one process's
   `SpeculativeRunner` code (`_verify`, `_kept`, `_propose`) on its mirrors, whose output ids it keeps
   (accepted drafts too: penalties count them), with their generators and the draft distributions it
   proposed from (sampled requests: rejection sampling, a seeded request's output that of one process
   with drafts), and answers rank 0 on the host: sampled ids, accepted drafts, next drafts (`StageResult`).
4. Rank 0 rolls back a request that rejected a draft: its position slot of the last accepted row copied
   into its state slot, on its own layers now and, recorded as a cache operation
   (`ModelCache.copy_target_states`), on every other rank's before the next step's forward. The accepted
   count thus reaches every rank in the next step's message, before anything reads the state; the draft
   head's caches need no rollback (it only ever runs over kept rows).

The requests that speculate are one process's (`speculative.speculates`), but for structured output (its
bitmask is rank 0's; the verify rows do not carry one yet): those decode one token per step. Not done here
yet: overlap scheduling or micro-batches with drafts (each step is read back before the next is
scheduled), and every rank runs these steps eagerly (no static decode runner, so no CUDA graphs:
`stage_setup.build_stage`).
"""

from __future__ import annotations

import dataclasses

from tierlm.engine.model_runner import StepResult
from tierlm.engine.pipeline import take_answer
from tierlm.engine.pipeline_messages import StageResult, StepMessage
from tierlm.engine.pipeline_worker import _Chunk
from tierlm.engine.scheduler import SchedulerOutput
from tierlm.engine.speculative import SpeculativeRunner


class PipelineSpeculation(SpeculativeRunner):
    """Rank 0's `SpeculativeRunner`: each step through the pipeline (`PipelineDriver.run_with_drafts`); the
    engine calls `execute` as with one process."""

    def __init__(self, driver, config, position_slot_base: int, seed: int = 0) -> None:
        super().__init__(driver.runner, config, position_slot_base, seed)
        self.driver = driver

    def overlaps(self, step: SchedulerOutput) -> bool:
        return False  # every step is read back before the next is scheduled

    def execute(self, step: SchedulerOutput) -> StepResult:
        with self.trace.phase("prepare batch"):
            batch, wanted = self.runner.prepare(step, device="cpu")
            if any(chunk.draft_token_ids for chunk in step.chunks):
                batch = dataclasses.replace(batch, position_slots=self._position_slots(step))
        with self.trace.phase("pipeline step"):
            answer = self.driver.run_with_drafts(step, batch, wanted)
        keys = self.driver.keys  # every chunk's request has one: none is released during a serial step
        result, verify, accepted = StepResult(), [], {}
        for chunk in step.chunks:
            request, key = chunk.request, keys[chunk.request]
            if not take_answer(answer, key, request, result):
                continue
            if chunk.draft_token_ids:
                verify.append((chunk, None, None))
                result.accepted[request] = answer.accepted[key]
                accepted[chunk] = len(answer.accepted[key])
            if chunk.samples:
                request.draft_token_ids = answer.next_drafts.get(key, [])
        self._roll_back(verify, accepted)
        self._count([len(chunk.draft_token_ids) for chunk, _, _ in verify], [accepted[chunk] for chunk, _, _ in verify])
        return result

    def _restore(self, sources: list[int], targets: list[int]) -> None:
        """The rollback's slot copies: on rank 0's layers now, recorded for the other ranks' (`RecordingCache`),
        which replay them before the next step's forward."""
        self.driver.cache.copy_target_states(sources, targets)


class LastRankDrafts(SpeculativeRunner):
    """The last rank's side of a speculative step: sample, verify, draft (see the module docstring)."""

    def drafts_for(self, request) -> bool:
        """A constrained request decodes without drafts under pipeline parallelism: its verify rows would
        need rank 0's bitmask per row, which no message carries, and the mirror's grammar (a bitmask copy,
        `BitmaskGrammar`) cannot walk drafts."""
        return super().drafts_for(request) and request.structured_output is None

    def step(self, mirror, message: StepMessage, batch) -> StageResult:
        """The step's answer to rank 0; `batch` carries the previous stage's output (`stage_input`)."""
        logits, streams = self.model.forward_with_streams(batch, self.cache)
        verifying = {chunk.key for chunk in message.drafts if chunk.draft_token_ids}
        plain = dataclasses.replace(message, samples=[s for s in message.samples if s.key not in verifying])
        out = mirror.finish(self.runner, mirror.launch(self.runner, plain, logits))
        firsts = {spec.key: spec.first for spec in message.samples}
        result, chunks, verify, key_of = StepResult(), [], [], {}
        for sent in message.drafts:
            request = mirror.requests[sent.key]
            key_of[request] = sent.key
            request.state_slot, request.home_slot, request.block_ids = sent.state_slot, sent.home_slot, sent.block_ids
            request.draft_token_ids = []
            chunk = _Chunk(request, sent.start, sent.num_tokens, sent.samples, sent.draft_token_ids)
            chunks.append(chunk)
            if sent.key in out.failed:
                result.failed[request] = out.failed[sent.key]
            elif sent.key in out.sampled:
                result.sampled[request] = out.sampled[sent.key]
            if sent.draft_token_ids:
                verify.append((chunk, firsts[sent.key], 1 + len(sent.draft_token_ids)))
        accepted = self._verify(verify, logits, result)
        for chunk, _, _ in verify:
            request, key = chunk.request, key_of[chunk.request]
            out.accepted[key] = result.accepted[request]
            out.sampled[key] = result.sampled[request]
            request.output_token_ids.extend([*result.accepted[request], result.sampled[request]])
        self._propose(self._kept(SchedulerOutput(chunks), streams, accepted, result))
        for chunk in chunks:
            if chunk.samples and chunk.request.draft_token_ids:
                out.next_drafts[key_of[chunk.request]] = list(chunk.request.draft_token_ids)
        return out

    def _log_acceptance(self) -> None:
        """Rank 0 logs the acceptance (its counters are the engine's)."""
