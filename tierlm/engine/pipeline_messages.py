"""What pipeline ranks say to each other (see `engine/pipeline.py` for the flow).

Rank 0 sends every other rank a `StepMessage` per step (or a control message: stats, echo, stop); the
last rank answers each step with a `StageResult`. Requests are named by a small integer key that rank 0
gives each request the first time its rows are sampled (`NewRequest` then carries what the last rank's
sampler mirrors), and takes back when the request is done (`StepMessage.released`).

Messages are pickled; tensors travel as numpy arrays (`BatchArrays`, the bitmask), which pickle as raw
bytes: a pickled torch tensor costs milliseconds to write and read, a numpy array microseconds.
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
class StepMessage:
    kind: str = "step"  # step | stats | echo | stop
    batch: BatchArrays | None = None
    cache_ops: list[tuple[str, tuple]] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    samples: list[SampleSpec] = field(default_factory=list)
    echo_shape: tuple[int, ...] | None = None  # kind "echo": a tensor rank 1 sends straight back,
    echo_repeats: int = 0  # this many times


@dataclass
class StageResult:
    """The last rank's answer to one step, by request key."""

    sampled: dict[int, int] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, dict] = field(default_factory=dict)
    cumulative_logprob: dict[int, float] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    error: str | None = None  # the step itself failed on the last rank
