"""`SamplingParams`: how one request is decoded, with vLLM's names, defaults and validation.

`temperature`, `top_p` and `top_k` left as None take the model's generation_config.json values (as
vLLM does with `--generation-config auto`), else 1.0 / 1.0 / off. Every invalid value raises a
`ValueError` that names the parameter, which the server turns into an HTTP 400.
`structured_output` constrains the output to JSON (the engine compiles it with xgrammar, see
`tierlm.engine.structured_output`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a running request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: the whole text, every token and logprob (the offline API)
    DELTA = 1  # only what is new since the last output (the server: its queues hold no repeated copies)


@dataclass(frozen=True)
class StructuredOutputRequest:
    """Constrain output: to any JSON object (`json_object`), to JSON valid under `json_schema` (its text), or
    to an xgrammar `structural_tag` (its JSON text: the server's tool calls in a parser's format).

    With `reasoning_end_token_id` (and the prompt having opened a reasoning block) the constraint starts
    only after the reasoning: from the token after that end token.
    """

    json_schema: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        if (self.json_schema is not None) + self.json_object + (self.structural_tag is not None) != 1:
            raise ValueError("structured_output must set exactly one of json_schema, json_object and structural_tag")
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_output {name} must be JSON text, got {type(value).__name__}")

    @property
    def grammar_key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (not the reasoning fields): (kind, text)."""
        if self.json_object:
            return "json_object", ""
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return "json_schema", self.json_schema


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    # tokens of the prompt or output: positive logits / it, negative * it (unset: the model's
    # generation_config, else 1.0)
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    bad_words: list[str] | None = None  # words never generated (as tokens, with and without a leading space)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    structured_output: StructuredOutputRequest | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature is not None and not 0 <= self.temperature <= 100:
            fail("temperature", "must be in [0, 100]")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < -1):
            fail("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 20):
                fail(name, "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            fail("stop", "must be a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative token ids")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            fail("seed", "must be a 64-bit signed integer")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "must be a RequestOutputKind")
        structured = self.structured_output
        if structured is not None and not isinstance(structured, StructuredOutputRequest):
            fail("structured_output", "must be a StructuredOutputRequest")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(name, "must be in [-2, 2]")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty <= 10:
            fail("repetition_penalty", "must be in (0, 10]")
        if not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or any(
                not isinstance(t, int) or t < 0 or not -100 <= v <= 100 for t, v in bias.items()):
            fail("logit_bias", "must map token ids to values in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            fail("allowed_token_ids", "must be a non-empty list of token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            fail("bad_words", "must be a list of non-empty strings")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty not in (None, 1.0))

    def token_ids_used(self) -> list[tuple[str, int]]:
        """(parameter, token id) of the ids that steer sampling (the engine checks them against the vocab)."""
        named = [("logit_bias", t) for t in self.logit_bias or {}]
        return named + [("allowed_token_ids", t) for t in self.allowed_token_ids or ()]

    def with_defaults(
        self, temperature: float | None, top_p: float | None, top_k: int | None,
        repetition_penalty: float | None = None,
    ) -> SamplingParams:
        """A copy whose unset temperature / top_p / top_k / repetition_penalty take the model's defaults (its
        generation_config, as vLLM applies it), else the neutral values."""
        return dataclasses.replace(
            self,
            temperature=self.temperature if self.temperature is not None else (1.0 if temperature is None else temperature),
            top_p=self.top_p if self.top_p is not None else (1.0 if top_p is None else top_p),
            top_k=self.top_k if self.top_k is not None else (0 if top_k is None else top_k),
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else (
                1.0 if repetition_penalty is None else repetition_penalty),
        )
