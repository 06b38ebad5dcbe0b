"""What the completions and chat handlers share: request checks, `SamplingParams` from an OpenAI request,
the text pool (chat templates, tokenization and grammar compilation run there, off the event loop, and
heap memory they freed is trimmed after big bodies), submitting to the engine with errors mapped to
HTTP, per-choice deltas of a running job, SSE framing.

Choice indexes follow vLLM: prompt i's completion j is choice `i * n + j`. A request with `max_tokens: 0`
(the prompt scored, nothing generated) runs with one token that is dropped from the answer.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from tierlm.engine.llm_engine import PromptTooLongError
from tierlm.outputs import PositionLogprobs, RequestOutput
from tierlm.sampling_params import SamplingParams, StructuredOutputRequest
from tierlm.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EnginePrompt,
    EngineRequestError,
    RequestStream,
)
from tierlm.server.images import ImageInputs
from tierlm.server.protocol import ApiError, ResponseFormat, SamplingRequest, UsageInfo
from tierlm.server.reasoning_parser import Qwen3ReasoningParser
from tierlm.server.tool_parsers import ToolParser
from tierlm.tokenizer import Tokenizer

logger = logging.getLogger("tierlm.server")

_T = TypeVar("_T")
_MALLOC_TRIM = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), "malloc_trim", None)  # glibc only

SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports this floor instead


@dataclass(frozen=True)
class ServingContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    text_pool: ThreadPoolExecutor  # chat templates, tokenization and grammar compilation: off the event loop
    tool_parser: type[ToolParser] | None = None  # --tool-call-parser
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: type[Qwen3ReasoningParser] | None = None  # --reasoning-parser
    max_n: int = 16  # --max-n
    images: ImageInputs | None = None  # how image_url parts are taken; None: the model has no vision tower

    async def off_loop(self, work: Callable[..., _T], *args: Any) -> _T:
        """Run CPU-heavy request preparation on the text pool; the event loop serves others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, work, *args)


def trim_heap() -> None:
    """Return the heap memory freed since the last trim to the OS (glibc keeps what threads free in their
    arenas); a no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready; its requests are aborted."""


# ---- checks and parameters ------------------------------------------------------------------------------


def check_request(request: SamplingRequest, ctx: ServingContext) -> None:
    """The model it names, and the server's limits."""
    if request.model is not None and request.model != ctx.model_name:
        raise ApiError(404, f"the model {request.model!r} does not exist here (this server serves {ctx.model_name!r})",
                       "model")
    if request.n > ctx.max_n:
        raise ApiError(400, f"n={request.n} is more than this server allows (--max-n {ctx.max_n})", "n")


def encode_prompt(ctx: ServingContext, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's ids; a prompt that cannot fit the context is refused here, before its ids are listed."""
    ids, count = ctx.tokenizer.encode_within(text, ctx.max_model_len - 1, add_special_tokens)
    if ids is None:
        raise ApiError(400, f"prompt has {count} tokens, but max_model_len is {ctx.max_model_len} (the prompt "
                       "plus at least one generated token must fit)", param)
    return ids


def check_room(num_prompt_tokens: int, max_tokens: int | None, ctx: ServingContext, param: str) -> None:
    """A prompt that fits must leave room for `max_tokens` (a prompt that does not fit is the engine's)."""
    if max_tokens is None or num_prompt_tokens >= ctx.max_model_len:
        return
    if num_prompt_tokens + max_tokens > ctx.max_model_len:
        raise ApiError(
            400,
            f"{param}={max_tokens} is too large: the prompt has {num_prompt_tokens} tokens and max_model_len "
            f"is {ctx.max_model_len}, so at most {ctx.max_model_len - num_prompt_tokens} tokens can follow",
            param,
        )


def sampling_params(
    request: SamplingRequest, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
    structured_output: StructuredOutputRequest | None,
) -> SamplingParams:
    try:
        return SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            max_tokens=max_tokens, min_tokens=request.min_tokens, seed=request.seed, stop=request.stop,
            stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty, min_p=request.min_p, bad_words=request.bad_words,
            allowed_token_ids=request.allowed_token_ids,
            logit_bias={int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None,
            structured_output=structured_output,
        )
    except ValueError as exc:  # the message starts with the parameter's name
        name = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), name if name in type(request).model_fields else None) from None


def response_format_request(response_format: ResponseFormat | None) -> StructuredOutputRequest | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputRequest(json_object=True)
    return StructuredOutputRequest(json_schema=json.dumps(response_format.json_schema.schema_))


async def compile_grammar(ctx: ServingContext, structured: StructuredOutputRequest | None, param: str) -> None:
    """Compile a request's grammar on the text pool (the engine thread then finds it compiled)."""
    if structured is None:
        return
    try:
        await ctx.off_loop(ctx.engine.engine.structured_outputs.compile, structured)
    except ValueError as exc:  # InvalidSchemaError
        raise ApiError(400, str(exc), param) from None


async def submit(
    ctx: ServingContext, request_id: str, prompts: list[EnginePrompt], params: SamplingParams,
    prompt_param: str,
) -> RequestStream:
    """Queue the prompts; the engine's refusals become HTTP errors."""
    try:
        return await ctx.engine.submit(request_id, prompts, params)
    except PromptTooLongError as exc:
        raise ApiError(400, str(exc), prompt_param) from None
    except ValueError as exc:  # an invalid schema (its message starts "json_schema"), an empty prompt ...
        param = "response_format" if str(exc).startswith("json_schema") else prompt_param
        raise ApiError(400, str(exc), param) from None
    except EngineRequestError as exc:
        raise ApiError(500, str(exc)) from None
    except EngineDeadError as exc:
        raise ApiError(503, str(exc)) from None


def decoded(tokenizer: Tokenizer, token_id: int, entries: PositionLogprobs | None) -> str:
    """A token's text as its log-probability entry spells it (decoded on its own, special tokens kept)."""
    entry = entries.get(token_id) if entries else None
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


# ---- running a job ----------------------------------------------------------------------------------


@dataclass
class ChoiceDelta:
    """What one choice gained since the last delta (the first delta of a choice may be empty)."""

    index: int
    output: RequestOutput  # the snapshot it came from: prompt ids, prompt text and prompt logprobs
    first: bool
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


async def deltas(stream: RequestStream, n: int, keep_output: bool) -> AsyncIterator[ChoiceDelta]:
    """Each choice's new text, tokens and logprobs, as the engine's deltas arrive.

    The engine holds back the text a stop string could still cut, so each delta is final as it comes.
    """
    finished: dict[int, bool] = {}  # choice -> whether its last delta was sent
    async for prompt_index, output in stream:
        for completion in output.outputs:
            index = prompt_index * n + completion.index
            first = index not in finished
            if finished.get(index):
                continue
            done = completion.finish_reason is not None
            text = completion.text if keep_output else ""
            token_ids = completion.token_ids if keep_output else []
            logprobs = None if completion.logprobs is None else (completion.logprobs if keep_output else [])
            if not (first or done or text or token_ids):
                continue
            finished[index] = done
            yield ChoiceDelta(
                index, output, first, text, token_ids, logprobs, completion.finish_reason, completion.stop_reason
            )


@dataclass
class ChoiceResult:
    """A finished choice: its deltas joined."""

    index: int
    output: RequestOutput
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


async def collect(http_request: Request, stream: RequestStream, n: int, keep_output: bool) -> list[ChoiceResult]:
    """Every choice of a job, by index; raises ClientDisconnected (aborting the job) if the client leaves."""

    async def run() -> list[ChoiceResult]:
        results: dict[int, ChoiceResult] = {}
        async for delta in deltas(stream, n, keep_output):
            results.setdefault(delta.index, ChoiceResult(delta.index, delta.output)).add(delta)
        return [results[i] for i in sorted(results)]

    return await _unless_disconnected(http_request, run())


async def _unless_disconnected(http_request: Request, work: Awaitable[Any]) -> Any:
    async def disconnected() -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # its stream closes, which aborts the job
    if task not in done:
        raise ClientDisconnected
    return task.result()


def usage(prompts: list[EnginePrompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


# ---- server-sent events -----------------------------------------------------------------------------


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Frame chunks as SSE, then `[DONE]`; a failure mid-stream becomes an error event first."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except ApiError as exc:
        yield sse(exc.body())
    except EngineRequestError as exc:
        yield sse(ApiError(500, str(exc)).body())
    except EngineDeadError as exc:
        yield sse(ApiError(503, str(exc)).body())
    except Exception as exc:  # the headers are sent: report it in the stream
        logger.exception("streaming a response failed")
        yield sse(ApiError(500, f"internal error: {exc}").body())
    yield SSE_DONE
