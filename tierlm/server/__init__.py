"""`tierlm serve`: an OpenAI-compatible HTTP server on the engine.

`cli` (flags, engine construction, uvicorn), `api` (the FastAPI app: routes, auth, errors),
`async_engine` (the one thread that owns the engine), `completions` / `chat` (OpenAI request ->
engine prompts and params, engine outputs -> responses and SSE chunks, over `serving`'s shared helpers),
`protocol` (the pydantic wire shapes), `metrics` (Prometheus).
"""
