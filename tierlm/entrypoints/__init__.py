"""The ways in: the offline `LLM` API, the `generate` command, and (later) the HTTP server."""
