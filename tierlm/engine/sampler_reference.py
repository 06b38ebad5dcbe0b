"""The sampler's pass written plainly, one row at a time: what `sampler.sample_rows` must give, token for
token (tests compare them; nothing in the engine runs it).

`reference_sample_rows` has the signature of `sample_rows`, `reference_edit_logits` that of `edit_logits`: fp32 logits [rows, vocab] and the host's `RowPlan`, -> (token per row,
status per row). Each row, in order: repetition penalty on every id it has seen (prompt and output),
frequency and presence penalties by its output counts, logit bias, bans, its bitmask (grammar and
allowed ids); NaN or nothing left is its status; a greedy row (or one whose maximum is +inf) takes the
argmax; a top-k row draws among its k best logits (equal ones by lower id), the rest over the vocabulary, each scaled by its
temperature below its maximum, cut by top-p then min-p, an exponential race against the row's noise
(`sampling_noise`: by rank for a top-k draw, by token id otherwise).
"""

from __future__ import annotations

import numpy as np
import torch

from tierlm.engine.sampler import _MASKED, _NAN, _OK, RowPlan
from tierlm.engine.sampling_noise import exponential_noise, exponential_noise_np


def reference_sample_rows(logits: torch.Tensor, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    tokens, status = [], []
    for i in range(rows):
        raw = logits[i]
        x = _edited_row(raw.clone(), i, plan)
        top = x.max()
        state = _NAN if bool(torch.isnan(raw).any()) else _MASKED if top == float("-inf") else _OK
        status.append(state)
        greedy_token = int(x.argmax())
        if plan.greedy[i] or state != _OK or top == float("inf"):
            tokens.append(greedy_token)
            continue
        temperature = float(plan.temperature[i])
        k = int(plan.top_k[i])
        if k:
            values, ids = x.sort(descending=True, stable=True)  # ties by lower id
            values, ids = values[:k], ids[:k]
            probs = _cut(torch.softmax((values - top) / temperature, dim=0), float(plan.top_p[i]), float(plan.min_p[i]), 0)
            noise = torch.from_numpy(exponential_noise_np(plan.keys[i : i + 1], k)[0]).to(x.device)
            tokens.append(int(ids[int((probs / noise).argmax())]))
        else:
            probs = torch.softmax((x - top) / temperature, dim=0)
            ordered, order = probs.sort(descending=True, stable=True)
            most_likely = int((order == greedy_token).nonzero()[0, 0])
            ordered = _cut(ordered, float(plan.top_p[i]), float(plan.min_p[i]), most_likely)
            probs = torch.zeros_like(probs).scatter_(0, order, ordered)
            key = torch.from_numpy(plan.keys[i : i + 1].view(np.int64)).to(x.device)
            noise = exponential_noise(key, torch.arange(vocab, device=x.device))[0]
            tokens.append(int((probs / noise).argmax()))
    device = logits.device
    return torch.tensor(tokens, device=device), torch.tensor(status, device=device)


def reference_edit_logits(logits: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """What `sampler.edit_logits` gives: every row through `_edited_row`."""
    return torch.stack([_edited_row(logits[i].clone(), i, plan) for i in range(logits.shape[0])])


def _edited_row(x: torch.Tensor, i: int, plan: RowPlan) -> torch.Tensor:
    vocab = plan.vocab
    def in_row(flat: np.ndarray) -> np.ndarray:
        return flat[flat // vocab == i] - i * vocab

    outputs, prompts = in_row(plan.output_flat), in_row(plan.prompt_flat)
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
        before = ordered.cumsum(dim=0) - ordered
        keep = before < top_p
        keep[0] = True
        ordered = torch.where(keep, ordered, 0.0)
    return torch.where(ordered < threshold, 0.0, ordered)
