"""The host side of a step's sampling pass: each row's parameters as arrays and its edits as flat indices
(`plan_rows` -> `RowPlan`; nothing here touches a device).

Per row: greedy or not (a temperature below `MIN_TEMPERATURE` samples greedily: dividing by a subnormal
overflows fp32), temperature, top-k (0 < top_k < vocab, else none), top-p, min-p, its noise key, the
penalties (repetition, frequency, presence); the sparse edits as flat indices into the [rows * vocab]
logits: the output ids of penalized rows, the logit biases, the bans (`bad_words` that would complete,
EOS and stop ids before `min_tokens`); the rows whose repetition penalty counts their prompt (its ids go
to the device once per request, as a bitmask: engine/sampling_pass.py `prompt_bitmasks`); one token
bitmask for grammars and `allowed_token_ids`, filled in place (xgrammar's layout); and under overlap
scheduling the penalized rows whose last output id is still on the device (a placeholder) with that id's
row in the step in flight. A request whose own preparation (its grammar) raises fails alone
(`RowPlan.failed`). `plain_greedy` says which requests need no plan at all.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.request import Request

logger = logging.getLogger("tierlm")


MIN_TEMPERATURE = 1e-5  # below this a temperature samples greedily (as vLLM's _SAMPLING_EPS)


def banned_tokens(request: Request, vocab: int) -> list[int]:
    """Ids this request may not sample next: bad words that would complete, and EOS / stop ids before
    min_tokens (a grammar alone decides where its output ends)."""
    params = request.params
    banned = []
    output = request.output_token_ids
    for word in request.bad_words_token_ids:
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
            banned.append(word[-1])
    if request.structured_output is None and len(output) < params.min_tokens:
        banned += params.stop_token_ids
        if not params.ignore_eos:
            banned += request.eos_token_ids
    return [t for t in banned if t < vocab]


def plain_greedy(request: Request) -> bool:
    """Whether `plan_rows` would make the request's row greedy with no edit (no penalty, bias, ban, mask)
    and nothing that can fail: its token is the argmax, and the sampler skips the plan (decode steps of
    greedy requests: its host time is the pipeline's last rank's, between its layers and the next step)."""
    p = request.params
    return (p.temperature < MIN_TEMPERATURE and not p.has_penalties and not p.logit_bias and not p.allowed_token_ids
            and request.structured_output is None and not request.bad_words_token_ids
            and len(request.output_token_ids) >= p.min_tokens)


@dataclass
class RowPlan:
    """A step's sampling rows as the host prepares them: per-row parameters as arrays, the sparse edits
    (penalized ids, biases, bans) as flat indices into the [rows * vocab] logits, and the token bitmask
    (grammar and allowed_token_ids; None when no row has one). What `PackedPlan` packs for the pass and
    `reference_sample_rows` reads row by row."""

    vocab: int
    failed: dict[int, str]  # row -> why its preparation failed
    greedy: np.ndarray  # [rows] bool: temperature below MIN_TEMPERATURE
    temperature: np.ndarray  # [rows] float32 (1 for greedy rows: never divided by 0)
    top_k: np.ndarray  # [rows] int64: 0 < top_k < vocab, else 0 (no top-k)
    top_p: np.ndarray  # [rows] float32
    min_p: np.ndarray  # [rows] float32
    keys: np.ndarray  # [rows] uint64 noise keys (`sampling_noise`)
    penalties: np.ndarray  # [rows, 3] float32: repetition, frequency, presence (1, 0, 0: none)
    output_flat: np.ndarray  # row * vocab + id of every output token of a penalized row
    repeated: list[tuple[int, Request]]  # rows with a repetition penalty: their prompt ids count as seen
    bias_flat: np.ndarray
    bias_values: np.ndarray  # float32
    ban_flat: np.ndarray
    bitmask: torch.Tensor | None  # [rows, ceil(vocab / 32)] int32 on the host (pinned on CUDA)
    # penalized rows whose last output id is a placeholder (overlap scheduling: sampled by the step in
    # flight, on the device), and that id's row in the step's sampled ids (`Sampler.launch`'s previous)
    pending_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_sources: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def sampled_rows(self) -> np.ndarray:
        return ~self.greedy

    @property
    def top_k_rows(self) -> np.ndarray:
        return ~self.greedy & (self.top_k > 0)

    @property
    def edited(self) -> bool:
        return bool(len(self.output_flat) or self.repeated or len(self.bias_flat) or len(self.ban_flat)
                    or len(self.pending_rows) or self.bitmask is not None)


def plan_rows(requests: list[Request], vocab: int, keys: np.ndarray, pinned: bool = False,
              appended: list[list[int]] | None = None, grammars: bool = True,
              previous: list[Request] | None = None) -> RowPlan:
    """The host side of a step's sampling pass (nothing here touches a device). appended: per row, ids
    the penalties count as output after the request's own (speculative verification: the drafts before
    the row; a request may fill several rows). grammars False: no row takes its grammar's mask (the
    caller masks: speculative verification, each row after the drafts before it). previous: the requests
    of the step in flight's rows (overlap scheduling): a penalized request's placeholder (one at most) is
    its row's sampled id there, which the pass reads on the device."""
    rows = len(requests)
    failed: dict[int, str] = {}
    params = [r.params for r in requests]
    temperature = np.array([p.temperature for p in params], dtype=np.float64)
    greedy = temperature < MIN_TEMPERATURE
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=np.int64)
    penalties = np.array([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
                         dtype=np.float32).reshape(rows, 3)
    bias_flat, bias_values, ban_flat, masked = [], [], [], []
    bitmask = None
    words = (vocab + 31) // 32
    for i, request in enumerate(requests):
        p = request.params
        try:
            bias = [(i * vocab + t, v) for t, v in (p.logit_bias or {}).items()]
            bans = [i * vocab + t for t in banned_tokens(request, vocab)]
            row_mask = None
            if p.allowed_token_ids:
                row_mask = allowed_bitmask(p.allowed_token_ids, vocab, words)
            grammar = request.structured_output if grammars else None
            if grammar is not None or row_mask is not None:
                if bitmask is None:  # rows are written as they come: the grammar's, or all allowed (-1)
                    bitmask = torch.empty((rows, words), dtype=torch.int32, pin_memory=pinned)
                if grammar is None or not grammar.fill_token_bitmask(bitmask, i):
                    bitmask[i] = -1
                if row_mask is not None:
                    bitmask[i] &= row_mask
                masked.append(i)
        except Exception as exc:  # this request's own state: it fails alone
            logger.exception("preparing request %s for sampling failed", request.request_id)
            failed[i] = f"sampling failed: {type(exc).__name__}: {exc}"
            continue
        bias_flat += [flat for flat, _ in bias]
        bias_values += [value for _, value in bias]
        ban_flat += bans
    if bitmask is not None and len(masked) < rows:
        bitmask[torch.from_numpy(np.setdiff1d(np.arange(rows), masked))] = -1  # rows no mask wrote: all allowed
    penalized = [i for i, p in enumerate(params) if p.has_penalties and i not in failed]
    repeated = [i for i in penalized if params[i].repetition_penalty != 1.0]
    outputs = [requests[i].known_output_ids_array() for i in penalized]  # arrays kept up to date per request
    if appended is not None:
        outputs = [np.concatenate([ids, np.asarray(appended[i], dtype=np.int64)]) if appended[i] else ids
                   for ids, i in zip(outputs, penalized, strict=True)]
    output_flat = _flat_ids(outputs, penalized, vocab)
    pending = [i for i in penalized if requests[i].num_placeholders]
    sources = []
    for i in pending:
        if requests[i].num_placeholders > 1 or previous is None or requests[i] not in previous:
            raise RuntimeError(f"request {requests[i].request_id}: {requests[i].num_placeholders} output id(s) on "
                               "the device and no step in flight that sampled them")
        sources.append(previous.index(requests[i]))
    return RowPlan(
        vocab, failed, greedy, np.where(greedy, 1.0, temperature).astype(np.float32), top_k,
        np.array([p.top_p for p in params], dtype=np.float32), np.array([p.min_p for p in params], dtype=np.float32),
        keys, penalties, output_flat, [(i, requests[i]) for i in repeated], np.array(bias_flat, dtype=np.int64),
        np.array(bias_values, dtype=np.float32), np.array(ban_flat, dtype=np.int64), bitmask,
        np.array(pending, dtype=np.int64), np.array(sources, dtype=np.int64))


def _flat_ids(ids_per_row: list[np.ndarray], rows: list[int], vocab: int) -> np.ndarray:
    """row * vocab + id for the ids in [0, vocab) of each listed row."""
    if not rows:
        return np.zeros(0, dtype=np.int64)
    ids = np.concatenate(ids_per_row)
    flat = ids + np.repeat(np.array(rows, dtype=np.int64) * vocab, [len(row) for row in ids_per_row])
    return flat[(ids >= 0) & (ids < vocab)]


def ids_below(ids: list[int], vocab: int) -> np.ndarray:
    """`ids` as an int64 array, without those at or above `vocab` (never in the logits)."""
    array = np.asarray(ids, dtype=np.int64)
    return array[array < vocab]


def allowed_bitmask(ids: list[int], vocab: int, words: int) -> torch.Tensor:
    """A bitmask row (xgrammar's layout: token t is bit t % 32 of word t // 32) with only `ids` set."""
    ids = ids_below(ids, vocab)
    row = np.zeros(words, dtype=np.uint32)
    np.bitwise_or.at(row, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return torch.from_numpy(row.view(np.int32))
