"""Turn one request's logits row into its next token, and report log-probabilities.

Plain torch, one row at a time (a handful of requests per step): a structured-output request's grammar
mask, else min_tokens masking of EOS and stop ids (the grammar alone decides where JSON ends), greedy at
temperature 0, else temperature, top-k, top-p and a draw from the request's own generator (seeded
requests are reproducible whatever else is in the batch). Log-probabilities are those of the raw model
distribution, as vLLM reports by default.

Numerics, whatever the parameters (each limit is documented in the README):
- a temperature below `MIN_TEMPERATURE` samples greedily (dividing by a subnormal overflows fp32);
- the row's maximum is subtracted before dividing by the temperature, so no scaled logit is above 0 and
  none can overflow;
- top-p always keeps the most likely token (a top_p below the smallest fp32 would otherwise drop all);
- a row with NaN, or with every token masked, is this request's failure: `SamplingError`, which ends
  this request alone (the engine finishes it with reason "error"), never the batch.
"""

from __future__ import annotations

import torch

from tierlm.engine.request import Request
from tierlm.outputs import Logprob, PositionLogprobs

MIN_TEMPERATURE = 1e-5  # below this a temperature samples greedily (as vLLM's _SAMPLING_EPS)


class SamplingError(RuntimeError):
    """This request's row cannot be sampled (NaN logits, no allowed token); the message says why."""


def position_logprobs(logprobs: torch.Tensor, token_id: int, top: int, decode) -> PositionLogprobs:
    """{token_id: its Logprob, then the `top` most likely tokens}; ranks are 1-based."""
    chosen = logprobs[token_id]
    entries = {token_id: Logprob(float(chosen), int((logprobs > chosen).sum()) + 1, decode(token_id))}
    if top:
        values, ids = logprobs.topk(top)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            entries.setdefault(tid, Logprob(value, rank, decode(tid)))
    return entries


def scaled_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 logits row (at least one finite entry) -> the distribution to draw from, never NaN or inf."""
    logits = (logits - logits.max()) / temperature  # every entry <= 0: exp cannot overflow
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p; the most likely token always stays
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, request: Request) -> int:
        params = request.params
        logits = logits.float()
        if torch.isnan(logits).any():
            raise SamplingError("the model's logits for this request contain NaN")
        if request.structured_output is not None:
            logits = request.structured_output.mask_logits(logits)
        elif len(request.output_token_ids) < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
            if banned:
                logits = logits.clone()
                logits[[t for t in banned if t < logits.shape[0]]] = float("-inf")
        top = logits.max()
        if top == float("-inf"):
            raise SamplingError("no token is allowed next (every logit is masked or -inf)")
        if params.temperature < MIN_TEMPERATURE or top == float("inf"):  # an infinite logit takes all the mass
            return int(torch.argmax(logits))
        probs = scaled_probabilities(logits, params.temperature, params.top_k or 0, params.top_p)
        generator = request.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=generator))
