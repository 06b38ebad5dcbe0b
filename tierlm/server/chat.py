"""POST /v1/chat/completions: messages through the model's chat template, streaming or not, with tools and
reasoning.

The conversation is rendered with `add_generation_prompt=True`, the request's `tools`, `tool_choice` (as
served: "none", "auto", "required" or the named-function object) and `parallel_tool_calls` as template
variables (as transformers' apply_chat_template passes extra kwargs), then any `chat_template_kwargs` (which
win over those two, as in vLLM), and encoded with `add_special_tokens=False`, as `LLM.chat` does (on the
text pool, off the event loop). An assistant turn's tool-call arguments reach the template as objects when
they are JSON objects (templates write them with `tojson`). Log-probabilities use the chat shape
(`logprobs.content[i]` with `top_logprobs`); `max_completion_tokens` wins over `max_tokens`, and with
neither the answer may run to the end of the context, as in vLLM.

Tools (vLLM's rules): `tool_choice` defaults to "auto" with tools, "none" without. "auto" needs the server's
`--enable-auto-tool-choice` and `--tool-call-parser`: the parser reads calls out of free text. "required"
and a named function are enforced with a grammar (a structural tag in the parser's format, `hermes` when
none is configured), so even a random model answers with a valid call. A finished answer with calls has
finish_reason "tool_calls" (a named function: "stop", as OpenAI). `parallel_tool_calls: false` means at most
one call: "required" stops its grammar after the first call (a named function is always one call), and
"auto" keeps the first call the parser reads (later `<tool_call>` blocks are dropped from the answer; the
generation is not cut short, so content after the call survives). With `--reasoning-parser`, the reasoning
goes to `reasoning_content`; when the prompt opened the reasoning block (e.g. `enable_thinking`), a grammar
(tools or response_format) applies only after it ends; otherwise from the first token.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tierlm.outputs import PositionLogprobs
from tierlm.sampling_params import StructuredOutputRequest
from tierlm.server.async_engine import EnginePrompt
from tierlm.server.chat_parsing import ChatOutputParser
from tierlm.server.images import expand_prompt, fetch_remote_images, load_images
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
    NamedToolChoice,
    TokenLogprob,
    TopLogprob,
)
from tierlm.server.serving import (
    ChoiceDelta,
    ServingContext,
    check_request,
    check_room,
    clamp,
    collect,
    compile_grammar,
    decoded,
    deltas,
    encode_prompt,
    response_format_request,
    sampling_params,
    sse_events,
    submit,
    usage,
)
from tierlm.server.tool_parsers import TOOL_PARSERS
from tierlm.tokenizer import Tokenizer


async def create_chat_completion(
    request: ChatCompletionRequest, ctx: ServingContext, http_request: Request
) -> Response:
    check_request(request, ctx)
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    choice = _tool_choice(request, ctx, tools)
    fetched = await fetch_remote_images(ctx.images, ctx.model_name, request)
    images = await ctx.off_loop(load_images, ctx.images, ctx.model_name, request, fetched)
    text, token_ids = await ctx.off_loop(_render, ctx, request, tools, choice)
    if images:
        token_ids = expand_prompt(token_ids, ctx.images, images)
    prompts = [EnginePrompt(token_ids, text, images)]
    max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(request, max_param)
    check_room(len(prompts[0].token_ids), max_tokens, ctx, max_param)
    structured, grammar_param = _structured_output(request, ctx, tools, choice, text)
    await compile_grammar(ctx, structured, grammar_param)
    top = request.top_logprobs or 0
    params = sampling_params(
        request, max_tokens=max_tokens, logprobs=top if request.logprobs else None, prompt_logprobs=None,
        structured_output=structured,
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await submit(ctx, request_id, prompts, params, "messages")

    def parser() -> ChatOutputParser:
        reasoning = ctx.reasoning_parser(text) if ctx.reasoning_parser else None
        if choice == "none" or tools is None:
            return ChatOutputParser(reasoning, None)
        max_calls = None if request.parallel_tool_calls else 1
        return ChatOutputParser(reasoning, (ctx.tool_parser or TOOL_PARSERS["hermes"])(tools, max_calls))

    if request.stream:
        chunks = _chunks(request, ctx, request_id, prompts, deltas(stream, request.n, True), parser, choice)
        return StreamingResponse(sse_events(chunks), media_type="text/event-stream")
    results = await collect(http_request, stream, request.n, True)
    choices = []
    for r in results:
        parts = parser().whole(r.text)
        message = ChatMessageOut(
            content=parts.content if parts.content or not parts.tool_calls else None,
            reasoning_content=parts.reasoning or None, tool_calls=parts.tool_calls,
        )
        choices.append(ChatChoice(
            index=r.index, message=message, finish_reason=_finish_reason(r.finish_reason, bool(parts.tool_calls), choice),
            stop_reason=r.stop_reason, logprobs=_logprobs(ctx.tokenizer, r.token_ids, r.logprobs, top),
        ))
    response = ChatCompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices,
        usage=usage(prompts, sum(len(r.token_ids) for r in results)),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _tool_choice(request: ChatCompletionRequest, ctx: ServingContext, tools: list | None) -> str:
    """"none", "auto", "required" or the named function's name; refuses what cannot be served."""
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools or ()]
        if choice.function.name not in names:
            raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                           f"the tools given ({', '.join(names) or 'none'})", "tool_choice")
        return choice.function.name
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools", "tool_choice")
    if not tools:
        return "none"
    choice = choice or "auto"
    if choice == "auto" and not ctx.auto_tool_choice:
        raise ApiError(400, "tool_choice 'auto' (the default with tools) needs the server started with "
                       "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
    return choice


def _render(
    ctx: ServingContext, request: ChatCompletionRequest, tools: list | None, choice: str
) -> tuple[str, list[int]]:
    messages = [_template_message(message.model_dump(exclude_none=True)) for message in request.messages]
    served_choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, NamedToolChoice) else choice
    template_kwargs = {"tool_choice": served_choice, "parallel_tool_calls": request.parallel_tool_calls,
                       **(request.chat_template_kwargs or {})}
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, template_kwargs=template_kwargs
        )
    except ValueError as exc:  # ChatTemplateError: no template, a message it refuses, ...
        param = "chat_template_kwargs" if str(exc).startswith("chat_template_kwargs") else "messages"
        raise ApiError(400, str(exc), param) from None
    return text, encode_prompt(ctx, text, "messages", add_special_tokens=False)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """Tool-call arguments as objects where they parse as JSON objects; an assistant turn's content ''
    rather than absent."""
    if message["role"] == "assistant":
        message.setdefault("content", "")
        for call in message.get("tool_calls") or ():
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                continue
            if isinstance(arguments, dict):
                call["function"]["arguments"] = arguments
    return message


def _structured_output(
    request: ChatCompletionRequest, ctx: ServingContext, tools: list | None, choice: str, prompt_text: str
) -> tuple[StructuredOutputRequest | None, str]:
    """The grammar of the answer (tool calls forced, or response_format), and the parameter it comes from."""
    structured, param = response_format_request(request.response_format), "response_format"
    if choice not in ("none", "auto"):
        if structured is not None:
            raise ApiError(400, "response_format cannot be combined with tool_choice 'required' or a named "
                           "function", "response_format")
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
        parser = ctx.tool_parser or TOOL_PARSERS["hermes"]
        parallel = request.parallel_tool_calls and choice == "required"
        structured, param = StructuredOutputRequest(structural_tag=parser.structural_tag(chosen, parallel)), "tools"
    reasoning = ctx.reasoning_parser
    if structured is not None and reasoning is not None and reasoning.prompt_opens_reasoning(prompt_text):
        structured = replace(structured, reasoning_end_token_id=ctx.tokenizer.token_to_id(reasoning.end_tag))
    return structured, param


def _finish_reason(reason: str | None, called: bool, choice: str) -> str | None:
    if reason == "stop" and called and choice in ("auto", "required"):
        return "tool_calls"
    return reason


async def _chunks(
    request: ChatCompletionRequest, ctx: ServingContext, request_id: str, prompts: list[EnginePrompt],
    source: AsyncIterator[ChoiceDelta], new_parser, choice: str,
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=ctx.model_name, choices=[choice])

    parsers: dict[int, ChatOutputParser] = {}
    completion_tokens = 0
    async for d in source:
        if d.first:
            parsers[d.index] = new_parser()
            yield chunk(ChatChunkChoice(index=d.index, delta=ChatDelta(role="assistant", content="")))
        parser = parsers[d.index]
        piece = parser.feed(d.text)
        if d.finish_reason:
            end = parser.finish()
            piece.reasoning += end.reasoning
            piece.content += end.content
            piece.tool_calls += end.tool_calls
        if piece or d.finish_reason or (d.logprobs and d.token_ids):  # text a parser holds back waits
            delta = ChatDelta(
                content=piece.content if piece.content or not (piece.reasoning or piece.tool_calls) else None,
                reasoning_content=piece.reasoning or None, tool_calls=piece.tool_calls or None,
            )
            yield chunk(ChatChunkChoice(
                index=d.index, delta=delta, finish_reason=_finish_reason(d.finish_reason, parser.num_calls > 0, choice),
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
