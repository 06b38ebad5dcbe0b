"""What pipeline ranks say to each other (see `engine/pipeline.py` for the flow).

Rank 0 sends every other rank a `StepMessage` per step (or a control message: stats, echo, stop); the
last rank answers each step with a `StageResult`. Requests are named by a small integer key that rank 0
gives each request the first time its rows are sampled (`NewRequest` then carries what the last rank's
sampler mirrors), and takes back when the request is done (`StepMessage.released`).

Messages are pickled; tensors travel as numpy arrays (`BatchArrays`, the bitmask), which pickle as raw
bytes: a pickled torch tensor costs milliseconds to write and read, a numpy array microseconds. A decode
step that fits the static decode runners travels as `DecodeRows` (host lists, what
`StaticDecodeRunner.stage_decode` takes) instead of a whole batch.

What crosses ranks on the device (never through the host): each stage's output, packed with the batch's
token ids as one buffer (`pack_stage_output` / `unpack_stage_input`: the stages after the first take
their input ids from it, so an id sampled on the device reaches every rank without the host), and the
last rank's sampled ids and their statuses back to rank 0 (`sampled_ids_buffer`: one column per
sampling row, so the sampler's own [2, rows] result goes as it is): rank 0 reads a step's tokens there, and the last rank answers on the host (`StageResult`)
only a step whose requests report log-probabilities or whose rows failed (`reports_logprobs`).

Speculative decoding (`engine/pipeline_speculative.py`): a step's message also carries every chunk's
`DraftChunk` (its drafts, slots and blocks: what the last rank verifies and drafts from), and every such
step is answered on the host, with each request's accepted drafts and next drafts (`StageResult`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from tierlm.model.forward_batch import ForwardBatch


@dataclass
class BatchArrays:
    """A CPU `ForwardBatch` for the wire: its tensors as numpy arrays, its other fields as they are."""

    fields: dict

    @classmethod
    def of(cls, batch: ForwardBatch) -> BatchArrays:
        values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.init}
        return cls({k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    @property
    def num_tokens(self) -> int:
        return len(self.fields["token_ids"])

    def batch(self, device: torch.device) -> ForwardBatch:
        return ForwardBatch(**{k: torch.from_numpy(v).to(device, non_blocking=True) if isinstance(v, np.ndarray)
                               else v for k, v in self.fields.items()})


@dataclass
class DecodeRows:
    """A decode-only step as host lists, one row per request: positions, state slots, and each row's block
    list as what changed since the last decode step sent it (`BlockListChanges`): (request key, entries
    kept, entries after them). The input ids come with the hidden state."""

    positions: list[int]
    slots: list[int]
    tables: list[tuple[int, int, list[int]]]

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class BlockListChanges:
    """Rank 0's side of the block lists in `DecodeRows`: a request's list goes whole the first time (or when
    the request holds another list: preempted and readmitted), then only the blocks it gained, so a decode
    step's message does not grow with its context. (The cache manager only appends to a request's list,
    and gives it a new one when it frees its blocks: what the static decode runner counts on too.)"""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list[int], int]] = {}  # request key -> (its list object, entries sent)

    def change(self, key: int, blocks: list[int]) -> tuple[int, int, list[int]]:
        held = self._sent.get(key)
        kept = held[1] if held is not None and held[0] is blocks and held[1] <= len(blocks) else 0
        self._sent[key] = (blocks, len(blocks))
        return key, kept, blocks[kept:]

    def forget(self, keys: list[int]) -> None:
        for key in keys:
            self._sent.pop(key, None)


class BlockLists:
    """The other ranks' side: each request's block list rebuilt from the changes, one list object per
    request while it only grows (the static decode runner then sends only its new entries to the device:
    `StaticDecodeRunner.stage_decode`), a new object when it was sent whole."""

    def __init__(self) -> None:
        self._lists: dict[int, list[int]] = {}

    def apply(self, tables: list[tuple[int, int, list[int]]]) -> list[list[int]]:
        out = []
        for key, kept, new in tables:
            if kept == 0:
                blocks = self._lists[key] = list(new)
            else:
                blocks = self._lists[key]
                if len(blocks) != kept:
                    raise RuntimeError(f"request key {key}: {len(blocks)} blocks held, rank 0 counts on {kept}")
                blocks.extend(new)
            out.append(blocks)
        return out

    def forget(self, keys: list[int]) -> None:
        for key in keys:
            self._lists.pop(key, None)


def _ids_offset(num_tokens: int, width: int, dtype: torch.dtype) -> int:
    """Where the ids start in a packed stage output: after the hidden state, 8-byte aligned."""
    return -(-num_tokens * width * dtype.itemsize // 8) * 8


def stage_buffer(num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty buffer for a packed stage output of `num_tokens` rows (what the next stage receives)."""
    return torch.empty(_ids_offset(num_tokens, width, dtype) + 8 * num_tokens, dtype=torch.uint8, device=device)


def pack_stage_output(hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """One buffer holding a stage's output [N, width] and the batch's input ids [N] (copies queued on the
    device: the result owns its bytes, so a CUDA graph's output buffer may be reused at once)."""
    rows, width = hidden.shape
    buffer = stage_buffer(rows, width, hidden.dtype, hidden.device)
    hidden_out, ids_out = unpack_stage_input(buffer, rows, width, hidden.dtype)
    hidden_out.copy_(hidden)
    ids_out.copy_(token_ids)
    return buffer


def unpack_stage_input(buffer: torch.Tensor, num_tokens: int, width: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed stage output: the hidden state [N, width] and the input ids [N] (int64)."""
    offset = _ids_offset(num_tokens, width, dtype)
    hidden = buffer[: num_tokens * width * dtype.itemsize].view(dtype).view(num_tokens, width)
    return hidden, buffer[offset : offset + 8 * num_tokens].view(torch.int64)


ROW_FAILED = 3  # a sampled row's status: its preparation failed on the last rank (the sampler's: 0 ok, 1 NaN, 2 masked)


def sampled_ids_buffer(rows: int, device: torch.device, zeroed: bool = True) -> torch.Tensor:
    """The last rank's sampled ids of one step [2, max(rows, 1)] (both ranks know `rows`, the step's
    sampling rows; a step with none sends one unused column): row 0 the ids, row 1 each row's status (0:
    sampled), column k the k-th sampling chunk's; zeros until written. zeroed False: uninitialised (rank
    0's, which the receive fills whole: no fill on every step)."""
    shape = (2, max(rows, 1))
    return (torch.zeros if zeroed else torch.empty)(shape, dtype=torch.int64, device=device)


def reports_logprobs(params) -> bool:
    """Whether a request (its `SamplingParams`) reports log-probabilities or prompt log-probabilities: a
    step with one (or with a row whose status is not 0) is answered on rank 0's host (`StageResult`); any
    other step's tokens are read from the sampled ids on rank 0's device, and the last rank sends no answer."""
    return params.logprobs is not None or params.prompt_logprobs is not None


@dataclass
class NewRequest:
    """What the last rank's sampler needs to mirror a request, sent once."""

    key: int
    request_id: str
    prompt_token_ids: list[int]
    params: object
    eos_token_ids: frozenset[int]
    max_model_len: int
    output_token_ids: list[int]
    has_grammar: bool
    bad_words_token_ids: list[list[int]]  # SamplingParams.bad_words, encoded


@dataclass
class SampleSpec:
    """One chunk's logits rows for the last rank: rows first .. first+count of the logits."""

    key: int
    first: int
    count: int
    start: int
    num_tokens: int
    samples: bool
    bitmask: np.ndarray | None = None  # structured output: the tokens allowed next (int32, packed bits)


@dataclass
class DraftChunk:
    """Speculative decoding: one chunk of a step as the last rank verifies and drafts from it (every chunk of
    the step, in batch order; rank 0's slot and block numbers)."""

    key: int
    start: int
    num_tokens: int
    samples: bool
    draft_token_ids: list[int]
    state_slot: int
    home_slot: int
    block_ids: list[int]


@dataclass
class StepMessage:
    kind: str = "step"  # step | answer (read the unread step back and answer it) | stats | echo | stop
    step: int = 0  # rank 0's count of the steps it launched (its answer, if any, names it)
    batch: BatchArrays | None = None
    decode: DecodeRows | None = None  # instead of `batch`: a decode step the static runners take
    cache_ops: list[tuple[str, tuple]] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    echo_shape: tuple[int, ...] | None = None  # kind "echo": a tensor rank 1 sends straight back,
    echo_repeats: int = 0  # this many times
    drafts: list[DraftChunk] | None = None  # speculative decoding: every chunk (the step is answered)

    def __reduce__(self):
        """Pickled as plain tuples, rebuilt by `_step_message`: pickle writes a dataclass instance field by
        field through copyreg, 3x slower to write and to read than a tuple (~20 us each way for a decode
        step of 4 rows, on both ends of every step)."""
        decode = None if self.decode is None else (self.decode.positions, self.decode.slots, self.decode.tables)
        samples = [(s.key, s.first, s.count, s.start, s.num_tokens, s.samples, s.bitmask) for s in self.samples]
        # not dataclasses.astuple: it deep-copies every list (~100x slower)
        drafts = None if self.drafts is None else [
            (c.key, c.start, c.num_tokens, c.samples, c.draft_token_ids, c.state_slot, c.home_slot, c.block_ids)
            for c in self.drafts]
        return _step_message, (self.kind, self.step, self.batch, decode, self.cache_ops, self.new_requests,
                               self.released, samples, self.echo_shape, self.echo_repeats, drafts)


def _step_message(kind, step, batch, decode, cache_ops, new_requests, released, samples, echo_shape,
                  echo_repeats, drafts) -> StepMessage:
    return StepMessage(kind=kind, step=step, batch=batch, decode=None if decode is None else DecodeRows(*decode),
                       cache_ops=cache_ops, new_requests=new_requests, released=released,
                       samples=[SampleSpec(*spec) for spec in samples], echo_shape=echo_shape,
                       echo_repeats=echo_repeats, drafts=None if drafts is None else [DraftChunk(*c) for c in drafts])


@dataclass
class StageResult:
    """The last rank's answer to one step, by request key (only for a step that `reports_logprobs` or had a
    row fail; or the error that ended the last rank)."""

    step: int = 0  # the StepMessage.step it answers
    sampled: dict[int, int] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, dict] = field(default_factory=dict)
    cumulative_logprob: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    accepted: dict[int, list[int]] = field(default_factory=dict)  # speculative: drafts accepted before `sampled`
    next_drafts: dict[int, list[int]] = field(default_factory=dict)  # speculative: what the next step verifies
    error: str | None = None  # the step itself failed on the last rank
