"""The FastAPI app: routes, the API key, request parsing, and every error in OpenAI's shape.

/v1/* (models, completions, chat/completions) need `Authorization: Bearer KEY` when the server has a
key; /health and /metrics never do. Bodies are parsed here rather than by FastAPI, so a malformed body or
a missing field is a 400 naming the field (FastAPI would answer 422 in its own shape).
"""

from __future__ import annotations

import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError

from tierlm.server.async_engine import AsyncEngine, EngineDeadError, EngineRequestError
from tierlm.server.chat import create_chat_completion
from tierlm.server.completions import create_completion
from tierlm.server.metrics import CONTENT_TYPE
from tierlm.server.protocol import (
    ERROR_TYPES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from tierlm.server.serving import ClientDisconnected, ServingContext

logger = logging.getLogger("tierlm.server")

CLIENT_CLOSED = 499  # nginx's status for a client that left; never seen by that client
_Body = TypeVar("_Body", bound=BaseModel)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app around a (not yet started) AsyncEngine; the app's lifespan starts and stops its thread."""
    ctx = ServingContext(engine, engine.engine.tokenizer, model_name, engine.engine.max_model_len)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="tierlm", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

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

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def check_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)] if api_key else [])

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=ctx.max_model_len)])

    @v1.post("/completions", openapi_extra=_request_body(CompletionRequest), responses=_RESPONSES)
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        return await _unless_gone(create_completion(body, ctx, request))

    @v1.post("/chat/completions", openapi_extra=_request_body(ChatCompletionRequest), responses=_RESPONSES)
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        return await _unless_gone(create_chat_completion(body, ctx, request))

    app.include_router(v1)
    _publish_request_schemas(app, [CompletionRequest, ChatCompletionRequest])
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


def _publish_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the request models (and the models they use) into the app's OpenAPI components."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()  # built once and kept in app.openapi_schema
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                body = model.model_json_schema(ref_template=_COMPONENTS)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi


async def _parse(request: Request, model: type[_Body]) -> _Body:
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: -len(e["loc"]))  # a union's deepest match first
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors]
        location = errors[0]["loc"]
        param = str(location[0]) if location else None
        raise ApiError(400, "invalid request: " + "; ".join(problems[:3]), param) from None


async def _unless_gone(handler) -> Response:
    try:
        return await handler
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
