"""`tierlm serve`: an OpenAI-compatible HTTP server on the engine.

`cli` (flags, engine construction, uvicorn), `api` (the FastAPI app: routes, auth, errors),
`async_engine` (the one thread that owns the engine), `completions` / `chat` (OpenAI request ->
engine prompts and params, engine outputs -> responses and SSE chunks, over `serving`'s shared helpers),
`chat_parsing` (a chat answer's reasoning, content and tool calls, through `reasoning_parser` and
`tool_parsers/`), `protocol` (the pydantic wire shapes), `connection` (request read deadlines),
`metrics` (Prometheus).
"""
