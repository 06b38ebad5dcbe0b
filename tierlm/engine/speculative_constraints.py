"""The penalties and grammars of speculating requests, row by row (engine/speculative.py uses them).

A verify row is checked against what decoding without drafts would sample from there: the sampler's
penalties as if the output had grown by the drafts before the row (`penalized_logits`), then the grammar's
mask after exactly those drafts (`grammar_bitmask`: the matcher walked over the drafts being verified and
rolled back; never a mask of older drafts); `verify_logits` is both. Drafting under a grammar: the draft
head's logits masked by each matcher's current state (`grammar_masked`), the matchers walked ahead over the
step's tokens and each picked draft, then rolled back (`GrammarWalk`).
"""

from __future__ import annotations

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampling_pass import edit_logits
from tierlm.engine.sampling_plan import plan_rows


def verify_rows(requests: list[Request], drafts: list[list[int]]) -> tuple[list[Request], list[list[int]]]:
    """The rows of verify chunks (request i's last token, then its drafts) as the sampler plans them: the
    request of each row, and the drafts before it (what its penalties count after the output)."""
    rows, before = [], []
    for request, tokens in zip(requests, drafts, strict=True):
        rows += [request] * (1 + len(tokens))
        before += [tokens[:j] for j in range(1 + len(tokens))]
    return rows, before


def plan_penalties(requests: list[Request], drafts_before: list[list[int]], vocab: int, device: torch.device):
    """The sampler's plan (`plan_rows`) of verification rows' penalties, row i's output grown by
    drafts_before[i] (no grammar mask: the matcher's state is the output's, not the row's; `grammar_bitmask`
    masks each row); None when no row's request has penalties (nothing to edit)."""
    if not any(request.params.has_penalties for request in requests):
        return None
    keys = np.zeros(len(requests), dtype=np.uint64)  # never read: the plan only edits logits here
    return plan_rows(requests, vocab, keys, pinned=device.type == "cuda", appended=drafts_before, grammars=False)


def penalized_logits(logits: torch.Tensor, requests: list[Request], drafts_before: list[list[int]]) -> torch.Tensor:
    """fp32 `logits` [rows, vocab] of verification rows after their requests' penalties, as `Sampler` applies
    them when the output has grown by drafts_before[row] (what decoding without drafts would see there)."""
    x = logits.float()
    plan = plan_penalties(requests, drafts_before, x.shape[1], x.device)
    return x if plan is None else edit_logits(x, plan)


def grammar_bitmask(requests: list[Request], drafts: list[list[int]], vocab: int, pinned: bool = False
                    ) -> torch.Tensor | None:
    """The token bitmask [rows, ceil(vocab / 32)] (xgrammar's int32 layout) of verify chunks' rows, in
    `verify_rows`' order: request i's row j allows what its grammar allows after its output and
    drafts[i][:j], its matcher walked over exactly the drafts being verified and then rolled back to the
    output. Rows of requests without a grammar (or still reasoning) allow everything, and so do rows past
    a draft the grammar refuses (the row before masks that draft: it is rejected) or ends on (the request
    ends there if it is accepted): their tokens are never kept. None: no request has a grammar."""
    if all(request.structured_output is None for request in requests):
        return None
    rows = sum(1 + len(tokens) for tokens in drafts)
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=pinned)
    row = 0
    for request, tokens in zip(requests, drafts, strict=True):
        grammar = request.structured_output
        if grammar is not None:
            walked = 0
            for j in range(1 + len(tokens)):
                if not grammar.fill_token_bitmask(bitmask, row + j):
                    bitmask[row + j] = -1
                if j == len(tokens) or not grammar.accept(tokens[j]):
                    break
                walked += 1
                if grammar.is_terminated:
                    break
            grammar.rollback(walked)
        row += 1 + len(tokens)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place in fp32 `logits` [rows, vocab], at every token a row of `bitmask` (on the host) forbids."""
    import xgrammar  # slow to import: only once a grammar request speculates

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))


def verify_logits(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor:
    """fp32 logits [rows, vocab] of verify chunks' rows (request i's last token, then its drafts: `verify_rows`)
    as the sampler edits them once the output has grown by the drafts before each row: the penalties
    (`penalized_logits`), then the grammar's mask (`grammar_bitmask`). A new tensor where it edits."""
    x = penalized_logits(logits, *verify_rows(requests, drafts))
    bitmask = grammar_bitmask(requests, drafts, x.shape[1], pinned=x.device.type == "cuda")
    if bitmask is not None:
        x = x.clone() if x is logits else x
        apply_bitmask(x, bitmask)
    return x


class GrammarWalk:
    """The grammar matchers of proposing requests, walked ahead while the draft head proposes: over the
    tokens the step adds to each output (its accepted drafts, then the token after them), then over each
    draft as it is picked (`take`); `undo` rolls every matcher back to its request's output (the engine
    then advances it over the step's tokens as it appends them). A request stops drafting at a draft its
    grammar refuses (dropped) or ends on (kept: the last)."""

    def __init__(self, requests: list[Request], ahead: list[list[int]]) -> None:
        self.grammars = [request.structured_output for request in requests]
        self.walked = [0] * len(requests)
        self.open = [True] * len(requests)  # may still draft
        for i, tokens in enumerate(ahead):
            for token in tokens if self.grammars[i] is not None else ():
                if not self.take(i, token):
                    break

    def take(self, i: int, token: int) -> bool:
        """Advance request i's matcher past `token`: whether it is kept."""
        grammar = self.grammars[i]
        if grammar is None:
            return True
        if not self.open[i] or not grammar.accept(token):
            self.open[i] = False
            return False
        self.walked[i] += 1
        self.open[i] = not grammar.is_terminated
        return True

    def undo(self) -> None:
        for grammar, walked in zip(self.grammars, self.walked, strict=True):
            if grammar is not None:
                grammar.rollback(walked)


def grammar_masked(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Draft logits [rows, vocab] with row i masked (-inf, in an fp32 copy) by requests[i]'s grammar in its
    matcher's current state; the logits themselves when no row has a grammar still open."""
    rows = [i for i, request in enumerate(requests)
            if request.structured_output is not None and not request.structured_output.is_terminated]
    if not rows:
        return logits
    bitmask = torch.full((len(requests), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32,
                         pin_memory=logits.device.type == "cuda")
    for i in rows:
        if not requests[i].structured_output.fill_token_bitmask(bitmask, i):
            bitmask[i] = -1
    x = logits.to(torch.float32, copy=True)
    apply_bitmask(x, bitmask)
    return x
