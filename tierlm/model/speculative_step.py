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
drafts; the host reads that and nothing else. Padding rows of a fixed-shape batch (scratch slot and
block, position 0) compute harmless garbage there.

A `StaticDecodeRunner` with `greedy_speculation` captures the whole step per prepared shape as one CUDA
graph (mode "eager" runs the same function on the padded batches: the CPU tests' path). Requests with
penalties verify against penalized logits that the host plans (engine/speculative.py): the verify forward
replays alone, the host edits its logits, and `accept_and_draft` replays as a second graph on them.
The draft head's mixer and lm_head run on row a_i of each request only.
"""

from __future__ import annotations

import dataclasses

import torch

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.rotary import Rope
from tierlm.model.model_cache import ModelCache


class GreedySpeculation:
    def __init__(self, model, cache: ModelCache, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if getattr(model, "mtp", None) is None:
            raise ValueError("greedy speculation needs the model's MTP draft head (load_model(..., load_mtp=True))")
        self.model, self.cache, self.k = model, cache, num_speculative_tokens

    def __call__(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The whole step on a verification batch of 1 + K rows per request: [B, 2 + K] (see the module)."""
        # one set of rotary tables for the verify forward and the draft head's pass over the same rows
        rope = Rope(self.model.model.rotary, batch, cache.dtype)
        logits, streams = self.model.forward_with_streams(batch, cache, rope)
        return self.accept_and_draft(batch, logits, streams, rope)

    def accept_and_draft(
        self, batch: ForwardBatch, scores: torch.Tensor, streams: torch.Tensor, rope: Rope | None = None,
    ) -> torch.Tensor:
        """After the verify forward: scores [B (1+K), V] (logits, or the penalized logits greedy decoding
        takes the argmax of), streams [B (1+K), hc*H] the target's -> [B, 2 + K]: accepted count a, token
        after them, next drafts. The request's state (target and draft head) is then in `verify_slots[i, a]`:
        nothing is copied back (the host makes that slot the request's, see the module)."""
        k, width = self.k, 1 + self.k
        n = batch.verify_slots.shape[0]
        best = scores.view(n, width, -1).argmax(dim=-1)  # [n, 1+K]
        drafts = batch.token_ids.view(n, width)[:, 1:]  # row 0 holds the last token, then the drafts
        accepted = (drafts == best[:, :k]).cumprod(dim=1).sum(dim=1)  # [n]
        final = best.gather(1, accepted[:, None])  # [n, 1]
        # row j's next token: draft j+1 (= its argmax) while j < a, the final token (its argmax) at a; the
        # rows past a are overwritten before anything reads them, so every row takes its own argmax
        at = torch.arange(0, n * width, width, device=accepted.device) + accepted  # row a of each request
        rows_a = dataclasses.replace(batch, token_ids=best.flatten(), logits_rows=at, logits_every_row=False)
        logits, out_streams = self.model.draft(rows_a, streams, self.cache, 0, rope)
        proposed = [logits.argmax(dim=-1)]
        if k > 1:
            proposed += self._draft_steps(batch, accepted, proposed[0], out_streams)
        return torch.cat([accepted[:, None], final, *(t[:, None] for t in proposed)], dim=1)

    def _draft_steps(
        self, batch: ForwardBatch, accepted: torch.Tensor, first: torch.Tensor, streams: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Drafts 2..K: single-row draft-head steps at positions start + a + s (known on the device only),
        on a copy of the head's rings after row a in another of the request's row slots
        (`verify_slots[i, (a + 1) % (1 + K)]`, not the one the request keeps)."""
        n, width, cache = batch.verify_slots.shape[0], 1 + self.k, self.cache
        block_size = cache.block_size
        kept = batch.verify_slots.gather(1, torch.stack([accepted, (accepted + 1) % width], dim=1))  # [n, 2]
        step_slots = kept[:, 1]
        for state in cache.draft_slot_states:
            state.copy_slots(kept[:, 0], step_slots)
        # every step's positions [K-1, n] and K/V rows at once (a padding row's table ends after its first
        # block: the scheduler reserves a real request's)
        steps = torch.arange(1, self.k, device=accepted.device)[:, None]
        positions = batch.positions.view(n, width)[:, 0] + accepted + steps
        blocks = batch.block_tables.gather(1, (positions // block_size).T).T
        kv_rows = torch.where(blocks < 0, cache.scratch_block, blocks) * block_size + positions % block_size
        rows = torch.arange(n, device=accepted.device)
        tokens, proposed = first, []
        for s in range(1, self.k):
            step_batch = ForwardBatch(
                token_ids=tokens, positions=positions[s - 1], context_lens=[0] * n, query_lens=[1] * n,
                state_slots=[cache.scratch_slot] * n, block_tables=batch.block_tables,
                slot_mapping=kv_rows[s - 1], logits_rows=rows, logits_every_row=True, slots=step_slots,
                context_lens_tensor=positions[s - 1], static=True)
            logits, streams = self.model.draft(step_batch, streams, cache, s)
            tokens = logits.argmax(dim=-1)
            proposed.append(tokens)
        return proposed
