"""The OpenAI wire shapes the server reads and writes, as pydantic models, and its error type.

Requests accept OpenAI's fields plus vLLM's sampling extras (`top_k`, `min_tokens`, `ignore_eos`,
`repetition_penalty`, ...); unknown fields are ignored, as vLLM does, except the OpenAI / vLLM fields
tierlm does not implement (`UNSUPPORTED_FIELDS`), which are refused when set to anything but "unused". Types are strict where OpenAI's schema is: a boolean is
`true`/`false`, an integer is a JSON integer, token ids are integers (no "3", 3.5 or true), and numbers
are finite (no NaN or Infinity literals). Numeric fields carry OpenAI's ranges (temperature [0, 2],
top_p (0, 1], n [1, 128], logprobs [0, 20], seed a 64-bit integer), so they are refused with a 400 and
are in the OpenAPI schema; `SamplingParams` checks the combinations. An integer written with a zero
fraction (`3.0`) is that integer, as JSON Schema reads it (so every schema-valid body is read as meant). Responses carry only what tierlm
fills in.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    model_serializer,
)

# ---- errors -------------------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
    413: "RequestTooLargeError", 422: "UnprocessableEntityError", 500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {
            "message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"), "param": self.param,
            "code": self.status,
        }}


# ---- requests -----------------------------------------------------------------------------------------

# OpenAI and vLLM request fields tierlm does not implement, with the value that means "not used": any
# other value is refused with a 400 naming the field (a client that sets one would be silently misled).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "early_stopping": (None, False), "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,),
    "spaces_between_special_tokens": (None, True), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "structured_outputs": (None,), "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0), "reasoning_effort": (None,), "functions": (None,), "function_call": (None,),
    "audio": (None,), "prediction": (None,), "web_search_options": (None,), "continue_final_message": (None, False),
    "chat_template": (None,), "documents": (None,), "mm_processor_kwargs": (None,), "verbosity": (None,),
}
CHAT_ONLY_UNSUPPORTED = {"echo": (None, False), "add_generation_prompt": (None, True),
                         "modalities": (None, ["text"])}


def unsupported_field(data: dict[str, Any], chat: bool) -> str | None:
    """The first field of a request body that asks for something tierlm does not do, or None."""
    fields = {**UNSUPPORTED_FIELDS, **(CHAT_ONLY_UNSUPPORTED if chat else {})}
    for name, unused in fields.items():
        if name in data and not any(data[name] == value and type(data[name]) is type(value) for value in unused
                                    if value is not None) and data[name] is not None:
            return name
    return None



class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """3.0 -> 3 (JSON Schema's "integer" includes numbers with a zero fraction); anything else as given."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(ge: int | None = None, le: int | None = None) -> Any:
    """The type of an integer field within [ge, le]: strict, 3.0 read as 3 (the bounds before the
    conversion, so that they reach the JSON schema as minimum / maximum)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


# a token id; the server's schema adds the vocabulary's end as its maximum (TOKEN_ID_MARK marks where)
TOKEN_ID_MARK = "x-tierlm-token-id"
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True}), BeforeValidator(_integral)]
StopTokenId = integer(ge=0)  # any id (no vocabulary bound): one that never comes never stops
NonEmptyText = Annotated[str, Field(min_length=1)]
# {token id (decimal text): bias}; no other keys (in the schema too: additionalProperties false)
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^\d+$")], Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema({"type": "object", "additionalProperties": False, "patternProperties": {
        r"^\d+$": {"type": "number", "minimum": -100, "maximum": 100}}}),
]
Seed = integer(ge=-(2**63), le=2**63 - 1)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaSpec(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: integer(ge=1, le=128) = 1
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1) | None = None
    min_tokens: integer(ge=0) = 0
    seed: Seed | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[StopTokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)  # unset: the model's generation_config
    logit_bias: LogitBias | None = None
    min_p: float = Field(0.0, ge=0, le=1)
    bad_words: list[NonEmptyText] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    user: str | None = None  # accepted and not used

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_form(value: Any) -> str | None:
    """Which of the four prompt forms a value is meant as, so errors speak of that form alone."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else None
        return "texts" if isinstance(first, str) else "batch" if isinstance(first, list) else "token_ids"
    return None


Prompt = Annotated[
    Annotated[NonEmptyText, Tag("text")]
    | Annotated[list[NonEmptyText], Field(min_length=1), Tag("texts")]
    | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[list[TokenIds], Field(min_length=1), Tag("batch")],
    Discriminator(_prompt_form, custom_error_type="prompt_form",
                  custom_error_message="a string, a list of strings, a list of token ids or a list of such lists"),
]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: integer(ge=0) | None = 16
    echo: bool = False
    logprobs: integer(ge=0, le=20) | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageUrl(_Request):
    url: str  # a data: URL (base64 image bytes); see server/images.py
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor's pixel bounds decide


class ImageUrlPart(_Request):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class _Message(_Request):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the chat template as given


class TurnMessage(_Message):
    role: Literal["system", "developer", "user", "tool"]
    content: str | list[ContentPart]
    tool_call_id: str | None = None  # a tool result: the call it answers


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text, as the model's answer gave it


class AssistantToolCall(_Request):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Message):
    """An assistant turn may omit its content (one that carries only tool calls)."""

    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning_content: str | None = None


ChatMessage = Annotated[TurnMessage | AssistantMessage, Field(discriminator="role")]


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


# OpenAI's rules between fields, in the schema too: top_logprobs (any value) needs logprobs: true;
# tool_choice "required" or a named function needs tools (a named one must also be among them: that, the
# schema cannot say)
CHAT_FIELD_RULES = [
    {"if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
     "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}},
    {"if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
            "required": ["tool_choice"]},
     "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}},
]


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": CHAT_FIELD_RULES})

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=20) | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- responses ----------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tierlm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """The legacy shape: parallel lists, one entry per token (None for the prompt's first token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _OmitNone(BaseModel):
    """Fields left None are left out (OpenAI's stream deltas carry only what changed)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A call's first delta has its id, type and name; later ones fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(_OmitNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
