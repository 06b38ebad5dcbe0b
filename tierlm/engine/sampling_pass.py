"""The device side of a step's sampling pass: every row at once, in a fixed number of launches whatever
the batch, on fixed shapes, so that CUDA replays it from a graph per shape (engine/sampler_graphs.py).

`PackedPlan` packs a `RowPlan` (engine/sampling_plan.py) in two host arrays, integers and floats, whose
layout is its `PassShape`: the sparse edits and top-k ranks padded to a power of two, so the shapes repeat
from step to step. `sampling_pass` then, on the logits' device:
- penalties on the ids a request has seen: repetition on prompt and output (vLLM's rule: positive logits
  divided, negative multiplied), frequency and presence on the output (OpenAI's rule). The output
  entries are read and written by flat index; the prompt's through its token bitmask, made once per
  request on the device (`prompt_bitmasks`), so a step sends no prompt ids. Under overlap scheduling a
  request's last output id may still be on the device: the pass reads it from the step in flight's
  sampled ids;
- `logit_bias`, bans, the bitmask in one masked pass (xgrammar's `apply_token_bitmask_inplace`);
- then greedy rows take the argmax, top-k rows draw among their k best (one topk; ties ranked by lower
  id whatever the batch), the others over the vocabulary, each scaled by its temperature and cut by
  top-p (float64 mass sums) and min-p;
- and, when a row asks, every row's log-probabilities of the raw model distribution (as vLLM reports by
  default).
A draw is an exponential race (argmax of p / E, E ~ Exp(1)) whose noise is a hash of the row's key and
the candidate (`sampling_noise`): a seeded request's key comes from its seed and output position, so it
is reproducible whatever else is in the batch; no generator, no launch per row. `sampler_reference.py`
is the same pass written row by row (the tests hold them equal). `sampling_probs` is the distribution a
row draws from (speculative verification's target); `greedy_readback` what the decode graphs compute
for plain greedy rows.

Numerics, whatever the parameters (each limit is documented in the README):
- the row's maximum is subtracted before dividing by the temperature, so no scaled logit is above 0 and
  none can overflow; a row whose maximum is +inf takes that token;
- top-p always keeps the most likely token (a top_p below the smallest fp32 counts as that), and a row
  whose top_p is 1 is never cut (its cumulative sum may round past 1);
- a row with NaN, or with every token masked, has that status (`STATUS_NAN`, `STATUS_MASKED`): the
  sampler fails that request alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampling_noise import exponential_noise, exponential_noise_np
from tierlm.engine.sampling_plan import RowPlan, allowed_bitmask, plan_rows
from tierlm.model.forward_batch import on_device

STATUS_OK, STATUS_NAN, STATUS_MASKED = 0, 1, 2  # a row's status, beside its token


TIE_MARGIN = 8  # a top-k draw's topk takes this many more, so ties at the k-th place are ranked by id


def _top_p_bounds(top_p: np.ndarray) -> np.ndarray:
    """top_p as the cut compares it: a row at 1 is never cut, whatever the others' (cumulative sums can
    round past 1), and none is below the smallest positive float32 (the first token, with mass 0 before
    it, always stays)."""
    return np.where(top_p < 1, np.maximum(top_p, np.finfo(np.float32).smallest_subnormal), np.inf)


def _bucket(count: int) -> int:
    """The padded length of `count` entries: 0, or a power of two from 16. The pass's shapes (and so its
    CUDA graphs) change with the bucket, not with every count."""
    return 0 if count == 0 else max(16, 1 << (count - 1).bit_length())


def _padded(array: np.ndarray, size: int, fill) -> np.ndarray:
    if size == len(array):
        return array
    out = np.full(size, fill, dtype=array.dtype)
    out[: len(array)] = array
    return out


_NO_PENALTIES = np.array([[1, 0, 0]], dtype=np.float32)  # the padded entries' row (the slot past the logits)


@dataclass(frozen=True)
class PassShape:
    """What fixes a sampling pass's work besides its input values: the rows and vocabulary, which parts run
    (penalties, biases, bans, the bitmask; draws over the vocabulary, over ranks; the top-p and min-p cuts),
    the padded sizes of the sent arrays (by name) and the log-probabilities' width (None: none asked for).
    Passes of one shape are one CUDA graph (`SamplingGraphs`)."""

    rows: int
    vocab: int
    ints: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) of each integer array, in the sent order
    floats: tuple[tuple[str, tuple[int, ...]], ...]
    pending: int  # output ids read on the device from the step in flight's sampled ids (padded)
    previous: int  # how many ids that step sampled (0: none read)
    prompts: bool  # some row's repetition penalty counts its prompt's ids (the prompts' bitmasks, [rows, words])
    bitmask: bool
    edited: bool  # any penalty, bias, ban or mask (`RowPlan.edited`)
    sampling: bool  # any row draws (else every row takes its argmax)
    full: bool  # some row draws over the vocabulary (computed for every row, taken for those)
    k_max: int  # ranks drawn among by top-k rows (0: none)
    cut_p: bool
    cut_min: bool
    logprobs: int | None  # top log-probabilities per row (None: no row asks for any)


class PackedPlan:
    """A plan's arrays as the pass reads them, packed in one host array of int64 words (`words`: the
    integers, then the float32 values two a word; one copy up) whose layout is its `PassShape`: the
    sparse edits padded to their `_bucket` with index rows * vocab (a slot past the logits that the pass
    writes and never reads; its penalties row is (1, 0, 0), its bias 0), top-k ranks to a bucket too (a
    rank past a row's k is cut). `_Views` names the parts of their device copy."""

    def __init__(self, plan: RowPlan, logprobs: int | None = None, previous: int = 0) -> None:
        """previous: how many ids the step in flight sampled (the plan's pending ids are among them)."""
        rows, vocab = len(plan.greedy), plan.vocab
        past = rows * vocab
        sampled = plan.sampled_rows
        any_sampled = bool(sampled.any())
        top_k_rows = plan.top_k_rows
        outputs = _padded(plan.output_flat, _bucket(len(plan.output_flat)), past)
        bias = _bucket(len(plan.bias_flat))
        pending = _bucket(len(plan.pending_rows))
        ints = {"pending_base": _padded(plan.pending_rows * vocab, pending, past),
                "pending_sources": _padded(plan.pending_sources, pending, 0),
                "output_flat": outputs, "bias_flat": _padded(plan.bias_flat, bias, past),
                "ban_flat": _padded(plan.ban_flat, _bucket(len(plan.ban_flat)), past)}
        floats = {"bias_values": _padded(plan.bias_values, bias, 0)}
        if len(outputs) or pending or plan.repeated:  # read by the penalties alone
            floats["penalties"] = np.concatenate([plan.penalties, _NO_PENALTIES])
        k_max = min(_bucket(int(plan.top_k[top_k_rows].max(initial=0))), vocab) if any_sampled else 0
        if any_sampled:
            ints.update(keys=plan.keys.view(np.int64), is_top_k=top_k_rows, greedy=plan.greedy)
            floats.update(temperature=plan.temperature, top_p=_top_p_bounds(plan.top_p), min_p=plan.min_p)
            if k_max:
                k = np.where(top_k_rows, plan.top_k, k_max)
                floats.update(noise_k=exponential_noise_np(plan.keys, k_max),  # by rank
                              rank_cut=np.where(np.arange(k_max) < k[:, None], 0, -np.inf))
        floats_packed = _packed(floats, np.float32)
        # whole int64 words, at least one (an empty slice of the words cannot be viewed as floats)
        floats_packed = _padded(floats_packed, max(2, len(floats_packed) + len(floats_packed) % 2), 0)
        self.words = np.concatenate([_packed(ints, np.int64), floats_packed.view(np.int64)])
        self.shape = PassShape(
            rows, vocab, _layout(ints), _layout(floats), pending, previous if pending else 0, bool(plan.repeated),
            plan.bitmask is not None, plan.edited, any_sampled,
            any_sampled and bool((sampled & (plan.top_k == 0)).any()), k_max,
            any_sampled and bool((plan.top_p[sampled] < 1).any()), any_sampled and bool((plan.min_p[sampled] > 0).any()),
            logprobs)


def _layout(arrays: dict[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, array.shape) for name, array in arrays.items())


def _packed(arrays: dict[str, np.ndarray], dtype) -> np.ndarray:
    return np.concatenate([a.ravel() for a in arrays.values()], dtype=dtype, casting="unsafe")


class _Views:
    """The parts of a device copy of `PackedPlan.words`, by name (`PassShape.ints` / `.floats`)."""

    def __init__(self, shape: PassShape, words: torch.Tensor) -> None:
        int_sizes = [int(np.prod(size)) for _, size in shape.ints]
        float_sizes = [int(np.prod(size)) for _, size in shape.floats]
        ints = words[: sum(int_sizes)]
        floats = words[sum(int_sizes) :].view(torch.float32)[: sum(float_sizes)]
        for layout, sizes, flat in ((shape.ints, int_sizes, ints), (shape.floats, float_sizes, floats)):
            for (name, size), view in zip(layout, flat.split_with_sizes(sizes), strict=True):
                setattr(self, name, view.view(size))


def edit_logits(logits: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """`logits` (fp32 [rows, vocab]) after the plan's penalties, biases, bans and bitmask (a new tensor
    when any; `logits` itself when none)."""
    packed = PackedPlan(plan)
    words, bitmask, prompts = _sent(packed, plan, logits.device)
    return _edited(logits, packed.shape, _Views(packed.shape, words), bitmask, prompts=prompts)


def _sent(packed: PackedPlan, plan: RowPlan, device: torch.device, prompts: list[torch.Tensor] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """An eager pass's inputs on `device`: the packed words, the bitmask, the rows' prompt bitmasks
    stacked (`prompt_bitmasks`, made here unless given); through pinned memory on CUDA, without waiting."""
    bitmask = plan.bitmask
    if bitmask is not None and device.type == "cuda":
        bitmask = bitmask.to(device, non_blocking=True)
    if prompts is None:
        prompts = prompt_bitmasks(plan, device)
    return on_device(packed.words, device), bitmask, None if prompts is None else torch.stack(prompts)


def prompt_bitmasks(plan: RowPlan, device: torch.device) -> list[torch.Tensor] | None:
    """Each row's prompt ids as a token bitmask on `device` ([ceil(vocab / 32)] int32, xgrammar's layout),
    for the rows whose repetition penalty counts them (their request's, made once and kept on it; a
    zero row for the others); None when no row has one."""
    if not plan.repeated:
        return None
    words = (plan.vocab + 31) // 32
    rows = [_zero_words(words, device)] * len(plan.greedy)
    for i, request in plan.repeated:
        mask = request.prompt_bitmasks.get((plan.vocab, device))
        if mask is None:
            mask = allowed_bitmask(request.prompt_ids_array, plan.vocab, words)
            if device.type == "cuda":  # pinned, without waiting for the stream (once per request)
                mask = mask.pin_memory().to(device, non_blocking=True)
            request.prompt_bitmasks[(plan.vocab, device)] = mask
        rows[i] = mask
    return rows


@functools.lru_cache(maxsize=8)
def _zero_words(words: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(words, dtype=torch.int32, device=device)


def _unpacked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool of a [rows, words] token bitmask (token t: bit t % 32 of word t // 32)."""
    ids = torch.arange(vocab, device=bitmask.device)
    return ((bitmask[:, ids >> 5] >> (ids & 31)) & 1).bool()


def _repeated(values: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """The repetition penalty (vLLM's rule): positive values divided by it, negative ones multiplied."""
    return torch.where(values > 0, values / repetition, values * repetition)


def _edited(logits: torch.Tensor, shape: PassShape, sent: _Views, bitmask: torch.Tensor | None,
            previous: torch.Tensor | None = None, prompts: torch.Tensor | None = None) -> torch.Tensor:
    """`edit_logits` on sent views: flat indices into every row at once (a padded index points one past
    the logits, at a slot the pass drops), the bitmask in one pass. previous: the step in flight's
    sampled ids, where the pending output ids are read; prompts: the rows' prompt bitmasks."""
    if not shape.edited:
        return logits
    flat = torch.nn.functional.pad(logits.view(-1), (0, 1))  # a copy, with the slot padded indices write
    x = flat[:-1].view(logits.shape)
    in_prompt = None
    if shape.prompts:  # the repetition penalty on every prompt id of its rows, in place
        in_prompt = _unpacked(prompts, shape.vocab)
        x.copy_(torch.where(in_prompt, _repeated(x, sent.penalties[:-1, :1]), x))
    if shape.pending or len(sent.output_flat):
        outputs = sent.output_flat
        if shape.pending:  # row * vocab + the id sampled for it (padded: the slot past)
            base = sent.pending_base
            outputs = torch.cat([torch.where(base < len(flat) - 1, base + previous[sent.pending_sources], base),
                                 outputs])
        _penalize(flat, shape.vocab, outputs, sent.penalties, in_prompt)
    if len(sent.bias_flat):
        flat.index_put_((sent.bias_flat,), sent.bias_values, accumulate=True)
    if len(sent.ban_flat):
        flat.index_fill_(0, sent.ban_flat, float("-inf"))
    if bitmask is not None:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(x, bitmask)
    return x


def sample_rows(logits: torch.Tensor, plan: RowPlan, previous: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token per row, status per row) of fp32 `logits` [rows, vocab] on their device, every row at once
    (previous: the ids the step in flight sampled, for the plan's pending rows). Queues work only: no
    value is read back."""
    packed = PackedPlan(plan, previous=0 if previous is None else len(previous))
    ids = eager_pass(packed, plan, logits, previous)[0]
    return ids[0], ids[1]


def eager_pass(packed: PackedPlan, plan: RowPlan, logits: torch.Tensor, previous: torch.Tensor | None = None,
               prompts: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """`sampling_pass` launched op by op on fp32 `logits` (its inputs sent up here: `_sent`)."""
    words, bitmask, stacked = _sent(packed, plan, logits.device, prompts)
    return sampling_pass(packed.shape, logits, words, bitmask, previous, stacked)


def sampling_pass(shape: PassShape, logits: torch.Tensor, words: torch.Tensor, bitmask: torch.Tensor | None,
                  previous: torch.Tensor | None = None, prompts: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, ...]:
    """The pass on fixed shapes (what a CUDA graph captures): `edit_logits`, then greedy rows the argmax
    and the others their draw (top-k rows over their k best, the rest over the vocabulary). Returns
    [2, rows] (ids, statuses), then, when shape.logprobs is not None, the raw logits' log-probabilities:
    the sampled token's, its rank, the top values and ids (every row)."""
    sent = _Views(shape, words)
    x = _edited(logits, shape, sent, bitmask, previous, prompts)
    top, greedy_tokens, status = argmax_status(x, logits)
    tokens = greedy_tokens
    if shape.sampling:
        candidates = _Candidates(x, top, greedy_tokens, shape, sent)
        if candidates.full is not None:  # noise keyed by token id
            noise = exponential_noise(sent.keys, torch.arange(x.shape[1], device=x.device))
            tokens = (candidates.full / noise).argmax(dim=-1)
        if candidates.ranked is not None:  # noise by rank
            rank = (candidates.ranked / sent.noise_k).argmax(dim=-1, keepdim=True)
            drawn = candidates.ranked_ids.gather(1, rank)[:, 0]
            tokens = torch.where(sent.is_top_k.bool(), drawn, tokens) if candidates.full is not None else drawn
        argmax = _takes_argmax(top, sent) | (status != STATUS_OK)  # a failed row's token is never used
        tokens = torch.where(argmax, greedy_tokens, tokens)
    ids = torch.stack([tokens, status])
    return (ids,) if shape.logprobs is None else (ids, *_logprobs(logits, tokens, shape.logprobs))


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """Every row's log-probabilities of the raw logits: the token's, its rank (1-based), the `top` best
    values and ids."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None].clamp(0, raw.shape[1] - 1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen[:, 0], ranks, values, ids


def _takes_argmax(top: torch.Tensor, sent: _Views) -> torch.Tensor:
    """[rows] bool: the rows whose token is the argmax, not a draw: greedy ones, and those whose maximum is
    +inf."""
    return (top == float("inf")) | sent.greedy.bool()


class _Candidates:
    """What a pass's sampled rows draw among, and with which probabilities (cut by top-p and min-p, not
    renormalized: a draw only compares them): `sampling_pass` races its noise against them, `sampling_probs`
    returns them. Every row over the vocabulary when some row draws so (`full`, [rows, vocab] by token id;
    read for rows without top-k alone); every row over its k_max best (`ranked`, [rows, k_max] best first,
    ids `ranked_ids`; a top-k row's probabilities are 0 past its k; read for top-k rows alone).
    `full` / `ranked` are None when no row draws that way."""

    def __init__(self, x: torch.Tensor, top: torch.Tensor, greedy_tokens: torch.Tensor, shape: PassShape,
                 sent: _Views) -> None:
        top_p, min_p = (sent.top_p if shape.cut_p else None), (sent.min_p if shape.cut_min else None)
        self.full = self.ranked = self.ranked_ids = None
        if shape.full:
            self.full = _full_probs(x, top, sent.temperature, top_p, min_p, greedy_tokens)
        if shape.k_max:
            self.ranked, self.ranked_ids = _top_k_probs(x, top, sent.temperature, top_p, min_p, sent.rank_cut,
                                                        shape.k_max)


def argmax_status(x: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's maximum and argmax of the edited logits `x`, and its status (NaN in the raw `logits`, or
    every token masked)."""
    top, greedy_tokens = x.max(dim=-1)  # max and argmax propagate NaN
    nan = torch.isnan(top if x is logits else logits.amax(dim=-1))
    return top, greedy_tokens, torch.where(nan, STATUS_NAN, torch.where(top == float("-inf"), STATUS_MASKED, STATUS_OK))


def greedy_readback(logits: torch.Tensor, out: torch.Tensor) -> None:
    """Each row's argmax and status into out [rows, 2] (`launch`'s pass for plain greedy rows, in the logits'
    own dtype): what a static decode graph computes after its forward, so that a step of plain greedy rows
    without log-probabilities is one replay and one small copy to the host (`Sampler.taken_argmax`)."""
    _, tokens, status = argmax_status(logits, logits)
    torch.stack([tokens, status], dim=1, out=out)


def _penalize(flat: torch.Tensor, vocab: int, outputs: torch.Tensor, penalties: torch.Tensor,
              in_prompt: torch.Tensor | None) -> None:
    """Repetition (`_repeated`) on every output id a row has, then frequency and presence (OpenAI) by its
    output counts, in place on the flat [rows * vocab] logits: only those entries (flat indices) are read
    and written (an id output twice writes the same value twice). in_prompt: [rows, vocab] bool, the ids
    whose repetition penalty the prompt's pass applied already."""
    ones = torch.ones((), dtype=flat.dtype, device=flat.device).expand(len(outputs))
    counts = torch.zeros_like(flat).scatter_add_(0, outputs, ones)  # atomics (exact: counts < 2^24)
    value, count = flat[outputs], counts[outputs]
    repetition, frequency, presence = penalties[outputs // vocab].unbind(dim=1)
    repeated = _repeated(value, repetition)
    if in_prompt is not None:  # (the slot past the logits reads the last entry: its write is dropped)
        repeated = torch.where(in_prompt.view(-1)[outputs.clamp(max=in_prompt.numel() - 1)], value, repeated)
    flat[outputs] = repeated - (frequency * count + presence * (count > 0))


def best_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of each row's k largest, best first, equal values by lower id: what a stable sort of the
    row gives, whatever the batch (topk alone leaves the order of ties, and which of a tie at the k-th
    place stays, to its algorithm). topk takes `TIE_MARGIN` more than k, then the slice is sorted by id
    and stably by value; a tie that runs past k + TIE_MARGIN keeps topk's choice."""
    values, ids = x.topk(min(k + TIE_MARGIN, x.shape[1]), dim=-1)
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids.gather(1, order)[:, :k]


def _top_k_probs(x, top, temperature, top_p, min_p, rank_cut, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, ids) of every row's k best (`best_first`; rank_cut: -inf past its k): scaled by its
    temperature below its maximum, softmax, top-p and min-p on the sorted slice."""
    values, ids = best_first(x, k_max)
    probs = torch.softmax((values - top[:, None]) / temperature[:, None] + rank_cut, dim=-1)
    return _cut_top_p_min_p(probs, top_p, min_p), ids


def _full_probs(x, top, temperature, top_p, min_p, greedy_tokens) -> torch.Tensor:
    """Every row's probabilities over the whole vocabulary, by token id: top-p sorts the rows (stably: ties
    by id, whatever the batch), min-p compares with the argmax's probability."""
    probs = torch.softmax((x - top[:, None]) / temperature[:, None], dim=-1)
    threshold = None if min_p is None else min_p[:, None] * probs.gather(1, greedy_tokens[:, None])
    if top_p is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        probs = torch.zeros_like(probs).scatter_(1, order, _cut_top_p_min_p(sorted_probs, top_p, None))
    if threshold is not None:
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def sampling_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The normalized fp32 distribution [R, V] that `sample_rows` draws row i from for requests[i], given
    logits already through `edit_logits` (speculative decoding, its one user, applies the penalties and
    grammar masks first, `speculative_constraints.verify_logits`; no request with biases or bans): the sampler's own
    candidates and cuts (`_Candidates`), so a top-k row keeps its k best with ties by lower id; a row the
    sampler takes the argmax of (greedy, or a +inf maximum) is one-hot there."""
    x = logits.float()
    keys = np.zeros(len(requests), dtype=np.uint64)  # no draw here
    plan = plan_rows(requests, x.shape[1], keys, grammars=False)  # the logits are masked already
    packed = PackedPlan(plan)
    top, greedy_tokens = x.max(dim=-1)
    one_hot = torch.zeros_like(x).scatter_(1, greedy_tokens[:, None], 1.0)
    if not packed.shape.sampling:
        return one_hot
    views = _Views(packed.shape, on_device(packed.words, x.device))
    candidates = _Candidates(x, top, greedy_tokens, packed.shape, views)
    probs = torch.zeros_like(x) if candidates.full is None else candidates.full
    if candidates.ranked is not None:
        ranked = torch.zeros_like(x).scatter_(1, candidates.ranked_ids, candidates.ranked)
        probs = torch.where(views.is_top_k.bool()[:, None], ranked, probs)
    probs = torch.where(_takes_argmax(top, views)[:, None], one_hot, probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _cut_top_p_min_p(sorted_probs: torch.Tensor, top_p: torch.Tensor | None,
                     min_p: torch.Tensor | None) -> torch.Tensor:
    """Rows of probabilities sorted best first, cut by each row's top-p, then min-p (not renormalized:
    the draw only compares them)."""
    if top_p is not None:  # (`_top_p_bounds`)
        # keep the smallest prefix whose mass reaches top_p; the most likely token always stays
        sorted_probs = sorted_probs.masked_fill(_mass_before(sorted_probs) >= top_p[:, None], 0.0)
    if min_p is not None:
        sorted_probs = sorted_probs.masked_fill(sorted_probs < min_p[:, None] * sorted_probs[:, :1], 0.0)
    return sorted_probs


def _mass_before(sorted_probs: torch.Tensor) -> torch.Tensor:
    """Each entry's row mass before it, in float64 (the reference's sums; a float32 sum over a vocabulary
    rounds): one scan over every row at once, less the rows before (on CUDA a per-row scan of a few long
    rows takes one block each: 0.39 ms for 16 x 248,320 on an H200, against a few us for one long scan).
    A row that cannot be sampled (NaN) adds 0, so the rows after it are cut as alone."""
    p = sorted_probs.double()
    running = p.nan_to_num(nan=0.0).view(-1).cumsum(0).view(p.shape)
    return running - torch.nn.functional.pad(running[:-1, -1], (1, 0))[:, None] - p
