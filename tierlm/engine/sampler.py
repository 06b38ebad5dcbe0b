"""Turn the logits rows of a step's sampling requests into their next tokens, on the logits' device, in
one batched pass, and report log-probabilities.

The pass, every row at once (per-row values as tensors): penalties on the request's own tokens
(repetition on prompt and output, vLLM's rule: positive logits divided, negative multiplied; frequency
and presence on the output, OpenAI's rule), `logit_bias`, bans (`allowed_token_ids`, `bad_words`, EOS and
stop ids before `min_tokens`), the grammar's token bitmask (xgrammar's `apply_token_bitmask_inplace`),
then greedy rows take the argmax and the others are scaled by their temperature and cut by top-k,
top-p and min-p before a draw. Token counts for the penalties are built each step from the requests'
ids. A draw is an exponential race (argmax of p / E, E ~ Exp(1)): the shared generator for unseeded
rows, each seeded request's own generator (on the logits' device) for its row, so a seeded request is
reproducible whatever else is in the batch. Only the sampled ids, a status per row and the requested
log-probabilities (those of the raw model distribution, as vLLM reports by default) come back to the
host. `launch` queues the pass and those copies without reading any device value (per-row parameters
go up through pinned memory), so the host can go on while the device samples; `collect` waits for the
copies and builds the outcomes (`sample` does both).

Numerics, whatever the parameters (each limit is documented in the README):
- a temperature below `MIN_TEMPERATURE` samples greedily (dividing by a subnormal overflows fp32);
- the row's maximum is subtracted before dividing by the temperature, so no scaled logit is above 0 and
  none can overflow; a row whose maximum is +inf takes that token;
- top-p always keeps the most likely token (a top_p below the smallest fp32 would otherwise drop all);
- a row with NaN, or with every token masked, is this request's failure (`SamplingError`'s message),
  which ends this request alone (the engine finishes it with reason "error"), never the batch; so is a
  request whose own preparation (its grammar) raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.model.forward_batch import on_device
from tierlm.outputs import Logprob, PositionLogprobs

logger = logging.getLogger("tierlm")

MIN_TEMPERATURE = 1e-5  # below this a temperature samples greedily (as vLLM's _SAMPLING_EPS)
_OK, _NAN, _MASKED = 0, 1, 2


class SamplingError(RuntimeError):
    """This request's row cannot be sampled (NaN logits, no allowed token); the message says why."""


@dataclass
class Sampled:
    """One row's outcome: its token and log-probabilities, or why it failed."""

    token_id: int | None = None
    logprobs: PositionLogprobs | None = None
    error: str | None = None


def position_logprobs(logprobs: torch.Tensor, token_id: int, top: int, decode) -> PositionLogprobs:
    """{token_id: its Logprob, then the `top` most likely tokens}; ranks are 1-based (a host row)."""
    chosen = logprobs[token_id]
    entries = {token_id: Logprob(float(chosen), int((logprobs > chosen).sum()) + 1, decode(token_id))}
    if top:
        values, ids = logprobs.topk(top)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            entries.setdefault(tid, Logprob(value, rank, decode(tid)))
    return entries


def apply_penalties(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Repetition, frequency and presence penalties of `rows`, in place. Token counts are built on the
    logits' device from one flat index per kind (row * vocab + token id, made with numpy on the host: one
    copy each, not a Python list per token)."""
    device, vocab = logits.device, logits.shape[1]
    outputs = [_ids_below(requests[r].output_token_ids, vocab) for r in rows]
    index = on_device(rows, device)
    part = logits[index]
    params = [requests[r].params for r in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [np.concatenate([_ids_below(requests[r].prompt_token_ids, vocab), out])
                if requests[r].params.repetition_penalty != 1.0 else out[:0] for r, out in zip(rows, outputs)]
        mask = torch.zeros(len(rows) * vocab, dtype=torch.bool, device=device)
        mask[_flat_index(seen, vocab, device)] = True
        penalty = on_device([p.repetition_penalty for p in params], device, torch.float32)[:, None]
        part = torch.where(mask.view(len(rows), vocab), torch.where(part > 0, part / penalty, part * penalty), part)
    if any(len(out) for out in outputs) and any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = torch.zeros(len(rows) * vocab, dtype=part.dtype, device=device)
        flat = _flat_index(outputs, vocab, device)
        counts.index_add_(0, flat, torch.ones(flat.shape[0], dtype=part.dtype, device=device))
        counts = counts.view(len(rows), vocab)
        frequency = on_device([p.frequency_penalty for p in params], device, torch.float32)[:, None]
        presence = on_device([p.presence_penalty for p in params], device, torch.float32)[:, None]
        part = part - (frequency * counts + presence * (counts > 0))
    logits[index] = part


def _ids_below(ids: list[int], vocab: int) -> np.ndarray:
    """`ids` as an int64 array, without those at or above `vocab` (never in the logits)."""
    array = np.asarray(ids, dtype=np.int64)
    return array[array < vocab]


def _flat_index(ids_per_row: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + id for every id of every row, as one tensor on `device`."""
    return on_device(np.concatenate([ids + k * vocab for k, ids in enumerate(ids_per_row)]), device)


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


@dataclass
class PendingSample:
    """A launched sampling pass: its device results, and their host copies (ready once `ready` is)."""

    requests: list[Request]
    failed: dict[int, str]  # row -> why its preparation failed
    wanted: list[int]  # rows that report log-probabilities
    tokens: torch.Tensor  # [rows] the sampled ids on the device (what a next step can take as input)
    host_ids: torch.Tensor  # [2, rows] ids and statuses, on the host
    host_logprobs: tuple[torch.Tensor, ...]  # chosen, ranks, top values, top ids of the `wanted` rows
    ready: torch.cuda.Event | None  # recorded after the copies (None on CPU: they are done)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, queued (pinned, non-blocking) on CUDA; read it after the pass's event."""
    if tensor.device.type != "cuda":
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)


def _ready_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def sample(self, logits: torch.Tensor, requests: list[Request], decode) -> list[Sampled]:
        """One token per row of `logits` [rows, vocab] (row i is requests[i]'s), on the logits' device."""
        return self.collect(self.launch(logits, requests), decode)

    def launch(self, logits: torch.Tensor, requests: list[Request]) -> PendingSample:
        """Queue the pass on the logits' device and the copy of its results to the host, without waiting
        for either (nothing here reads a device value back); `collect` reads them."""
        raw = logits.float()
        vocab = raw.shape[1]
        device = raw.device
        failed: dict[int, str] = {}
        ban_rows, ban_ids, bias_rows, bias_ids, bias_values, allowed_rows = [], [], [], [], [], []
        grammar_rows, masks = [], []
        for i, request in enumerate(requests):
            params = request.params
            try:
                for token_id, value in (params.logit_bias or {}).items():
                    bias_rows.append(i)
                    bias_ids.append(token_id)
                    bias_values.append(value)
                banned = banned_tokens(request, vocab)
                ban_rows += [i] * len(banned)
                ban_ids += banned
                if params.allowed_token_ids:
                    allowed_rows.append(i)
                if request.structured_output is not None:
                    mask = request.structured_output.token_bitmask()
                    if mask is not None:
                        grammar_rows.append(i)
                        masks.append(mask)
            except Exception as exc:  # noqa: BLE001 (this request's own state: it fails alone)
                logger.exception("preparing request %s for sampling failed", request.request_id)
                failed[i] = f"sampling failed: {type(exc).__name__}: {exc}"
        penalized = [i for i, r in enumerate(requests) if i not in failed and r.params.has_penalties]
        # the rows are changed in place only when something changes them (raw stays for log-probabilities)
        logits = raw.clone() if penalized or bias_ids or allowed_rows or ban_ids or grammar_rows else raw
        if penalized:
            apply_penalties(logits, requests, penalized)
        if bias_ids:
            logits.index_put_((on_device(bias_rows, device), on_device(bias_ids, device)),
                              on_device(bias_values, device, torch.float32), accumulate=True)
        if allowed_rows:
            keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool, device=device)
            for k, i in enumerate(allowed_rows):
                keep[k, on_device(requests[i].params.allowed_token_ids, device)] = True
            index = on_device(allowed_rows, device)
            logits[index] = logits[index].masked_fill(~keep, float("-inf"))
        if ban_ids:
            logits[on_device(ban_rows, device), on_device(ban_ids, device)] = float("-inf")
        if grammar_rows:
            import xgrammar

            # xgrammar reads row i's mask from bitmask[i]: one row per logits row, the others unused
            bitmask = torch.full((len(requests), masks[0].shape[0]), -1, dtype=masks[0].dtype)
            bitmask[grammar_rows] = torch.stack(masks)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(device), indices=grammar_rows)
        tokens, status = self._draw(raw, logits, requests)
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        top = max((requests[i].params.logprobs for i in wanted), default=0)
        logprobs = self._logprobs(raw, tokens, wanted, top) if wanted else ()
        return PendingSample(requests, failed, wanted, tokens, _to_host(torch.stack([tokens, status])),
                             tuple(_to_host(t) for t in logprobs), _ready_event(device))

    def collect(self, pending: PendingSample, decode) -> list[Sampled]:
        """The outcomes of a launched pass (waits for its copy to the host)."""
        if pending.ready is not None:
            pending.ready.synchronize()
        requests, failed, wanted = pending.requests, pending.failed, pending.wanted
        results = [Sampled() for _ in requests]
        for i, (token_id, state) in enumerate(zip(*pending.host_ids.tolist(), strict=True)):
            if i in failed:
                results[i].error = failed[i]
            elif state == _NAN:
                results[i].error = "the model's logits for this request contain NaN"
            elif state == _MASKED:
                results[i].error = "no token is allowed next (every logit is masked or -inf)"
            else:
                results[i].token_id = token_id
        if wanted:
            lp_host = [column.tolist() for column in pending.host_logprobs]
            for k, i in enumerate(wanted):
                if results[i].error is None:
                    results[i].logprobs = _entries(results[i].token_id, requests[i].params.logprobs,
                                                   *(column[k] for column in lp_host), decode)
        return results

    def _draw(self, raw: torch.Tensor, logits: torch.Tensor, requests: list[Request]):
        """(token per row, status per row): greedy rows take the argmax, the rest a scaled, cut draw."""
        device, vocab = logits.device, logits.shape[1]
        top = logits.max(dim=-1).values
        status = torch.where(torch.isnan(raw).any(dim=-1), _NAN, torch.where(top == float("-inf"), _MASKED, _OK))
        greedy_tokens = logits.argmax(dim=-1)
        temperature = on_device([r.params.temperature for r in requests], device, torch.float32)
        greedy = (temperature < MIN_TEMPERATURE) | (top == float("inf")) | (status != _OK)
        sampling = [i for i, r in enumerate(requests) if r.params.temperature >= MIN_TEMPERATURE]
        tokens = greedy_tokens.clone()
        # a row with top-k draws among its k best (no sort of the vocabulary), the others over all of it;
        # each row's draw depends on its own values only, whatever else is in the batch
        with_k = [i for i in sampling if 0 < requests[i].params.top_k < vocab]
        without_k = [i for i in sampling if not 0 < requests[i].params.top_k < vocab]
        for rows, draw in ((with_k, self._draw_top_k), (without_k, self._draw_all)):
            if rows:
                index = on_device(rows, device)
                part = logits[index]
                part = (part - part.max(dim=-1, keepdim=True).values) / temperature[index, None]  # entries <= 0
                tokens[index] = draw(part, [requests[i] for i in rows])
        return torch.where(greedy, greedy_tokens, tokens), status

    def _draw_top_k(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        k = on_device([r.params.top_k for r in requests], device)
        values, ids = logits.topk(max(r.params.top_k for r in requests), dim=-1)  # sorted, best first
        values = values.masked_fill(torch.arange(values.shape[1], device=device) >= k[:, None], float("-inf"))
        probs = _top_p_min_p(torch.softmax(values, dim=-1), requests)
        noise = torch.ones_like(probs)
        for row, request in enumerate(requests):
            noise[row, : request.params.top_k].exponential_(generator=self._generator(request, device))
        return ids.gather(1, (probs / noise).argmax(dim=-1, keepdim=True))[:, 0]

    def _draw_all(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        probs = torch.zeros_like(probs).scatter_(1, order, _top_p_min_p(sorted_probs, requests))
        noise = torch.empty_like(probs)
        for row, request in enumerate(requests):
            noise[row].exponential_(generator=self._generator(request, device))
        return (probs / noise).argmax(dim=-1)

    def _generator(self, request: Request, device: torch.device) -> torch.Generator:
        return request.device_generator(device) or self._shared_generator(device)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, wanted: list[int], top: int):
        index = on_device(wanted, raw.device)
        logprobs = torch.log_softmax(raw[index], dim=-1)
        chosen = logprobs.gather(1, tokens[index, None].clamp(0, raw.shape[1] - 1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], tokens[index, None][:, :0])
        return chosen[:, 0], ranks, values, ids


def sampling_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The normalized fp32 distribution [R, V] that `Sampler` draws row i from for requests[i] (temperature,
    top-k, top-p, min-p; no penalties, biases, bans or grammar: speculative decoding, its one user, takes
    only requests without those). A top-k row keeps every token tied with its k-th best."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([max(r.params.temperature, MIN_TEMPERATURE) for r in requests], device=device)
    x = logits.float()
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None]
    k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in requests], device=device)
    if bool((k < vocab).any()):
        values = x.topk(int(k.max()), dim=-1).values
        x = x.masked_fill(x < values.gather(1, (k - 1).clamp(max=values.shape[1] - 1)[:, None]), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    probs = torch.zeros_like(probs).scatter_(1, order, _top_p_min_p(sorted_probs, requests))
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_p_min_p(sorted_probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Rows of probabilities sorted best first, cut by each request's top-p, then min-p (not renormalized:
    the draw only compares them)."""
    device = sorted_probs.device
    if any(r.params.top_p < 1 for r in requests):
        top_p = on_device([r.params.top_p for r in requests], device, torch.float32)
        # keep the smallest prefix whose mass reaches top_p; the most likely token always stays
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    if any(r.params.min_p > 0 for r in requests):
        min_p = on_device([r.params.min_p for r in requests], device, torch.float32)
        sorted_probs = sorted_probs.masked_fill(sorted_probs < min_p[:, None] * sorted_probs[:, :1], 0.0)
    return sorted_probs


def _entries(token_id: int, top: int, chosen: float, rank: int, values: list[float], ids: list[int],
             decode) -> PositionLogprobs:
    entries = {token_id: Logprob(chosen, rank, decode(token_id))}
    for position, (value, tid) in enumerate(zip(values[:top], ids[:top]), start=1):
        entries.setdefault(tid, Logprob(value, position, decode(tid)))
    return entries
