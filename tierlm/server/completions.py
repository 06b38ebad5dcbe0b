"""POST /v1/completions: OpenAI's legacy completions, streaming or not.

Prompts may be a string, a list of strings, a list of token ids or a list of such lists (one engine
request each, tokenized off the event loop). Log-probabilities use the legacy shape (tokens /
token_logprobs / top_logprobs / text_offset). `echo: true` puts the prompt in front of the answer, and
with `logprobs` the prompt's tokens with their log-probabilities (the first one None), as
lm-eval-harness's `local-completions` scores text, `max_tokens: 0` included.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tierlm.outputs import PositionLogprobs, RequestOutput
from tierlm.server.async_engine import EnginePrompt
from tierlm.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from tierlm.tokenizer import Tokenizer

_Pair = tuple[int, PositionLogprobs | None]  # a token and its log-probabilities (None: not scored)


async def create_completion(
    request: CompletionRequest, ctx: ServingContext, http_request: Request
) -> Response:
    check_request(request, ctx)
    prompts = await ctx.off_loop(_prompts, request.prompt, ctx)
    keep_output = request.max_tokens != 0
    max_tokens = request.max_tokens if keep_output else 1  # score the prompt: run one token, drop it
    for prompt in prompts:
        check_room(len(prompt.token_ids), max_tokens, ctx, "max_tokens")
    structured = response_format_request(request.response_format)
    await compile_grammar(ctx, structured, "response_format")
    params = sampling_params(
        request, max_tokens=max_tokens, logprobs=request.logprobs,
        prompt_logprobs=request.logprobs if request.echo else None, structured_output=structured,
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stream = await submit(ctx, request_id, prompts, params, "prompt")
    builder = _ChoiceBuilder(request, ctx.tokenizer)
    if request.stream:
        source = deltas(stream, request.n, keep_output)
        chunks = _chunks(request, ctx, request_id, prompts, builder, source)
        return StreamingResponse(sse_events(chunks), media_type="text/event-stream")
    results = await collect(http_request, stream, request.n, keep_output)
    choices = [
        builder.choice(r.index, r.output, r.text, r.token_ids, r.logprobs, r.finish_reason, r.stop_reason)
        for r in results
    ]
    response = CompletionResponse(
        id=request_id, model=ctx.model_name, choices=choices,
        usage=usage(prompts, sum(len(r.token_ids) for r in results)),
    )
    return Response(response.model_dump_json(), media_type="application/json")


def _prompts(prompt: str | list, ctx: ServingContext) -> list[EnginePrompt]:
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    return [
        EnginePrompt(encode_prompt(ctx, p, "prompt"), p) if isinstance(p, str) else EnginePrompt(list(p))
        for p in prompt
    ]


async def _chunks(
    request: CompletionRequest, ctx: ServingContext, request_id: str, prompts: list[EnginePrompt],
    builder: _ChoiceBuilder, source: AsyncIterator[ChoiceDelta],
) -> AsyncIterator[CompletionResponse]:
    completion_tokens = 0
    async for d in source:
        choice = builder.choice(
            d.index, d.output, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason, d.first
        )
        completion_tokens += len(d.token_ids)
        yield CompletionResponse(id=request_id, model=ctx.model_name, choices=[choice])
    if request.include_usage:
        yield CompletionResponse(
            id=request_id, model=ctx.model_name, choices=[], usage=usage(prompts, completion_tokens)
        )


class _ChoiceBuilder:
    """Choices (whole, or one streamed piece at a time), keeping each choice's running text offset."""

    def __init__(self, request: CompletionRequest, tokenizer: Tokenizer) -> None:
        self.echo = request.echo
        self.with_logprobs = request.logprobs is not None
        self.tokenizer = tokenizer
        self.offsets: dict[int, int] = {}  # choice index -> characters reported so far

    def choice(
        self, index: int, output: RequestOutput, text: str, token_ids: list[int],
        logprobs: list[PositionLogprobs] | None, finish_reason: str | None, stop_reason: int | str | None,
        first: bool = True,
    ) -> CompletionChoice:
        """Choice `index`'s text and logprobs; on its first piece, with echo, the prompt's in front."""
        pairs = list(zip(token_ids, logprobs or [None] * len(token_ids), strict=True))
        if self.echo and first:
            prompt_text = output.prompt
            if prompt_text is None:
                prompt_text = self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
            text = prompt_text + text
            prompt_entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            pairs = list(zip(output.prompt_token_ids, prompt_entries, strict=True)) + pairs
        return CompletionChoice(
            index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
            logprobs=self._logprobs(index, pairs) if self.with_logprobs else None,
        )

    def _logprobs(self, index: int, pairs: Iterable[_Pair]) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = self.offsets.get(index, 0)
        for token_id, entries in pairs:
            token = decoded(self.tokenizer, token_id, entries)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entries is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(clamp(entries[token_id].logprob))
                result.top_logprobs.append(
                    {decoded(self.tokenizer, tid, entries): clamp(e.logprob) for tid, e in entries.items()}
                )
        self.offsets[index] = offset
        return result
