"""One sequence being generated, in the counter model: `num_computed_tokens` catches up with `num_tokens`.

There is no prefill or decode phase: a step computes the next tokens up to a budget; when computed
equals total, the step's logits sample one more token. Prefix hits, chunked prefill and preemption
(computed reset to zero) are all changes to that one counter.

With overlap scheduling (engine/llm_engine.py) a token sampled by a step still running on the device is
counted at once as a `PLACEHOLDER` output id, so the next step can be scheduled around it (its input id
is taken from the device); the host fills it in when it reads that step's ids. Only the outputs before
the placeholders (`known_output_token_ids`) are text, logprobs or prefix-cache hashes.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierlm.model.vision.mrope import MropePositions
from tierlm.outputs import PositionLogprobs
from tierlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tierlm.engine.images import RequestImage
    from tierlm.engine.structured_output import GrammarState

PLACEHOLDER = -1  # an output id sampled by a step whose ids the host has not read yet


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # where its state lives; owned by the cache manager: home_slot the slot it gave the request, state_slot
    # the slot holding its state (home_slot, or under speculative decoding another of its row slots)
    home_slot: int | None = None
    state_slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain over its full blocks of tokens
    num_registered_blocks: int = 0  # of its blocks, how many the prefix cache has seen full
    decode_checkpoint: bytes | None = None  # the block hash of its latest decode-time state checkpoint
    num_cached_tokens: int = 0  # tokens the prefix cache supplied at its (latest) admission
    # sampling state
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # SamplingParams.bad_words, encoded
    generator: torch.Generator | None = None  # a seeded request's own, on the logits' device
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    paused: bool = False  # held back from scheduling (its client has not read its earlier outputs)
    structured_output: GrammarState | None = None  # the grammar matcher of a structured-output request
    draft_token_ids: list[int] = field(default_factory=list)  # speculative decoding: proposed next tokens
    draft_probs: torch.Tensor | None = None  # [K, V], the distributions they were drawn from (None: greedy)
    num_placeholders: int = 0  # trailing output ids still on the device (overlap scheduling)
    # the known output ids as int64 (the first `_output_ids_len` of a buffer grown by doubling)
    _output_ids: np.ndarray = field(default_factory=lambda: np.zeros(16, dtype=np.int64), init=False, repr=False)
    _output_ids_len: int = field(default=0, init=False, repr=False)
    # the prompt's ids as a token bitmask on a device, by (vocab, device): made once, read by the sampler's
    # repetition penalty each step
    prompt_bitmasks: dict = field(default_factory=dict, init=False, repr=False)
    # overlap scheduling: a decode checkpoint saved (in stream order) before the ids of its block were
    # known: (the block boundary it was taken at, its host row); the cache manager keys it later
    pending_checkpoint: tuple[int, int] | None = None
    # images in the prompt (engine/images.py): where each sits, its M-RoPE positions (None: a text
    # request), and the encoder features of images a prefill chunk reached but has not passed yet
    images: list[RequestImage] = field(default_factory=list)
    mrope: MropePositions | None = None
    image_features: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def device_generator(self, device: torch.device) -> torch.Generator | None:
        """A seeded request's generator on `device` (made on first use); None for an unseeded one."""
        if self.params.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        return self.generator

    @functools.cached_property
    def prompt_ids_array(self) -> np.ndarray:
        """The prompt's ids as an int64 array (made once: the sampler's repetition penalty reads it each step)."""
        return np.asarray(self.prompt_token_ids, dtype=np.int64)

    def known_output_ids_array(self) -> np.ndarray:
        """The known output ids (`known_output_token_ids`) as an int64 array, converted incrementally: those
        ids only ever grow at the end, so each step converts only the new ones (the sampler's penalties
        read them every step)."""
        known = len(self.output_token_ids) - self.num_placeholders
        if known < self._output_ids_len:  # not expected; rebuilt rather than trusted
            self._output_ids_len = 0
        if known > self._output_ids_len:
            if known > len(self._output_ids):
                self._output_ids = np.resize(self._output_ids, max(known, 2 * len(self._output_ids)))
            self._output_ids[self._output_ids_len : known] = self.output_token_ids[self._output_ids_len : known]
            self._output_ids_len = known
        return self._output_ids[:known]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the host has (all but the placeholders)."""
        return self.num_tokens - self.num_placeholders

    @property
    def known_output_token_ids(self) -> list[int]:
        """The output ids without the trailing placeholders (the list itself when there are none)."""
        if not self.num_placeholders:
            return self.output_token_ids
        return self.output_token_ids[: len(self.output_token_ids) - self.num_placeholders]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole sequence."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        if self.num_placeholders:
            raise RuntimeError(f"request {self.request_id}: a token appended behind {self.num_placeholders} "
                               "placeholder(s); fill them first")
        self.output_token_ids.append(token_id)
        self._took(token_id)

    def add_placeholder(self) -> None:
        """Count a token being sampled on the device (its id is filled in by `fill_placeholder`)."""
        self.output_token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def fill_placeholder(self, token_id: int) -> None:
        """The oldest placeholder's sampled id, then the checks of `append_token` (a request that this
        token finishes drops the later placeholders: `finish`)."""
        if not self.num_placeholders:
            raise RuntimeError(f"request {self.request_id}: no placeholder to fill")
        index = len(self.output_token_ids) - self.num_placeholders
        self.output_token_ids[index] = token_id
        self.num_placeholders -= 1
        self._took(token_id, index + 1)

    def _took(self, token_id: int, n_out: int | None = None) -> None:
        """Stop checks after output token number n_out (default: the last) was sampled as token_id."""
        if self.structured_output is not None:
            if not self.structured_output.accept(token_id):  # not expected: the sampler masks the rest
                self.finish(RequestStatus.FINISHED_ERROR, "structured output: the grammar rejected the token")
                return
            if self.structured_output.is_terminated:  # the JSON is complete and a stop token followed
                self.finish(RequestStatus.FINISHED_STOPPED)
                return
        n_out = len(self.output_token_ids) if n_out is None else n_out
        if n_out >= self.params.min_tokens:
            if token_id in self.params.stop_token_ids:
                self.finish(RequestStatus.FINISHED_STOPPED, token_id)
                return
            if not self.params.ignore_eos and token_id in self.eos_token_ids:
                self.finish(RequestStatus.FINISHED_STOPPED)
                return
        if self.params.max_tokens is not None and n_out >= self.params.max_tokens or self.num_prompt_tokens + n_out >= self.max_model_len:
            self.finish(RequestStatus.FINISHED_LENGTH)

    def drop_output_after(self, count: int) -> None:
        """Keep only the first `count` output tokens of a finished request (a stop string completed by an
        earlier token of the same step's accepted drafts)."""
        if not self.is_finished:
            raise RuntimeError(f"request {self.request_id}: output dropped while it runs")
        del self.output_token_ids[count:]

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End the request; tokens still on the device (placeholders) are discarded."""
        self.status = status
        self.stop_reason = stop_reason
        del self.output_token_ids[len(self.output_token_ids) - self.num_placeholders :]
        self.num_placeholders = 0
        self.image_features.clear()
