"""A greedy speculative decoding step as device work only: verify, accept, roll back, draft.

Every request of the batch is greedy and verifies K drafts (1 + K rows: its last token, then the drafts,
`ForwardBatch.verify_slots` naming the slots that keep the state after each row). `GreedySpeculation`
runs, with no host decision in between:
- the target's forward over every row (`forward_with_streams`: logits and streams);
- acceptance: request i accepts a_i drafts, those matching the argmax of the rows before them, and its
  token after them is the argmax of row a_i;
- the rollback: the state after row a_i (`verify_slots[i, a_i]`; the request's own slot when a_i = K, a
  self-copy) into the request's slot, in every per-request state pool of the target (a fixed shape copies
  one slot's state per request every step, rejected or not: what deciding on the host would save when
  every draft is accepted, at the price of a second launch after the read);
- the draft head's pass over all 1 + K rows (row j reads draft j+1 while j < a_i, the final token at row
  a_i; the rows past a_i write K/V and indexer keys at positions the next forwards overwrite before
  anything reads them, as rejected verify rows do), its first draft taken at row a_i, and its indexer
  rings after row a_i restored into the request's slot;
- drafts 2..K: single-row draft-head steps at positions start + a_i + s, on a copy of the head's rings in
  the request's first position slot (so the next step's pass starts from the rings after the kept rows).
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
        logits, streams = self.model.forward_with_streams(batch, cache)
        return self.accept_and_draft(batch, logits, streams)

    def accept_and_draft(self, batch: ForwardBatch, scores: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """After the verify forward: scores [B (1+K), V] (logits, or the penalized logits greedy decoding
        takes the argmax of), streams [B (1+K), hc*H] the target's -> [B, 2 + K]: accepted count, token
        after them, next drafts; the target's states rolled back and the draft head's caches advanced."""
        k, width, cache = self.k, 1 + self.k, self.cache
        n = batch.verify_slots.shape[0]
        best = scores.view(n, width, -1).argmax(dim=-1)  # [n, 1+K]
        drafts = batch.token_ids.view(n, width)[:, 1:]  # row 0 holds the last token, then the drafts
        accepted = (drafts == best[:, :k]).cumprod(dim=1).sum(dim=1)  # [n]
        final = best.gather(1, accepted[:, None])  # [n, 1]
        kept = batch.verify_slots.gather(1, accepted[:, None]).squeeze(1)  # the slot holding the state after row a
        for state in cache.target_slot_states:
            state.copy_slots(kept, batch.slots)
        rows = torch.arange(width, device=accepted.device)
        tokens = torch.where(rows < accepted[:, None], torch.cat([drafts, final], dim=1), final)
        at = torch.arange(0, n * width, width, device=accepted.device) + accepted  # row a of each request
        logits, out_streams = self.model.draft(
            dataclasses.replace(batch, token_ids=tokens.flatten(), logits_rows=at), streams, cache, 0)
        proposed = [logits.argmax(dim=-1)]
        for state in cache.draft_slot_states:  # the head's rings after row a into the request's slot
            state.copy_slots(kept, batch.slots)
        if k > 1:
            proposed += self._draft_steps(batch, accepted, proposed[0], out_streams)
        return torch.cat([accepted[:, None], final, *(t[:, None] for t in proposed)], dim=1)

    def _draft_steps(
        self, batch: ForwardBatch, accepted: torch.Tensor, first: torch.Tensor, streams: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Drafts 2..K: single-row draft-head steps at positions start + a + s (known on the device only),
        on a copy of the head's rings in each request's first position slot."""
        n, cache = batch.verify_slots.shape[0], self.cache
        block_size = cache.block_size
        step_slots = batch.verify_slots[:, 0]
        for state in cache.draft_slot_states:
            state.copy_slots(batch.slots, step_slots)
        start = batch.positions.view(n, 1 + self.k)[:, 0] + accepted
        rows = torch.arange(n, device=accepted.device)
        tokens, proposed = first, []
        for s in range(1, self.k):
            positions = start + s
            blocks = batch.block_tables.gather(1, (positions // block_size)[:, None]).squeeze(1)
            # a padding row's table ends after its first block (the scheduler reserves a real request's)
            blocks = torch.where(blocks < 0, cache.scratch_block, blocks)
            step_batch = ForwardBatch(
                token_ids=tokens, positions=positions, context_lens=[0] * n, query_lens=[1] * n,
                state_slots=[cache.scratch_slot] * n, block_tables=batch.block_tables,
                slot_mapping=blocks * block_size + positions % block_size, logits_rows=rows, slots=step_slots,
                context_lens_tensor=positions, static=True)
            logits, streams = self.model.draft(step_batch, streams, cache, s)
            tokens = logits.argmax(dim=-1)
            proposed.append(tokens)
        return proposed
