"""A greedy speculative decoding step as device work only: verify, accept, draft (no rollback copy).

Every request of the batch is greedy and verifies K drafts (1 + K rows: its last token, then the drafts,
`ForwardBatch.verify_slots` naming the slots that keep the state after each row). `GreedySpeculation`
runs, with no host decision in between:
- the target's forward over every row (`forward_with_streams`: logits and streams);
- acceptance: request i accepts a_i drafts, those matching the argmax of the rows before them, and its
  token after them is the argmax of row a_i;
- no rollback: the verify forward left the target's state after row a_i in `verify_slots[i, a_i]` (the
  request's own slot when a_i = K), and that slot becomes the request's (the host, reading a_i, moves the
  request's state slot there; its other row slots serve the next step: engine/speculative.py);
- the draft head's pass over all 1 + K rows, each row's token its own argmax (row j < a_i: draft j+1,
  which equals it; row a_i: the final token; the rows past a_i write K/V and indexer keys at positions the
  next forwards overwrite before anything reads them, as rejected verify rows do, and their rings into row
  slots the request does not keep), its first draft taken at row a_i, its indexer rings after each row
  into `verify_slots` as the target's states (so the head's rings after row a_i are in the kept slot too);
- drafts 2..K: single-row draft-head steps at positions start + a_i + s, on a copy of the head's rings
  in another row slot of the request (so the next step's pass starts from the rings after the kept rows).
It returns one int64 tensor [B, 2 + K] per step: a_i, the token after the accepted drafts, the K new
drafts; the host reads that and nothing else. Given the fixed-shape runner's input buffers (`following`),
it ends by writing there the inputs of the step after it, from its own outcome (overlap scheduling chains
that step before the host has read this one). Padding rows of a fixed-shape batch (scratch slot and
block, position 0) compute harmless garbage there. The index work between the forwards (acceptance, the
draft steps' positions and K/V rows, the readback and the chained inputs) is one launch each on CUDA
(kernels/speculative_step: ~30 small torch ops at K = 1 before; TIERLM_NO_FUSED_SPECULATIVE_STEP=1 runs
those instead).

A `StaticDecodeRunner` with `greedy_speculation` captures the whole step per prepared shape as one CUDA
graph (mode "eager" runs the same function on the padded batches: the CPU tests' path). Requests with
penalties verify against penalized logits that the host plans (engine/speculative.py): the verify forward
replays alone, the host edits its logits and takes their argmax, and `accept_and_draft` replays as a
second graph on those.
The draft head's layer past its attention (`MultiTokenPredictor.forward`), its mixer and lm_head run on
row a_i of each request only.

`OracleSpeculation`: the same step drafting a known continuation instead of the head's proposals (forced
acceptance on the device, for benchmarks and tests: steps chained by overlap scheduling verify drafts no
host code sets).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tierlm.kernels.speculative_step import naive
from tierlm.kernels.speculative_step.naive import Accepted, NextInputs
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.rotary import Rope
from tierlm.model.model_cache import ModelCache


def step_kernels(like: torch.Tensor):
    """kernels/speculative_step's form for tensors like `like`: one Triton launch each on CUDA
    (TIERLM_NO_FUSED_SPECULATIVE_STEP=1: the torch reference there too), the torch reference elsewhere."""
    if like.is_cuda and not os.environ.get("TIERLM_NO_FUSED_SPECULATIVE_STEP"):
        from tierlm.kernels.speculative_step import triton as kernels

        return kernels
    return naive


class GreedySpeculation:
    def __init__(self, model, cache: ModelCache, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if getattr(model, "mtp", None) is None:
            raise ValueError("greedy speculation needs the model's MTP draft head (load_model(..., load_mtp=True))")
        self.model, self.cache, self.k = model, cache, num_speculative_tokens

    def __call__(self, batch: ForwardBatch, cache: ModelCache, following: NextInputs | None = None) -> torch.Tensor:
        """The whole step on a verification batch of 1 + K rows per request: [B, 2 + K] (see the module);
        following: the buffers the step after it reads, rewritten at the end (`accept_and_draft`)."""
        # one set of rotary tables for the verify forward and the draft head's pass over the same rows
        rope = Rope(self.model.model.rotary, batch, cache.dtype)
        logits, streams = self.model.forward_with_streams(batch, cache, rope)
        best = logits.view(batch.verify_slots.shape[0], 1 + self.k, -1).argmax(dim=-1)
        return self.accept_and_draft(batch, best, streams, rope, following)

    def accept_and_draft(
        self, batch: ForwardBatch, best: torch.Tensor, streams: torch.Tensor, rope: Rope | None = None,
        following: NextInputs | None = None,
    ) -> torch.Tensor:
        """After the verify forward: best [B, 1+K] each verify row's argmax (of its logits, or of the
        penalized logits greedy decoding takes it from), streams [B (1+K), hc*H] the target's -> [B, 2 + K]:
        accepted count a, token after them, next drafts. The request's state (target and draft head) is then
        in `verify_slots[i, a]`: nothing is copied back (the host makes that slot the request's, see the
        module). following: a fixed-shape runner's input buffers, which then hold the chained step's inputs."""
        k, n = self.k, best.shape[0]
        kernels = step_kernels(best)
        readback = torch.empty(n, 2 + k, dtype=torch.int64, device=best.device)
        accepted = kernels.accept_drafts(best, batch.token_ids, batch.positions, batch.verify_slots,
                                         batch.block_tables, self.cache.block_size, self.cache.scratch_block,
                                         readback)
        # row j's next token: draft j+1 (= its argmax) while j < a, the final token (its argmax) at a; the
        # rows past a are overwritten before anything reads them, so every row takes its own argmax
        rows_a = dataclasses.replace(batch, token_ids=best.flatten(), logits_rows=accepted.rows,
                                     logits_every_row=False)
        logits, out_streams = self.model.draft(rows_a, streams, self.cache, 0, rope)
        drafts = torch.empty(k, n, dtype=torch.int64, device=best.device)
        torch.argmax(logits, dim=-1, out=drafts[0])
        if k > 1:
            self._draft_steps(batch, accepted, drafts, out_streams)
        kernels.finish_step(readback, self.drafted(batch, readback, drafts), following)
        return readback

    def drafted(self, batch: ForwardBatch, readback: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The next drafts [K, B] the step reports (and chains on): the head's."""
        return drafts

    def _draft_steps(self, batch: ForwardBatch, accepted: Accepted, drafts: torch.Tensor, streams: torch.Tensor,
                     ) -> None:
        """Drafts 2..K into drafts[1:]: single-row draft-head steps at positions start + a + s (known on the
        device only: `accepted.step_positions`), on a copy of the head's rings after row a in another of the
        request's row slots (`verify_slots[i, (a + 1) % (1 + K)]`, not the one the request keeps)."""
        n, cache = drafts.shape[1], self.cache
        for state in cache.draft_slot_states:
            state.copy_slots(accepted.kept_slots, accepted.step_slots)
        rows = batch.logits_rows[:n]  # 0..n-1: the verify batch wants every row's logits
        for s in range(1, self.k):
            positions = accepted.step_positions[s - 1]
            step_batch = ForwardBatch(
                token_ids=drafts[s - 1], positions=positions, context_lens=[0] * n, query_lens=[1] * n,
                state_slots=[cache.scratch_slot] * n, block_tables=batch.block_tables,
                slot_mapping=accepted.step_kv_rows[s - 1], logits_rows=rows, logits_every_row=True,
                slots=accepted.step_slots, context_lens_tensor=positions, static=True)
            logits, streams = self.model.draft(step_batch, streams, cache, s)
            torch.argmax(logits, dim=-1, out=drafts[s])


ORACLE_MAX_POSITIONS = 1 << 16  # the positions an `OracleSpeculation` can be told a token for


class OracleSpeculation(GreedySpeculation):
    """`GreedySpeculation` whose drafts come from a known token sequence per request instead of the draft head
    (forced acceptance, on the device, so steps chained by overlap scheduling verify them too: benchmarks
    and tests). `know(home_slot, token_ids)`: the request in that home slot (its smallest row slot) will be
    drafted token_ids[p] for position p; wrong: the draft at that index of every step whose first accepted
    position is odd is made wrong (partial runs). Tokens past the known ones (or past ORACLE_MAX_POSITIONS)
    are drafted as 0."""

    def __init__(self, model, cache: ModelCache, num_speculative_tokens: int) -> None:
        super().__init__(model, cache, num_speculative_tokens)
        width = min(cache.num_blocks * cache.block_size, ORACLE_MAX_POSITIONS) + 2 * num_speculative_tokens + 2
        self.tokens = torch.zeros(cache.scratch_slot + 1, width, dtype=torch.int64, device=cache.device)
        self.vocab_size = cache.config.vocab_size
        self.wrong: int | None = None

    def know(self, home_slot: int, token_ids: list[int]) -> None:
        known = token_ids[: self.tokens.shape[1]]
        self.tokens[home_slot].zero_()
        self.tokens[home_slot, : len(known)] = torch.tensor(known, device=self.tokens.device)

    def drafted(self, batch, readback, drafts):
        n, width = readback.shape[0], 1 + self.k
        first = batch.positions.view(n, width)[:, 0] + readback[:, 0] + 2  # the first new draft's position
        positions = (first[:, None] + torch.arange(self.k, device=readback.device)).clamp(max=self.tokens.shape[1] - 1)
        known = self.tokens[batch.verify_slots.min(dim=1).values[:, None], positions]  # [n, K]
        if self.wrong is not None:
            column = known[:, self.wrong]
            known[:, self.wrong] = torch.where(first % 2 == 1, (column + 1) % self.vocab_size, column)
        return known.T
