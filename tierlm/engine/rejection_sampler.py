"""Speculative decoding's verification: which draft tokens a request keeps, and the one token after them.

A request proposes K draft tokens x_1..x_K; one target forward scores the K+1 positions they open, giving
target distributions p_0..p_K (p_k: the next token after x_1..x_k). The output is the accepted drafts
followed by exactly one more token, so a step yields 1..K+1 tokens (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; vLLM's `RejectionSampler`):
- sampled requests: draft x_k, drawn from the draft distribution q_k, is accepted with probability
  min(1, p_k(x_k) / q_k(x_k)) (a uniform u < p/q); at the first rejection the token is drawn instead from
  the residual max(p_k - q_k, 0), normalised ("recovered"); if all K are accepted a bonus token is drawn
  from p_K. The output then follows the target distribution exactly, whatever q is. Without draft
  probabilities (a greedy draft) q_k is one-hot at x_k: accept with probability p_k(x_k), recover from p_k
  with x_k removed.
- greedy requests: accept while x_k is the argmax of p_k; the token after is that argmax (the first
  mismatch's, or p_K's): the output is exactly what decoding without drafts gives.
The target distributions are the ones the request samples from (temperature, top-k/top-p, grammar mask
applied); for greedy requests any scores with the same argmax do (logits or probabilities). Argmax ties go
to the lowest token id, as torch.argmax does.

Randomness: each sampled request draws, from its own generator when it has one, first a uniform for each
of its drafts, then one exponential per vocabulary entry; the final token is the argmax of
residual / exponential (an exponential race: a draw proportional to the residual). A seeded request thus
gets the same tokens whatever else is in the batch. Requests without a generator draw from the sampler's
shared one, batched. Greedy requests draw nothing. Draws happen on each generator's device (a request's
generator is a CPU one) and move to the probabilities' device.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: list[int],
    greedy: list[bool],
    generators: list[torch.Generator | None],
    shared_generator: torch.Generator,
) -> list[list[int]]:
    """Each request's output tokens: its accepted drafts, then one recovered or bonus token.

    target_probs [B, K+1, V]: request i's rows 0..num_drafts[i] are used (p_0..p_n); draft_tokens [B, K]
    (the first num_drafts[i] are used); draft_probs [B, K, V] or None (greedy drafts); num_drafts, greedy,
    generators: per request (n <= K drafts; temperature 0; its own generator or None). Probabilities
    are read in fp32 or wider; rows need not be exactly normalised."""
    batch, positions, vocab = target_probs.shape
    k_max = positions - 1
    if draft_tokens.shape != (batch, k_max):
        raise ValueError(f"draft_tokens: expected shape {[batch, k_max]}, got {list(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k_max, vocab):
        raise ValueError(f"draft_probs: expected shape {[batch, k_max, vocab]}, got {list(draft_probs.shape)}")
    if not len(num_drafts) == len(greedy) == len(generators) == batch:
        raise ValueError(f"num_drafts, greedy, generators: need one entry per request ({batch})")
    if any(not 0 <= n <= k_max for n in num_drafts):
        raise ValueError(f"num_drafts: each must lie in [0, {k_max}], got {num_drafts}")
    device = target_probs.device
    drafts = draft_tokens.to(device=device, dtype=torch.int64)
    counts = torch.tensor(num_drafts, device=device)
    in_range = torch.arange(k_max, device=device)[None, :] < counts[:, None]  # [B, K]

    sampled = [i for i in range(batch) if not greedy[i]]
    accepted = torch.zeros(batch, k_max, dtype=torch.bool, device=device)
    final = torch.zeros(batch, dtype=torch.int64, device=device)
    greedy_rows = [i for i in range(batch) if greedy[i]]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        best = target_probs[rows].argmax(dim=-1)  # [G, K+1]
        accepted[rows] = drafts[rows] == best[:, :k_max]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        uniforms, exponentials = _draws([generators[i] for i in sampled], [num_drafts[i] for i in sampled], k_max,
                                        vocab, shared_generator, device)
        p = target_probs[rows].double()
        p_draft = p[:, :k_max].gather(-1, drafts[rows, :, None]).squeeze(-1)  # p_k(x_k)  [S, K]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs[rows].double().gather(-1, drafts[rows, :, None]).squeeze(-1)
        # P(u < p/q) = min(1, p/q); a draft the draft distribution gives no mass is rejected (vLLM)
        accepted[rows] = (q_draft > 0) & (uniforms * q_draft < p_draft)
    accepted &= in_range
    # the first position that is not an accepted draft: the first rejection, or n when all are accepted
    num_accepted = torch.where(accepted | ~in_range, 0, 1).cumsum(dim=1).eq(0).sum(dim=1)
    num_accepted = torch.minimum(num_accepted, counts)
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        final[rows] = best.gather(1, num_accepted[rows, None]).squeeze(1)
    if sampled:
        rows = torch.tensor(sampled, device=device)
        at = num_accepted[rows]  # [S]
        dist = p.gather(1, at[:, None, None].expand(-1, 1, vocab)).squeeze(1)  # p at the final position
        rejected = at < counts[rows]
        if rejected.any():
            where = at.clamp(max=k_max - 1)
            if draft_probs is None:
                residual = dist.scatter(1, drafts[rows].gather(1, where[:, None]), 0.0)
            else:
                q = draft_probs[rows].double().gather(1, where[:, None, None].expand(-1, 1, vocab)).squeeze(1)
                residual = (dist - q).clamp(min=0.0)
            # p == q makes a rejection (nearly) impossible; if rounding made one, p itself is the residual
            residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, dist)
            dist = torch.where(rejected[:, None], residual, dist)
        final[rows] = (dist / exponentials).argmax(dim=1)
    # one read back: each request's count, final token, drafts
    rows = torch.cat([num_accepted[:, None], final[:, None], drafts], dim=1).tolist()
    return [row[2 : 2 + row[0]] + [row[1]] for row in rows]


def _draws(
    generators: list[torch.Generator | None], num_drafts: list[int], k_max: int, vocab: int,
    shared: torch.Generator, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [S, K] (a request's first n used) and exponentials [S, V] (fp64, on `device`) for the sampled
    requests, each drawn on its generator's device from its own generator, in that order; the rest from
    `shared`, batched."""
    f64 = torch.float64
    uniforms = torch.zeros(len(generators), k_max, dtype=f64, device=device)
    exponentials = torch.empty(len(generators), vocab, dtype=f64, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        rows = torch.tensor(unseeded, device=device)
        at = {"dtype": f64, "device": shared.device}
        uniforms[rows] = torch.rand(len(unseeded), k_max, **at, generator=shared).to(device)
        exponentials[rows] = torch.empty(len(unseeded), vocab, **at).exponential_(generator=shared).to(device)
    for j, g in enumerate(generators):
        if g is not None:
            n, at = num_drafts[j], {"dtype": f64, "device": g.device}
            uniforms[j, :n] = torch.rand(n, **at, generator=g).to(device)
            exponentials[j] = torch.empty(vocab, **at).exponential_(generator=g).to(device)
    return uniforms, exponentials
