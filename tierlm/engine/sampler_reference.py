"""The sampler's pass written plainly, one row at a time: what `sampling_pass.sample_rows` must give,
token for token (tests compare them; nothing in the engine runs it).

`reference_sample_rows` has the signature of `sample_rows`, `reference_edit_logits` that of `edit_logits`:
fp32 logits [rows, vocab] and the host's `RowPlan`, -> (token per row, status per row);
`reference_sampling_probs` that of `sampling_probs` (the distribution each row draws from, speculative
decoding's target). Each row, in order: repetition penalty on every id it has seen (prompt and output),
frequency and presence penalties by its output counts, logit bias, bans, its bitmask (grammar and
allowed ids); NaN or nothing left is its status; a greedy row (or one whose maximum is +inf) takes the
argmax; a top-k row draws among its k best logits (equal ones by lower id), the rest over the vocabulary,
each scaled by its temperature below its maximum, cut by top-p (float64 mass sums) then min-p, an
exponential race against the row's noise
(`sampling_noise`: by rank for a top-k draw, by token id otherwise).
"""

from __future__ import annotations

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampling_noise import exponential_noise, exponential_noise_np
from tierlm.engine.sampling_pass import STATUS_MASKED, STATUS_NAN, STATUS_OK
from tierlm.engine.sampling_plan import RowPlan, ids_below, plan_rows


def reference_sample_rows(logits: torch.Tensor, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, status = [], []
    for i in range(logits.shape[0]):
        raw = logits[i]
        x = _edited_row(raw.clone(), i, plan)
        top = x.max()
        state = STATUS_NAN if bool(torch.isnan(raw).any()) else STATUS_MASKED if top == float("-inf") else STATUS_OK
        status.append(state)
        if plan.greedy[i] or state != STATUS_OK or top == float("inf"):
            tokens.append(int(x.argmax()))
            continue
        probs, ids = _row_candidates(x, i, plan)
        if plan.top_k[i]:  # noise by rank
            noise = torch.from_numpy(exponential_noise_np(plan.keys[i : i + 1], len(ids))[0]).to(x.device)
        else:  # by token id
            key = torch.from_numpy(plan.keys[i : i + 1].view(np.int64)).to(x.device)
            noise = exponential_noise(key, ids)[0]
        tokens.append(int(ids[int((probs / noise).argmax())]))
    device = logits.device
    return torch.tensor(tokens, device=device), torch.tensor(status, device=device)


def reference_sampling_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """What `sampling_pass.sampling_probs` gives: each row's distribution (its candidates' probabilities,
    normalized; one-hot at the argmax for a greedy row or one whose maximum is +inf), from logits already
    edited."""
    rows, vocab = logits.shape
    plan = plan_rows(requests, vocab, np.zeros(rows, dtype=np.uint64))
    out = torch.zeros(rows, vocab, device=logits.device)
    for i in range(rows):
        x = logits[i].float()
        if plan.greedy[i] or x.max() == float("inf"):
            out[i, int(x.argmax())] = 1.0
            continue
        probs, ids = _row_candidates(x, i, plan)
        out[i, ids] = probs / probs.sum()
    return out


def _row_candidates(x: torch.Tensor, i: int, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, ids) of what row i (edited logits `x`) draws among: with top-k its k best, equal
    ones by lower id, else the vocabulary by id; scaled by its temperature below its maximum, softmax, cut
    by top-p then min-p (not renormalized)."""
    top, temperature, top_p, min_p = x.max(), float(plan.temperature[i]), float(plan.top_p[i]), float(plan.min_p[i])
    k = int(plan.top_k[i])
    if k:
        values, ids = x.sort(descending=True, stable=True)  # ties by lower id
        values, ids = values[:k], ids[:k]
        return _cut(torch.softmax((values - top) / temperature, dim=0), top_p, min_p, 0), ids
    probs = torch.softmax((x - top) / temperature, dim=0)
    ordered, order = probs.sort(descending=True, stable=True)
    most_likely = int((order == int(x.argmax())).nonzero()[0, 0])
    ordered = _cut(ordered, top_p, min_p, most_likely)
    return torch.zeros_like(probs).scatter_(0, order, ordered), torch.arange(len(x), device=x.device)


def reference_edit_logits(logits: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """What `sampling_pass.edit_logits` gives: every row through `_edited_row`."""
    return torch.stack([_edited_row(logits[i].clone(), i, plan) for i in range(logits.shape[0])])


def _edited_row(x: torch.Tensor, i: int, plan: RowPlan) -> torch.Tensor:
    vocab = plan.vocab
    def in_row(flat: np.ndarray) -> np.ndarray:
        return flat[flat // vocab == i] - i * vocab

    outputs = in_row(plan.output_flat)
    prompts = next((ids_below(r.prompt_ids_array, vocab) for row, r in plan.repeated if row == i),
                   np.zeros(0, dtype=np.int64))
    if len(outputs) or len(prompts):
        repetition, frequency, presence = (float(v) for v in plan.penalties[i])
        seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        seen[torch.from_numpy(np.concatenate([outputs, prompts])).to(x.device)] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        counts = torch.bincount(torch.from_numpy(outputs), minlength=vocab).float().to(x.device)
        x = x - (frequency * counts + presence * (counts > 0))
    mine = plan.bias_flat // vocab == i
    for flat, value in zip(plan.bias_flat[mine], plan.bias_values[mine]):
        x[flat - i * vocab] += float(value)
    for token in in_row(plan.ban_flat):
        x[token] = float("-inf")
    if plan.bitmask is not None:
        words = plan.bitmask[i].numpy().view(np.uint32)
        allowed = (words[np.arange(vocab) // 32] >> (np.arange(vocab) % 32).astype(np.uint32)) & 1
        x = x.masked_fill(torch.from_numpy(allowed == 0).to(x.device), float("-inf"))
    return x


def _cut(ordered: torch.Tensor, top_p: float, min_p: float, most_likely: int) -> torch.Tensor:
    """Probabilities sorted best first: with top_p < 1 the smallest prefix whose mass reaches top_p (the
    first always stays), then those below min_p x the probability of the row's argmax (at `most_likely`
    of the order) dropped."""
    threshold = min_p * ordered[most_likely]
    if top_p < 1:
        before = ordered.double().cumsum(dim=0) - ordered.double()  # float64 sums
        keep = before < top_p
        keep[0] = True
        ordered = torch.where(keep, ordered, 0.0)
    return torch.where(ordered < threshold, 0.0, ordered)
