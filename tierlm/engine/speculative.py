"""MTP speculative decoding in the step loop: the draft head proposes, one target forward verifies, rejected
positions are rolled back exactly.

`--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'` (vLLM's flag). Each step:
- The scheduler gives a decoding request that has drafts a chunk of its last token plus its K drafts
  (`ScheduledChunk.draft_token_ids`), and reserves blocks for K more positions past them (the draft head
  writes its own K/V there while proposing).
- Per-position states (as vLLM / SGLang do for hybrid models): a verify chunk's batch names, for its rows
  but the last, K "position slots" of the request (`ForwardBatch.position_slots`); the layers with
  per-request state (GDN conv window and recurrent state, PLE conv history, n-gram context, QSA indexer
  ring) write the state after each row there, the state after the last row going to the request's slot
  as always. The recurrent states are not addressed by position: this is what makes a rejection cheap.
- One target forward (`forward_with_streams`) over the step's chunks (replayed from a CUDA graph when
  every request verifies K drafts: `StaticDecodeRunner` with 1+K rows per request); the 1+K rows of a
  verify chunk are checked by `rejection_sample` (greedy: accept while the draft is the argmax; the first
  mismatch's argmax, or the bonus row's, follows; sampled: the target's distribution as `Sampler` draws
  from it, `sampling_probs`, against the draft's, so the output follows the target distribution exactly).
- Roll back: a request that rejected a draft gets the position slot of its last accepted row copied into
  its slot (one slot copy per rejecting request, batched; no recompute, no snapshot beforehand); a greedy
  step on the device copies nothing: the kept row's slot becomes the request's state slot (a request owns
  K + 1 slots, `row_slot_group`: the one its state is in, and K position slots, the others). The QSA
  K/V and indexer keys are addressed by position: what the rejected rows wrote is overwritten by the next
  forward there, and never read before (attention sees positions before its own only; a block key is
  rewritten when its block closes again, before any query can see it). The cost is memory: K more slots
  per running request (the plan counts them; ~115 MB each in the target model). On CPU (bench/spec_decode.py,
  demo tiny, one thread, nothing accepted) the snapshot + recompute this replaced cost 36-38 ms/token where
  this costs 23 ms (no MTP: 15 ms); K=3: 47-52 vs 36-43 ms.
- Drafting: the head runs on every row the target kept (prefill chunks too, so its caches cover every
  position), row t with token t+1 and the target's streams at t; the last row of a chunk that sampled
  proposes draft 1, then K-1 single-row steps feed the head its own output streams. A greedy request's
  draft is the argmax; a sampled one's a draw from the draft logits under the request's temperature,
  top-k/p and min-p, from the request's own generator (a seeded request is reproducible), its
  distribution kept for verification (`Request.draft_probs`). The K-1 single-row steps work on a copy of
  the head's indexer rings in the request's first position slot, so the next step's draft pass starts
  from the rings after the kept rows.
- On the device: a step where every request is greedy and verifies K drafts, with every forward prepared
  at a fixed shape (the common case under CUDA graphs), takes no host decision (`_greedy_step`): the
  verify forward, acceptance, the draft head's pass (always over all 1+K rows, its rings after each row
  kept in the row's slot as the target's states) and its K-1 steps are one `GreedySpeculation` (model/
  speculative_step.py), replayed as one CUDA graph per prepared shape; the host stages the inputs in one
  copy and reads one small tensor (accepted counts, tokens, next drafts) per step. Penalized requests: the
  verify replays alone, the host-planned penalty edit runs on its logits, and the rest replays as a second
  graph on them. Same tokens as the general path (tests pin it). CPU, demo tiny, K=1
  (bench/spec_host_cost.py): 32 launches per step (29 ops around 3 replays) -> 3 (the staging copy, one
  replay, the read), host 1.09 -> 0.39 ms per step; K=3: 69 -> 3; repetition_penalty 1.05: 52 -> 25.
- Overlap scheduling (vLLM's async scheduling with drafts, SGLang's overlap scheduler): a greedy step on
  the device without penalties (`overlaps`) is left in flight (`launch_greedy`: its readback copied to
  pinned host memory behind it). The engine's next step launches the step after it before reading it
  (`launch_chained`) when the same requests are all that run and each has room (engine/llm_engine.py
  `_chains`): everything that depends on the unread outcome (the bonus token, the K new drafts, the
  positions start + 1 + a, the state slot the kept row's state is in and the order of the other row slots,
  the K/V rows) is made on the device by the step before, at the end of its graph
  (`StaticDecodeRunner._greedy_step`; the K/V rows at the start of each greedy graph from the block table);
  the host sends only the block-table entries it reserved for the worst case (every draft accepted: K + 1
  tokens, then a full step and the draft head's K positions). Reading a step back (`finish_greedy`) applies
  it as a serial step is applied and hands its drafts to the chained step as the ones that step verifies;
  a request finished on that read (EOS, a stop id or string, max_tokens inside accepted drafts) or aborted
  since has the chained step's tokens dropped when that step is read. Anything else (a prefill chunk,
  mixed widths, penalties, sampling, a request waiting to be admitted, too little room) reads the step in
  flight back first and then runs serially, as before. Same tokens either way (tests/test_speculative.py).
  A block boundary the step in flight may reach gets its prefix-cache checkpoint from the row slot that
  would hold it, saved before the chained step is queued and kept on read-back if that row was accepted
  (`CacheManager.save_ahead` / `settle_ahead`). CPU, demo tiny, one thread (bench/spec_host_cost.py,
  loaded machine): host work per greedy step 0.38-0.48 ms serial, all of it between two device steps;
  0.26-0.37 ms with overlap, done while the next step runs (the H200's K=1 step is 0.77 ms of GPU).
  The chained step's inputs, the acceptance and the readback are three launches on CUDA, one Triton
  kernel each (kernels/speculative_step; ~30 torch ops at K = 1 before). A launched step's readback is
  copied into one of two pinned host buffers, used in turn with an event each (engine/readbacks.py): at
  most two greedy steps are unread at a time (the one in flight and the one chained after it).
  Left to do: a step where a request finishes or one is admitted reads back before scheduling (one
  serial step, then the chain restarts);
  penalized, sampled and grammar requests stay serial (verification needs the drafts or output ids on
  the host; a grammar's masks, its matcher).
Which requests speculate: those with nothing but temperature, top-k/p, min-p, the repetition,
frequency and presence penalties and a grammar shaping their distribution (no biases, bans, allowed ids,
min_tokens, log-probabilities); the others decode one token per step in the same batches, unchanged. A
penalized request's verify row j is penalized as the sampler would penalize it once the output had grown
by drafts 1..j (engine/speculative_constraints.py `penalized_logits`: the sampler's own `plan_rows` / `edit_logits`, the drafts before each
row appended to the output ids it counts), so greedy and sampled rows verify against exactly the
distribution decoding without drafts samples from; the drafts themselves are proposed unpenalized (any
proposal is exact; penalties only move acceptance).
Grammars (structured output: json_schema, json_object, structural tags; `GrammarState`, xgrammar's
matcher): a grammar request speculates on the general path (`_on_device` leaves it out: no mask inside
the greedy graph; so overlap scheduling too). Its drafts are proposed under the grammar: the matcher is
walked past the step's own tokens (accepted drafts, the token after them), each draft picked from the
head's logits masked by the matcher's bitmask (argmax, or a draw from the masked draft distribution,
which is the q verification takes) and accepted into the matcher; a draft that ends the grammar is the
last, one it refuses ends the list; then the matcher is rolled back (`GrammarState.rollback`) to the
request's output (`speculative_constraints.GrammarWalk`). Verification masks verify row j by the matcher after exactly the
drafts this step verifies before it (`grammar_bitmask`: walked over the chunk's drafts, rolled back),
after the row's penalties (the sampler's order), so greedy rows take the sampler's masked argmax and
sampled rows verify against the sampler's masked distribution (`sampling_probs`): a draft the grammar
forbids has p = 0 there and is never accepted. The engine then appends the accepted drafts and the token
after them, advancing the matcher as for any sampled token: it ends exactly at the accepted output.
(The seed's vLLM answered HTTP 500 with MTP, grammars and 2+ running requests: its masks were built from other
drafts than the ones verified.) Steps that mix widths (a prefill chunk,
a request with fewer drafts or none) run eagerly, the layers then keeping the per-position states request
by request. A decode step that carries no drafts at all (a request's last token, requests that do not
speculate) replays the plain decode graphs as without speculation: the `ModelRunner`'s static runner,
prepared `with_streams` (the draft head reads its rows) and captured in the verify graphs' memory pool. The draft head's forwards replay CUDA graphs too (`static_drafts`) where every request has
one row (the K-1 draft steps; the pass over the kept rows when no draft was accepted) or 1+K rows (the
pass when every draft was accepted: it then runs as a verification-shaped batch, the head's indexer
rings kept per row like the target's, and its logits taken at each request's last row).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.model_runner import ModelRunner, StepResult
from tierlm.engine.readbacks import Readbacks
from tierlm.engine.rejection_sampler import rejection_sample
from tierlm.engine.request import PLACEHOLDER, Request
from tierlm.engine.sampling_pass import sampling_probs
from tierlm.engine.sampling_plan import MIN_TEMPERATURE
from tierlm.engine.scheduler import ScheduledChunk, SchedulerOutput
from tierlm.engine.speculative_constraints import (
    GrammarWalk,
    grammar_masked,
    penalized_logits,
    verify_logits,
    verify_rows,
)
from tierlm.model.checkpoint_layout import MTPLayout
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.static_decode import StaticDecodeRunner
from tierlm.model.static_slot_copy import StaticSlotCopy

logger = logging.getLogger("tierlm")

METHODS = ("mtp",)
LOG_INTERVAL_S = 30.0  # the acceptance log line, at most this often


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # "speculative_token_map" (SGLang's FR-Spec option): the draft head proposes from these tokens only
    # (`MultiTokenPredictor.restrict_vocab`); None: the whole vocabulary
    draft_token_ids: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """vLLM's `--speculative-config` (a JSON object, or a dict from Python) -> the config; None: off."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config: not JSON ({exc}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config: expected a JSON object, got {value!r}")  # noqa: TRY004 (bad input)
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", "speculative_token_map"})
        if unknown:
            raise ValueError(f"--speculative-config: unsupported field(s) {unknown} (supported: method, "
                             "num_speculative_tokens, speculative_token_map)")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        token_map = value.get("speculative_token_map")
        return cls(method, k, None if token_map is None else read_token_map(token_map))

    def head_layout(self, mtp: MTPLayout) -> MTPLayout:
        """`mtp` with the head rows this config's token map copies at load (`MTPLayout.draft_vocab_rows`)."""
        return dataclasses.replace(mtp, draft_vocab_rows=len(self.draft_token_ids or ()))

    def restrict_draft_vocab(self, model) -> None:
        """With a speculative_token_map, the model's draft head (where this process holds it) proposes
        from those tokens only."""
        if self.draft_token_ids is not None and getattr(model, "mtp", None) is not None:
            model.mtp.restrict_vocab(torch.tensor(self.draft_token_ids), model.lm_head)


def draft_vocab_line(config: SpeculativeConfig, vocab_size: int) -> str:
    """What the start-up line says the drafts are proposed from."""
    if config.draft_token_ids is None:
        return f"the whole vocabulary of {vocab_size:,}"
    return f"{len(config.draft_token_ids):,} of {vocab_size:,} tokens (speculative_token_map)"


def read_token_map(path) -> tuple[int, ...]:
    """A speculative token map file: a JSON list of token ids (what `tierlm draft-vocab` writes), or a
    .pt file holding a 1-D integer tensor (SGLang's / FR-Spec's form, read with weights_only)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"--speculative-config: speculative_token_map must be a file path, got {path!r}")
    try:
        if path.endswith(".pt"):
            ids = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
                raise ValueError("expected a 1-D integer tensor")
            ids = ids.tolist()
        else:
            with open(path) as f:
                ids = json.load(f)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"--speculative-config: speculative_token_map {path}: {exc}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"--speculative-config: speculative_token_map {path}: expected a non-empty JSON list of "
                         "token ids (integers)")
    return tuple(ids)


def is_greedy(request: Request) -> bool:
    return request.params.temperature < MIN_TEMPERATURE


def speculates(request: Request) -> bool:
    """Whether the request decodes with drafts: nothing but its temperature, top-k, top-p, min-p,
    penalties and grammar shape the distribution it samples from (greedy: the argmax)."""
    p = request.params
    return (
        p.logprobs is None and p.prompt_logprobs is None and p.min_tokens == 0
        and not p.logit_bias and not p.bad_words and p.allowed_token_ids is None
    )


@dataclass
class LaunchedSpeculation:
    """A greedy speculative step queued on the device (`SpeculativeRunner.launch_greedy` / `launch_chained`),
    its readback [B, 2 + K] copied to `readback` once `ready` has run; `SpeculativeRunner.finish_greedy`
    reads it."""

    step: SchedulerOutput  # its requests, in row order (a chained step's drafts filled in on the step before's read)
    readback: torch.Tensor
    ready: torch.cuda.Event | None  # None: on CPU, copied already

    @property
    def num_tokens(self) -> int:
        return self.step.num_tokens


@dataclass
class _Kept:
    """One chunk after verification: the rows whose state stays, and what the draft head reads there."""

    chunk: ScheduledChunk
    tokens: list[int]  # the kept rows' tokens (the chunk's, then the accepted drafts)
    streams: torch.Tensor  # the target's streams at those rows [rows, hc*H]
    next_token: int | None  # the token after the last kept row (None: the request failed this step)
    proposes: bool  # the chunk sampled: its last row proposes the next drafts


class SpeculativeRunner:
    """A `ModelRunner` step with drafts: the engine calls `execute` as it would the runner's."""

    def __init__(
        self, runner: ModelRunner, config: SpeculativeConfig, position_slot_base: int, seed: int = 0,
        static_verify: StaticDecodeRunner | None = None,
        static_drafts: dict[tuple[int, int], StaticDecodeRunner] | None = None,
    ) -> None:
        """position_slot_base: slot s's K position slots are position_slot_base + s K + j (the cache has those).
        static_verify: a `StaticDecodeRunner` of 1 + K rows per request (CUDA graphs) for the steps where
        every request verifies K drafts; None: every forward eager. Steps without drafts go to `runner`'s
        static runner when it has one (prepared `with_streams`: the draft head reads the rows' streams). static_drafts: (MTP layer, rows per
        request) -> a `StaticDecodeRunner` of the draft head's forwards at fixed shapes (rows per request 1
        and 1+K; see the module docstring)."""
        self.runner = runner
        self.model, self.cache = runner.model, runner.cache
        self.config = config
        self.k = config.num_speculative_tokens
        self.position_slot_base = position_slot_base
        self.static_verify, self.static_drafts = static_verify, static_drafts or {}
        # the rollback's slot copies at fixed batch sizes (one graph replay on a GPU) beside fixed-shape verifies
        self.static_rollback = None if static_verify is None else StaticSlotCopy(
            self.cache.target_slot_states, static_verify.max_batch, self.cache.scratch_slot, self.cache.device,
            "cuda_graph" if static_verify.mode == "cuda_graph" else "eager")
        self._readbacks: Readbacks | None = None  # made at the first greedy launch, for static_verify's batches
        self.generator = torch.Generator(device=self.cache.device).manual_seed(seed)
        self.num_drafts = 0  # verify chunks (requests that carried drafts into a step), total
        self.num_draft_tokens = 0  # drafts verified, total
        self.num_accepted_tokens = 0  # of which accepted, total
        self.accepted_per_position = [0] * self.k  # [j]: verify chunks that accepted their draft j + 1
        self._logged_at, self._logged = time.monotonic(), (0, 0, 0)

    @property
    def trace(self):
        return self.runner.trace

    @trace.setter
    def trace(self, value) -> None:
        self.runner.trace = value

    def execute(self, step: SchedulerOutput) -> StepResult:
        runner = self.runner
        if self._on_device(step):
            return self._greedy_step(step)
        if runner.fits_static(step):  # no drafts, one row per request: the runner's decode graphs (and streams)
            (logits, streams), wanted, _ = runner.run_forward(step)
            verify = []
        else:
            with self.trace.phase("prepare batch"):
                batch, wanted = runner.prepare(step)
                verify = [w for w in wanted if w[0].draft_token_ids]
                if verify:
                    batch = dataclasses.replace(batch, position_slots=self._position_slots(step))
            with self.trace.phase("launch forward"), self.trace.gpu("forward"):
                if self.static_verify is not None and self.static_verify.can_run(batch):
                    logits, streams = self.static_verify.run(batch)
                else:
                    logits, streams = self.model.forward_with_streams(batch, self.cache)
        with self.trace.phase("sample"):
            result = runner.sample([w for w in wanted if not w[0].draft_token_ids], logits)
            accepted = self._verify(verify, logits, result)
        with self.trace.phase("roll back, draft"):
            self._roll_back(verify, accepted)
            self._propose(self._kept(step, streams, accepted, result))
        return result

    def drafts_for(self, request: Request) -> bool:
        """Whether this runner drafts for the request (`speculates`; a pipeline's last rank narrows it)."""
        return speculates(request)

    # ---- the greedy step on the device ------------------------------------------------------------------
    def _on_device(self, step: SchedulerOutput) -> bool:
        """Whether the step runs as `_greedy_step`: every request greedy and verifying K drafts, and the
        verify runner prepared the whole greedy step at a fixed shape (`greedy_speculation`)."""
        k, verify = self.k, self.static_verify
        return (
            verify is not None and verify.greedy is not None and self.runner.ngram_store is None
            and 0 < len(step.chunks) <= verify.max_batch
            and all(len(chunk.draft_token_ids) == k and chunk.num_tokens == 1 and chunk.samples
                    and len(chunk.request.block_ids) <= verify.block_tables.shape[1]
                    and self.drafts_for(chunk.request) and is_greedy(chunk.request)
                    and chunk.request.structured_output is None for chunk in step.chunks)
        )

    def _greedy_step(self, step: SchedulerOutput) -> StepResult:
        """Verify, accept and draft with the host reading one tensor, at the end (then moving each request's
        state slot to its kept row's).

        The inputs go to the verify runner's buffers in one copy (`StaticDecodeRunner.stage_verify`); then
        `GreedySpeculation` (model/speculative_step.py) takes every decision on the device: one graph
        replay of the whole step. Penalized rows are planned by the host (while the verify forward runs):
        the verify replays alone, its logits are penalized, and the rest of the step replays on them. The
        same tokens as `execute`'s general path (tests pin it)."""
        requests = [chunk.request for chunk in step.chunks]
        if not any(request.params.has_penalties for request in requests):
            return self.finish_greedy(self.launch_greedy(step))
        chunks, width = step.chunks, 1 + self.k
        n, verify = len(chunks), self.static_verify
        with self.trace.phase("prepare batch"):
            shape = self._stage(step)
        with self.trace.phase("launch forward"), self.trace.gpu("forward"):
            logits, _ = verify.replay(shape, n * width)  # its streams stay where the rest reads them
        with self.trace.phase("accept, draft"), self.trace.gpu("accept, draft"):
            # penalized rows: the host plans them from the drafts it has (while the device runs the forward)
            drafts = [chunk.draft_token_ids for chunk in chunks]
            best = penalized_logits(logits, *verify_rows(requests, drafts)).argmax(dim=-1)
            readback = verify.replay_accept(shape, n, best)
        with self.trace.phase("read accepted ids"):
            return self._accepted(step, readback.tolist())

    def _stage(self, step: SchedulerOutput) -> tuple[int, int]:
        """A greedy step's inputs into the verify runner's buffers (one copy); the shape to replay."""
        chunks = step.chunks
        shape, _ = self.static_verify.stage_verify(
            [chunk.request.token_slice(chunk.start, chunk.start + 1) + chunk.draft_token_ids for chunk in chunks],
            [chunk.start for chunk in chunks], [chunk.request.state_slot for chunk in chunks],
            [self.row_slots(chunk.request) for chunk in chunks], [chunk.request.block_ids for chunk in chunks])
        return shape

    def row_slots(self, request: Request) -> list[int]:
        """The slots keeping the state after each verify row: its K position slots (row j's, j < K), then
        its state slot. They are the slots of its group (`row_slot_group`) after its state slot, in turn
        (the group taken as a ring), so a greedy step that keeps row a's state moves the ring by a + 1
        (the greedy graph does it on the device: `StaticDecodeRunner._greedy_step`)."""
        group = row_slot_group(request.home_slot, self.position_slot_base, self.k)
        at = group.index(request.state_slot) + 1
        return group[at:] + group[:at]

    def _position_slots(self, step: SchedulerOutput) -> list[list[int]]:
        """Each chunk's position slots: those of its rows before the last (one per draft it verifies)."""
        return [self.row_slots(chunk.request)[: len(chunk.draft_token_ids)] for chunk in step.chunks]

    # ---- overlap scheduling: greedy steps launched before the one before them is read -------------------
    def overlaps(self, step: SchedulerOutput) -> bool:
        """Whether the step can be left in flight (`launch_greedy`): a greedy step on the device whose
        requests have no penalties (their verify rows need the drafts on the host)."""
        return self._on_device(step) and not any(chunk.request.params.has_penalties for chunk in step.chunks)

    def launch_greedy(self, step: SchedulerOutput) -> LaunchedSpeculation:
        """Queue a greedy step (`overlaps`) on the device, and the copy of its readback to the host."""
        with self.trace.phase("prepare batch"):
            shape = self._stage(step)
        return self._launch(step, shape)

    def launch_chained(self, previous: LaunchedSpeculation) -> LaunchedSpeculation:
        """Queue the greedy step after `previous` (not read back yet) for the same requests, its inputs made
        on the device by `previous` (`StaticDecodeRunner._greedy_step`): the host sends only the block-table
        entries that changed; the caller reserved blocks for every accepted count (see the module). The
        step's drafts are known when `previous` is read back (`finish_greedy` fills them in)."""
        requests = [chunk.request for chunk in previous.step.chunks]
        with self.trace.phase("prepare batch"):
            shape = self.static_verify.stage_chained([request.block_ids for request in requests])
        step = SchedulerOutput([ScheduledChunk(request, 1, [PLACEHOLDER] * self.k) for request in requests])
        return self._launch(step, shape)

    def _launch(self, step: SchedulerOutput, shape: tuple[int, int]) -> LaunchedSpeculation:
        n = len(step.chunks)
        # the device span is "forward" as a plain decode step's is: "between forwards" is then the time
        # the device waits for the host between steps, with or without drafts
        if self._readbacks is None or self._readbacks.max_batch < self.static_verify.max_batch:
            self._readbacks = Readbacks(self.static_verify.max_batch, 2 + self.k, self.cache.device)
        with self.trace.phase("launch forward"), self.trace.gpu("forward"):
            # the device buffer is the next replay's: copied out in order
            host, ready = self._readbacks.copy(self.static_verify.replay_greedy(shape, n))
        return LaunchedSpeculation(step, host, ready)

    def finish_greedy(self, launched: LaunchedSpeculation, following: LaunchedSpeculation | None = None
                      ) -> StepResult:
        """A launched greedy step read back (waits for it): accepted drafts and the token after them, each
        request's state slot moved to its kept row's, its new drafts; `following` (the step chained after
        it, in flight) gets those drafts as the ones it verifies. Requests finished since (aborted, or
        stopped by the step before) are left out."""
        with self.trace.phase("read accepted ids"):
            if launched.ready is not None:
                launched.ready.synchronize()
            return self._accepted(launched.step, launched.readback.tolist(), following)

    def _accepted(self, step: SchedulerOutput, readback: list[list[int]], following: LaunchedSpeculation | None = None
                  ) -> StepResult:
        """A greedy step's readback rows (accepted count, token after them, next drafts) into its requests
        and a `StepResult`."""
        result = StepResult()
        next_chunks = following.step.chunks if following is not None else [None] * len(step.chunks)
        counted = []  # accepted counts of the requests still running
        for chunk, after, (count, token, *new_drafts) in zip(step.chunks, next_chunks, readback, strict=True):
            request = chunk.request
            if request.is_finished:
                continue
            request.state_slot = self.row_slots(request)[count]  # the state after its last kept row: no copy
            result.accepted[request] = chunk.draft_token_ids[:count]
            result.sampled[request] = token
            request.draft_token_ids, request.draft_probs = new_drafts, None
            if after is not None:
                after.draft_token_ids = list(new_drafts)
            counted.append(count)
        self._count([self.k] * len(counted), counted)
        return result

    # ---- verification -------------------------------------------------------------------------------
    def _verify(self, verify: list[tuple], logits: torch.Tensor, result: StepResult) -> dict[ScheduledChunk, int]:
        """Accept drafts of the verify chunks into `result`; returns chunk -> number of drafts accepted."""
        if not verify:
            return {}
        k_max = max(len(chunk.draft_token_ids) for chunk, _, _ in verify)
        vocab, device = logits.shape[1], logits.device
        scores = torch.zeros(len(verify), k_max + 1, vocab, dtype=torch.float32, device=device)
        drafts = torch.zeros(len(verify), k_max, dtype=torch.int64)
        greedy = [is_greedy(chunk.request) for chunk, _, _ in verify]
        draft_probs = None
        if not all(greedy):
            draft_probs = torch.zeros(len(verify), k_max, vocab, dtype=torch.float32, device=device)
        requests = [chunk.request for chunk, _, _ in verify]
        if any(request.params.has_penalties or request.structured_output is not None for request in requests):
            # every verify row, penalized and masked as decoding would after the drafts before it
            index = torch.cat([torch.arange(first, first + count) for _, first, count in verify]).to(device)
            logits = verify_logits(logits[index], requests, [chunk.draft_token_ids for chunk, _, _ in verify])
            starts = np.cumsum([0] + [count for _, _, count in verify])
            verify = [(chunk, int(start), count) for (chunk, _, count), start in zip(verify, starts[:-1], strict=True)]
        # greedy: any scores with the argmax do; sampled: the distribution the request samples from, every
        # sampled chunk's rows in one pass
        sampled = [(i, first, count) for i, (_, first, count) in enumerate(verify) if not greedy[i]]
        if sampled:
            index = torch.cat([torch.arange(first, first + count) for _, first, count in sampled]).to(device)
            targets = list(sampling_probs(logits[index], [verify[i][0].request for i, _, count in sampled
                                                          for _ in range(count)]).split([c for _, _, c in sampled]))
        for i, (chunk, first, count) in enumerate(verify):
            scores[i, :count] = logits[first : first + count].float() if greedy[i] else targets.pop(0)
            drafts[i, : count - 1] = torch.tensor(chunk.draft_token_ids)
            if not greedy[i]:
                draft_probs[i, : count - 1] = chunk.request.draft_probs[: count - 1]
        counts = [len(chunk.draft_token_ids) for chunk, _, _ in verify]
        generators = [None if greedy[i] else chunk.request.device_generator(device)
                      for i, (chunk, _, _) in enumerate(verify)]
        outputs = rejection_sample(scores, drafts, draft_probs, counts, greedy, generators, self.generator)
        accepted = {}
        for (chunk, _, _), tokens in zip(verify, outputs, strict=True):
            accepted[chunk] = len(tokens) - 1
            result.accepted[chunk.request] = tokens[:-1]
            result.sampled[chunk.request] = tokens[-1]
        self._count(counts, list(accepted.values()))
        return accepted

    def _count(self, drafted: list[int], accepted: list[int]) -> None:
        """A step's verify chunks into the counters (vLLM's spec_decode metrics): drafts verified and
        accepted per chunk."""
        self.num_drafts += len(drafted)
        self.num_draft_tokens += sum(drafted)
        self.num_accepted_tokens += sum(accepted)
        for count in accepted:
            for j in range(count):
                self.accepted_per_position[j] += 1
        self._log_acceptance()

    def _log_acceptance(self) -> None:
        """Since the last line: drafts accepted, and tokens per verify step (vLLM's acceptance length)."""
        if time.monotonic() - self._logged_at < LOG_INTERVAL_S:
            return
        verifies, drafted, accepted = (now - then for now, then in zip(
            (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens), self._logged, strict=True))
        logger.info("speculative decoding: %d of %d drafts accepted (%.1f%%), %.2f tokens per verify step",
                    accepted, drafted, 100 * accepted / max(drafted, 1), (accepted + verifies) / max(verifies, 1))
        self._logged_at = time.monotonic()
        self._logged = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def _roll_back(self, verify: list[tuple], accepted: dict[ScheduledChunk, int]) -> None:
        """A request that rejected a draft gets the state its forward kept after its last accepted row (the
        position slots `execute` gave the batch) copied into its slot; K/V and indexer keys need nothing."""
        sources, targets = [], []
        for chunk, _, _ in verify:
            kept = accepted[chunk]
            if kept < len(chunk.draft_token_ids):
                sources.append(self.row_slots(chunk.request)[kept])
                targets.append(chunk.request.state_slot)
        self._restore(sources, targets)

    def _restore(self, sources: list[int], targets: list[int]) -> None:
        """The target's states of slot sources[i] into slot targets[i]: one graph replay where prepared."""
        if not sources:
            return
        if self.static_rollback is not None and len(sources) <= self.static_rollback.max_batch:
            self.static_rollback.copy(sources, targets)
            return
        self.cache.copy_target_states(sources, targets)

    def _kept(
        self, step: SchedulerOutput, streams: torch.Tensor, accepted: dict[ScheduledChunk, int], result: StepResult,
    ) -> list[_Kept]:
        """Every speculating chunk's kept rows (its tokens and the accepted drafts) and their streams."""
        kept, row = [], 0
        for chunk in step.chunks:
            request = chunk.request
            if self.drafts_for(request) and request not in result.failed:
                n = chunk.num_tokens + accepted.get(chunk, 0)
                if chunk.samples:
                    next_token, proposes = result.sampled.get(request), True
                else:
                    next_token, proposes = request.token_slice(chunk.start + n, chunk.start + n + 1)[0], False
                tokens = request.token_slice(chunk.start, chunk.start + chunk.num_tokens) + chunk.draft_token_ids[
                    : n - chunk.num_tokens]
                if next_token is not None:
                    kept.append(_Kept(chunk, tokens, streams[row : row + n], next_token, proposes))
            row += chunk.num_tokens + len(chunk.draft_token_ids)
        return kept

    # ---- drafting -----------------------------------------------------------------------------------
    def _propose(self, kept: list[_Kept]) -> None:
        """Run the draft head over every kept row (its caches); the proposing chunks' next K drafts."""
        if not kept:
            return
        rows, last_rows, row = [], [], 0
        for item in kept:
            rows.append(item.tokens[1:] + [item.next_token])
            row += len(item.tokens)
            if item.proposes:
                last_rows.append(row - 1)
        block_size = self.cache.block_size
        # every request kept all 1+K rows and proposes: a verification-shaped batch, if one is prepared
        width = len(kept[0].tokens)
        shaped = (width > 1 and (0, width) in self.static_drafts
                  and all(len(item.tokens) == width and item.proposes for item in kept))
        batch = ForwardBatch.build(
            rows, [item.chunk.start for item in kept], [item.chunk.request.state_slot for item in kept],
            [item.chunk.request.block_ids for item in kept], block_size, device=self.cache.device,
            logits="all" if shaped else last_rows,
            position_slots=[self.row_slots(item.chunk.request)[: width - 1] for item in kept]
            if shaped else None,
        )
        hidden = torch.cat([item.streams for item in kept])
        logits, out_streams = self._draft(batch, hidden, 0)
        if shaped:
            last = torch.tensor(last_rows, device=logits.device)
            logits, out_streams = logits[last], out_streams[last]
        proposers = [item for item in kept if item.proposes]
        if not proposers:
            return
        requests = [item.chunk.request for item in proposers]
        # grammars: drafts are picked under each matcher's mask, the matcher walked past the step's own tokens
        walk = GrammarWalk(requests, [item.tokens[item.chunk.num_tokens :] + [item.next_token] for item in proposers])
        drafts, draft_probs = [[] for _ in proposers], [[] for _ in proposers]
        first, probs = self._pick(logits, requests)
        for i, (token, row) in enumerate(zip(first, probs, strict=True)):
            if walk.take(i, token):
                drafts[i].append(token)
                draft_probs[i].append(row)
        # draft step s (1..K-1) reads draft s and writes the head's K/V at position start + len(tokens) + s - 1;
        # a request stops drafting where its blocks end (the scheduler reserves K positions past the chunk)
        positions = [item.chunk.start + len(item.tokens) for item in proposers]
        active = list(range(len(proposers)))  # the proposers still drafting; out_streams' rows, in order
        # the draft steps advance the head's indexer rings past the kept rows, which the next step's draft
        # pass starts from: they work on a copy in the request's first position slot
        step_slots = [self.row_slots(request)[0] for request in requests]
        if self.k > 1:
            device = self.cache.device
            for state in self.cache.draft_slot_states:
                state.copy_slots(torch.tensor([r.state_slot for r in requests], device=device),
                                 torch.tensor(step_slots, device=device))
        for s in range(1, self.k):
            live = [j for j, i in enumerate(active) if walk.open[i]
                    and positions[i] + s - 1 < len(proposers[i].chunk.request.block_ids) * block_size]
            if not live:
                break
            if len(live) < len(active):
                out_streams = out_streams.index_select(0, torch.tensor(live, device=out_streams.device))
                active = [active[j] for j in live]
                requests = [requests[j] for j in live]
            step_batch = ForwardBatch.build(
                [[drafts[i][-1]] for i in active], [positions[i] + s - 1 for i in active],
                [step_slots[i] for i in active],
                [proposers[i].chunk.request.block_ids for i in active], block_size, device=self.cache.device,
            )
            logits, out_streams = self._draft(step_batch, out_streams, s)
            tokens, probs = self._pick(logits, requests)
            for i, token, row in zip(active, tokens, probs, strict=True):
                if walk.take(i, token):
                    drafts[i].append(token)
                    draft_probs[i].append(row)
        walk.undo()
        for item, tokens, rows in zip(proposers, drafts, draft_probs, strict=True):
            item.chunk.request.draft_token_ids = tokens
            item.chunk.request.draft_probs = None if not rows or rows[0] is None else torch.stack(rows)

    def _draft(self, batch: ForwardBatch, hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-head forward: replayed at a fixed shape where one is prepared, else eager."""
        width = 1 if batch.verify_slots is None else batch.verify_slots.shape[1]
        runner = self.static_drafts.get((step % len(self.model.mtp.layers), width))
        if runner is not None and runner.can_run(batch):
            return runner.run(batch, hidden)
        return self.model.draft(batch, hidden, self.cache, step)

    def _pick(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's draft: the argmax for a greedy request; for a sampled one a draw from the draft's
        distribution q (the request's temperature, top-k/p, min-p), from its own generator, with q kept for
        verification. A request with a grammar picks under its matcher's current mask."""
        logits = grammar_masked(logits, requests)
        tokens = logits.argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [i for i, request in enumerate(requests) if not is_greedy(request)]
        if sampled:
            device = logits.device
            q = sampling_probs(logits[torch.tensor(sampled, device=device)], [requests[i] for i in sampled])
            for row, i in enumerate(sampled):
                generator = requests[i].device_generator(device) or self.generator
                noise = torch.empty(q.shape[1], dtype=torch.float32, device=generator.device)
                noise = noise.exponential_(generator=generator).to(device)
                tokens[i] = (q[row] / noise).argmax()  # an exponential race: a draw from q
                probs[i] = q[row]
        return tokens.tolist(), probs


def row_slot_group(home_slot: int, position_slot_base: int, k: int) -> list[int]:
    """A request's K + 1 state slots under speculation: the slot the cache manager gave it (home_slot) and
    K more past position_slot_base. Its state is in one of them (`Request.state_slot`), the others keep
    the state after each verified row; a greedy step on the device then takes the kept row's slot as the
    request's (no copy)."""
    return [home_slot, *(position_slot_base + home_slot * k + j for j in range(k))]


def spare_slots_needed(config: SpeculativeConfig | None, max_num_seqs: int) -> int:
    """Extra cache slots for the per-position states of verification (K per running request)."""
    return config.num_speculative_tokens * max_num_seqs if config is not None else 0
