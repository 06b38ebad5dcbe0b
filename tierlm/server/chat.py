"""POST /v1/chat/completions: messages through the model's chat template, streaming or not.

The conversation is rendered with `add_generation_prompt=True` (plus any `chat_template_kwargs`) and
encoded with `add_special_tokens=False`, as `LLM.chat` does. Log-probabilities use the chat shape
(`logprobs.content[i]` with `top_logprobs`); `max_completion_tokens` wins over `max_tokens`, and with
neither the answer may run to the end of the context, as in vLLM.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tierlm.outputs import PositionLogprobs
from tierlm.server.async_engine import EnginePrompt
from tierlm.server.protocol import (
    ApiError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    TokenLogprob,
    TopLogprob,
)
from tierlm.server.serving import (
    ChoiceDelta,
    ServingContext,
    check_model,
    check_room,
    clamp,
    collect,
    decoded,
    deltas,
    sampling_params,
    sse_events,
    submit,
    usage,
)
from tierlm.tokenizer import Tokenizer


async def create_chat_completion(
    request: ChatCompletionRequest, ctx: ServingContext, http_request: Request
) -> Response:
    check_model(request, ctx)
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    messages = [message.model_dump() for message in request.messages]
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, template_kwargs=request.chat_template_kwargs
        )
    except ValueError as exc:  # ChatTemplateError: no template, a message it refuses, ...
        param = "chat_template_kwargs" if str(exc).startswith("chat_template_kwargs") else "messages"
        raise ApiError(400, str(exc), param) from None
    prompts = [EnginePrompt(ctx.tokenizer.encode(text, add_special_tokens=False), text)]
    max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, max_param)
    check_room(len(prompts[0].token_ids), max_tokens, ctx, max_param)
    top = request.top_logprobs or 0
    params = sampling_params(
        request, max_tokens=max_tokens, logprobs=top if request.logprobs else None, prompt_logprobs=None
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await submit(ctx, request_id, prompts, params, "messages")
    if request.stream:
        chunks = _chunks(request, ctx, request_id, prompts, deltas(stream, request.n, True))
        return StreamingResponse(sse_events(chunks), media_type="text/event-stream")
    results = await collect(http_request, stream, request.n, True)
    choices = [
        ChatChoice(
            index=r.index, message=ChatMessageOut(content=r.text), finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, logprobs=_logprobs(ctx.tokenizer, r.token_ids, r.logprobs, top),
        )
        for r in results
    ]
    response = ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices,
        usage=usage(prompts, sum(len(r.token_ids) for r in results)),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _chunks(
    request: ChatCompletionRequest, ctx: ServingContext, request_id: str, prompts: list[EnginePrompt],
    source: AsyncIterator[ChoiceDelta],
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=[choice])

    completion_tokens = 0
    async for d in source:
        if d.first:
            yield chunk(ChatChunkChoice(index=d.index, delta=ChatDelta(role="assistant", content="")))
        if d.text or d.token_ids or d.finish_reason:
            yield chunk(ChatChunkChoice(
                index=d.index, delta=ChatDelta(content=d.text), finish_reason=d.finish_reason,
                logprobs=_logprobs(ctx.tokenizer, d.token_ids, d.logprobs, request.top_logprobs or 0),
            ))
        completion_tokens += len(d.token_ids)
    if request.include_usage:
        yield ChatCompletionChunk(
            id=request_id, model=ctx.model_name, choices=[], usage=usage(prompts, completion_tokens)
        )


def _logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[PositionLogprobs] | None, top: int
) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        token = decoded(tokenizer, token_id, entries)
        best = sorted((e.rank, tid) for tid, e in entries.items() if e.rank <= top)
        content.append(TokenLogprob(
            token=token, logprob=clamp(entries[token_id].logprob), bytes=list(token.encode()),
            top_logprobs=[_top(tokenizer, tid, entries) for _, tid in best],
        ))
    return ChatLogprobs(content=content)


def _top(tokenizer: Tokenizer, token_id: int, entries: PositionLogprobs) -> TopLogprob:
    token = decoded(tokenizer, token_id, entries)
    return TopLogprob(token=token, logprob=clamp(entries[token_id].logprob), bytes=list(token.encode()))
