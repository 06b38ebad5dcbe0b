"""Turn one request's logits row into its next token, and report log-probabilities.

Plain torch, one row at a time (a handful of requests per step): a structured-output request's grammar
mask, else min_tokens masking of EOS and stop ids (the grammar alone decides where JSON ends), greedy at
temperature 0, else temperature, top-k, top-p and a draw from the request's own generator (seeded
requests are reproducible whatever else is in the batch). Log-probabilities are those of the raw model
distribution, as vLLM reports by default.
"""

from __future__ import annotations

import torch

from tierlm.engine.request import Request
from tierlm.outputs import Logprob, PositionLogprobs


def position_logprobs(logprobs: torch.Tensor, token_id: int, top: int, decode) -> PositionLogprobs:
    """{token_id: its Logprob, then the `top` most likely tokens}; ranks are 1-based."""
    chosen = logprobs[token_id]
    entries = {token_id: Logprob(float(chosen), int((logprobs > chosen).sum()) + 1, decode(token_id))}
    if top:
        values, ids = logprobs.topk(top)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            entries.setdefault(tid, Logprob(value, rank, decode(tid)))
    return entries


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, request: Request) -> int:
        params = request.params
        logits = logits.float()
        if request.structured_output is not None:
            logits = request.structured_output.mask_logits(logits)
        elif len(request.output_token_ids) < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
            if banned:
                logits = logits.clone()
                logits[[t for t in banned if t < logits.shape[0]]] = float("-inf")
        if params.greedy:
            return int(torch.argmax(logits))
        logits = logits / params.temperature
        if params.top_k and params.top_k > 0 and params.top_k < logits.shape[0]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = request.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=generator))
