"""The FastAPI app: routes, the API key, request parsing, and every error in OpenAI's shape.

/v1/* (models, completions, chat/completions) need `Authorization: Bearer KEY` when the server has a
key; /health, /version and /metrics never do. Bodies are parsed here rather than by FastAPI, so a
malformed body or a missing field is a 400 naming the field (FastAPI would answer 422 in its own shape);
a body over `max_request_bytes` is refused with 413 as it arrives, before it is read whole. Unknown
routes (404), wrong methods (405) and FastAPI's own validation (422) answer in OpenAI's shape too.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierlm.multimodal.fetch import DEFAULT_FETCH_TIMEOUT_S
from tierlm.server.async_engine import AsyncEngine, EngineDeadError, EngineRequestError
from tierlm.server.chat import create_chat_completion
from tierlm.server.completions import create_completion
from tierlm.server.images import ImageInputs
from tierlm.server.metrics import CONTENT_TYPE
from tierlm.server.protocol import (
    ERROR_TYPES,
    TOKEN_ID_MARK,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    unsupported_field,
)
from tierlm.server.reasoning_parser import REASONING_PARSERS
from tierlm.server.serving import ClientDisconnected, ServingContext, trim_heap
from tierlm.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("tierlm.server")

CLIENT_CLOSED = 499  # nginx's status for a client that left; never seen by that client
_Body = TypeVar("_Body", bound=BaseModel)


DEFAULT_MAX_REQUEST_BYTES = 8 << 20
TRIM_AFTER_BYTES = 256 << 10  # after a request body this large, freed heap memory goes back to the OS
# the text pool (chat templates, tokenization, grammar compilation): half the cores, so that huge prompts
# being tokenized leave the event loop and the engine thread a core
TEXT_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


def build_app(
    engine: AsyncEngine, model_name: str, api_key: str | None = None, *, tool_parser: str | None = None,
    auto_tool_choice: bool = False, reasoning_parser: str | None = None, max_n: int = 16,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, limit_mm_per_prompt: str | None = None,
    mm_processor_kwargs: str | None = None, allowed_local_media_path: str | None = None,
    allowed_media_domains: list[str] | None = None, image_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S,
) -> FastAPI:
    """The app around a (not yet started) AsyncEngine; the app's lifespan starts and stops its thread.

    Raises ValueError for options that cannot work (an unknown parser, a tokenizer without its tags)."""
    if auto_tool_choice and tool_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if tool_parser is not None and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_parser!r} is unknown; choose one of {sorted(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {reasoning_parser!r} is unknown; choose one of {sorted(REASONING_PARSERS)}")
    if max_n < 1 or max_request_bytes < 1:
        raise ValueError(f"--max-n and --max-request-bytes must be at least 1, got {max_n} and {max_request_bytes}")
    tokenizer = engine.engine.tokenizer
    reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    if reasoning is not None:
        missing = [tag for tag in (reasoning.start_tag, reasoning.end_tag) if tokenizer.token_to_id(tag) is None]
        if missing:
            raise ValueError(f"--reasoning-parser {reasoning_parser}: the tokenizer has no token {missing[0]!r}")
    images = ImageInputs.for_model(engine.engine.model_dir, engine.engine.model_config.vision,
                                   limit_mm_per_prompt, mm_processor_kwargs, allowed_local_media_path,
                                   allowed_media_domains, image_fetch_timeout)
    text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="tierlm-text")
    ctx = ServingContext(
        engine, tokenizer, model_name, engine.engine.max_model_len, text_pool,
        tool_parser=TOOL_PARSERS[tool_parser] if tool_parser else None, auto_tool_choice=auto_tool_choice,
        reasoning_parser=reasoning, max_n=max_n, images=images,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        _ = engine.engine.structured_outputs  # xgrammar's view of the vocabulary: once, before serving
        engine.start()
        yield
        engine.stop()
        text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="tierlm", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        location = [str(p) for p in errors[0]["loc"]] if errors else []
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3])
        return JSONResponse(ApiError(422, message, location[-1] if location else None).body(), status_code=422)

    @app.exception_handler(EngineRequestError)
    async def engine_error(_request: Request, exc: EngineRequestError) -> JSONResponse:
        return JSONResponse(ApiError(500, str(exc)).body(), status_code=500)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(ApiError(503, str(exc)).body(), status_code=503)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return JSONResponse(ApiError(500, f"internal error: {exc}").body(), status_code=500)

    @app.get("/health", response_class=PlainTextResponse,
             responses={503: {"description": "the engine has failed", "content": {"text/plain": {}}}})
    async def health() -> PlainTextResponse:
        if engine.is_alive:
            return PlainTextResponse("ok")
        return PlainTextResponse(f"the engine has failed: {engine.dead_reason or 'its thread stopped'}", 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("tierlm")}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def check_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)] if api_key else [])

    card = ModelCard(id=model_name, max_model_len=ctx.max_model_len)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card])

    @v1.get("/models/{model_id:path}", responses={404: {"description": "NotFoundError"}})
    async def model(model_id: str) -> ModelCard:
        if model_id != model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist here (this server serves {model_name!r})",
                           "model")
        return card

    @v1.post("/completions", openapi_extra=_request_body(CompletionRequest), responses=_RESPONSES)
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, max_request_bytes)
        return await _unless_gone(create_completion(body, ctx, request), request, ctx)

    @v1.post("/chat/completions", openapi_extra=_request_body(ChatCompletionRequest), responses=_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest, max_request_bytes)
        return await _unless_gone(create_chat_completion(body, ctx, request), request, ctx)

    app.include_router(v1)
    _publish_request_schemas(app, [CompletionRequest, ChatCompletionRequest], ServedLimits(
        max_n, engine.engine.model_config.vocab_size, ctx.max_model_len, auto_tool_choice))
    return app


_RESPONSES = {
    200: {"description": "the answer; with stream: true, server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **{status: {"description": name} for status, name in ERROR_TYPES.items()},
}
_COMPONENTS = "#/components/schemas/{model}"


def _request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that parses its body itself (to answer 400 in OpenAI's shape)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _COMPONENTS.format(model=model.__name__)}}}}}


@dataclass(frozen=True)
class ServedLimits:
    """What this server accepts beyond the request models' own ranges."""

    max_n: int  # --max-n
    vocab_size: int  # token ids below it
    max_model_len: int  # max_tokens below it (the prompt takes at least one position)
    auto_tool_choice: bool  # without it, tools need tool_choice "none", "required" or a named function


def _with_limits(schema: Any, limits: ServedLimits) -> Any:
    """A request schema with this server's limits: token ids (marked) below the vocabulary's size."""
    if isinstance(schema, list):
        return [_with_limits(item, limits) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _with_limits(value, limits) for key, value in schema.items()}
    if out.pop(TOKEN_ID_MARK, False):
        out["maximum"] = limits.vocab_size - 1
    return out


def _publish_request_schemas(app: FastAPI, models: list[type[BaseModel]], limits: ServedLimits) -> None:
    """Put the request models (and the models they use) into the app's OpenAPI components, with this
    server's own limits (`n` at most --max-n, token ids in the vocabulary, max_tokens below
    --max-model-len, tools without --enable-auto-tool-choice only with a tool_choice), so that every
    body the schema allows is served, but for what a schema cannot say (a prompt longer than the
    context, max_tokens past what the prompt leaves, min_tokens above max_tokens, a named function
    not among the tools: 400s)."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()  # built once and kept in app.openapi_schema
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = _with_limits(model.model_json_schema(ref_template=_COMPONENTS), limits)
                components.update(body.pop("$defs", {}))
                n = body["properties"]["n"]
                n["maximum"] = min(n["maximum"], limits.max_n)
                for name in ("max_tokens", "max_completion_tokens"):
                    for form in body["properties"].get(name, {}).get("anyOf", ()):
                        if form["type"] == "integer":
                            form["maximum"] = limits.max_model_len - 1
                if model is ChatCompletionRequest and not limits.auto_tool_choice:
                    body["allOf"].append({
                        "if": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
                        "then": {"properties": {"tool_choice": {"anyOf": [{"enum": ["none", "required"]},
                                                                          {"type": "object"}]}},
                                 "required": ["tool_choice"]},
                    })
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is larger than this server accepts ({limit:,} bytes; "
                         "--max-request-bytes)")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[_Body], limit: int) -> _Body:
    raw = await _read_body(request, limit)
    request.state.body_bytes = len(raw)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    refused = unsupported_field(data, chat=model is ChatCompletionRequest)
    if refused is not None:
        raise ApiError(400, f"{refused}={data[refused]!r} is not supported by tierlm (leave it out)", refused)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: -len(e["loc"]))  # a union's deepest match first
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors]
        location = errors[0]["loc"]
        param = str(location[0]) if location else None
        raise ApiError(400, "invalid request: " + "; ".join(problems[:3]), param) from None


async def _unless_gone(handler, request: Request, ctx: ServingContext) -> Response:
    try:
        return await handler
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if getattr(request.state, "body_bytes", 0) > TRIM_AFTER_BYTES:
            # a big prompt's text, its tokenizer encoding and its parse were freed by the text pool's
            # threads, into malloc arenas glibc keeps: give them back (RSS returns to where it was)
            await ctx.off_loop(trim_heap)
