"""`tierlm serve [MODEL]`: the OpenAI-compatible server (FastAPI on uvicorn), with vLLM's flag names.

Without MODEL it serves the embedded default (`demo_model.default_model_dir`): the small trained code
model committed in `models/default_model`, or where that is absent the tiny random demo model, built on
first use into `$XDG_CACHE_HOME/tierlm/demo-tiny` (`~/.cache/tierlm/demo-tiny`). The served name is MODEL's folder name unless `--served-model-name`.
Engine flags left unset keep `EngineConfig`'s defaults; a flag whose field this engine's `EngineConfig`
lacks is reported and ignored. Unlike vLLM the default host is 127.0.0.1: pass `--host 0.0.0.0` to listen
on every interface.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from tierlm.cli import CliError
from tierlm.config import LOAD_FORMATS
from tierlm.multimodal.fetch import DEFAULT_FETCH_TIMEOUT_S
from tierlm.server.reasoning_parser import REASONING_PARSERS
from tierlm.server.tool_parsers import TOOL_PARSERS

# flag destination -> EngineConfig field (the same name)
ENGINE_FLAGS = (
    "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed", "enforce_eager",
    "enable_prefix_caching", "kv_cache_memory_bytes", "gpu_memory_utilization", "compile_decode",
    "max_state_checkpoints", "ple_table", "ple_prefetch", "qsa_kv_offload", "qsa_row_cache",
    "qsa_row_cache_rows", "qsa_row_cache_max_batch", "checkpoint_host_bytes", "qsa_row_cache_bytes",
    "load_format", "trace",
    "pipeline_parallel_size", "pp_layer_partition", "speculative_config", "async_scheduling",
    "mm_encoder_offload", "mm_encoder_cache_bytes",
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (FastAPI on uvicorn); flags as vLLM's.",
    )
    parser.add_argument(
        "model", nargs="?", default=None,
        help="a checkpoint folder or Hugging Face repo id (default: the embedded trained code model)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: folder)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    chat = parser.add_argument_group("tools and reasoning (chat completions)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="tool_choice 'auto': read tool calls out of the model's text (needs --tool-call-parser)")
    chat.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                      help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>) or qwen3_coder "
                      "(<tool_call><function=...><parameter=...>); also the format forced for tool_choice "
                      "'required' or a named function (default there: hermes)")
    chat.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                      help="split <think>...</think> into reasoning_content; grammars apply after it")
    images = parser.add_argument_group("images (chat image_url parts; a model with a vision tower)")
    images.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help='images one prompt may carry, e.g. \'{"image": 4}\' (default 8)')
    images.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                        help='image resize bounds, e.g. \'{"max_pixels": 1048576}\' (min_pixels, max_pixels)')
    images.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="file:// image URLs are read when the file lies inside DIR (default: refused)")
    images.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                        help="http(s) image URLs are fetched when their host is one of these (redirects too; "
                        "default: refused)")
    images.add_argument("--image-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT_S, metavar="SECONDS",
                        help=f"an http(s) image must arrive within this (default {DEFAULT_FETCH_TIMEOUT_S:g}, vLLM's)")
    images.add_argument("--mm-encoder-offload", action=argparse.BooleanOptionalAction, default=None,
                        help="the vision tower's weights in pinned host memory, copied to the device block by "
                        "block while it encodes (default: auto, on CUDA when the cache plan needs the room)")
    images.add_argument("--mm-encoder-cache-bytes", type=int, default=None, metavar="BYTES",
                        help="device memory for the vision tower's features of recent images, reused by later "
                        "requests with the same image (LRU; 0: off; default 128 MiB)")
    clients = parser.add_argument_group("clients (what one client may cost the others)")
    clients.add_argument("--max-n", type=int, default=16, help="choices one request may ask for (n), at most")
    clients.add_argument("--max-request-bytes", type=int, default=8 << 20,
                         help="request bodies larger than this are refused with 413 (default 8 MiB)")
    clients.add_argument("--max-stream-buffer-bytes", type=int, default=None,
                         help="output a stream's client has not read, at most (estimated bytes); past it the "
                         "request is paused until the client reads half of it (default 4 MiB)")
    clients.add_argument("--stream-stall-timeout", type=float, default=None,
                         help="seconds a paused stream may wait for its client before it is ended (default 60)")
    clients.add_argument("--request-read-timeout", type=float, default=60.0,
                         help="seconds for a request's headers and body to arrive; slower connections are "
                         "closed (default 60)")
    clients.add_argument("--timeout-keep-alive", type=int, default=5,
                         help="seconds an idle keep-alive connection stays open (default 5)")
    clients.add_argument("--limit-concurrency", type=int, default=None,
                         help="connections and requests at once; more get HTTP 503 (default: no limit)")
    engine = parser.add_argument_group("engine (unset: the engine's defaults)")
    engine.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--trace", default=None, metavar="FILE",
                        help="write a Chrome-trace / Perfetto JSON of every step (host phases, GPU time) to FILE")
    engine.add_argument("--load-format", default=None, choices=LOAD_FORMATS,
                        help="dummy: random weights from config.json alone, no checkpoint read (benchmarks)")
    engine.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    engine.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's)")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="requests in a batch at most")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most")
    engine.add_argument("--seed", type=int, default=None, help="seed of unseeded sampling")
    engine.add_argument("--enforce-eager", action="store_true", default=None,
                        help="no CUDA graphs (nor compilation) for decode steps")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the cache budget in bytes")
    engine.add_argument("--max-state-checkpoints", type=int, default=None,
                        help="prefix-cache recurrent-state checkpoints (default: 2 x max-num-seqs)")
    engine.add_argument("--checkpoint-host-bytes", type=int, default=None,
                        help="host RAM (pinned) for prefix-cache checkpoints, LRU (instead of --max-state-checkpoints)")
    add_async_scheduling_flag(engine)
    engine.add_argument("--compile-decode", action="store_true", default=None,
                        help="CPU: torch.compile the decode step (slow start, faster steps)")
    engine.add_argument("--ple-table", default=None,
                        help="folder of `tierlm ple export`: serve PLE rows from memory-mapped files")
    engine.add_argument("--ple-prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="admission-time prefetch of the mapped tables' pages (default on)")
    engine.add_argument("--qsa-kv-offload", action=argparse.BooleanOptionalAction, default=None,
                        help="QSA K/V in exact-size pinned host pools, read over UVA at decode (default: "
                        "auto, on CUDA when the budget cannot hold max-num-seqs requests of max-model-len)")
    engine.add_argument("--qsa-row-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="with --qsa-kv-offload: cache recently read rows in VRAM (default on)")
    engine.add_argument("--qsa-row-cache-rows", type=int, default=None,
                        help="with --qsa-kv-offload: rows of each QSA layer's VRAM arena (default: from the bytes)")
    engine.add_argument("--qsa-row-cache-bytes", type=int, default=None,
                        help="with --qsa-kv-offload: the VRAM arenas of all QSA layers in bytes (default 95 MiB)")
    engine.add_argument("--qsa-row-cache-max-batch", type=int, default=None,
                        help="decode batches of up to this many requests read through the row cache (default 12)")
    engine.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads on CPU (default: cores - 1, leaving one to the HTTP side)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="the cache budget as a fraction of device memory")
    add_pipeline_flags(engine)
    add_speculative_flag(engine)
    parser.set_defaults(func=run)


def add_async_scheduling_flag(parser) -> None:
    """--async-scheduling / --no-async-scheduling (serve and generate share it)."""
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap scheduling: launch the next decode step before reading this one's ids "
                        "(default on; off for speculative decoding, pipeline parallel, mapped PLE tables)")


def add_speculative_flag(parser) -> None:
    """--speculative-config (`tierlm generate` has the same flag)."""
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='MTP speculative decoding with the checkpoint\'s draft head, e.g. '
                        '\'{"method": "mtp", "num_speculative_tokens": 2}\'; "speculative_token_map": FILE drafts '
                        'from those token ids only (`tierlm draft-vocab`)')


def add_pipeline_flags(parser) -> None:
    """--pipeline-parallel-size and --pp-layer-partition (serve, generate and plan share them)."""
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                        help="split the layers over this many processes (one per GPU; gloo ranks on CPU)")
    parser.add_argument("--pp-layer-partition", default=None,
                        help="layers per rank, e.g. 16,17,15 (default: balanced by each rank's memory)")


def engine_config(model: str, args: argparse.Namespace):
    """EngineConfig from the flags that were given and that this EngineConfig has."""
    from tierlm.engine.llm_engine import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    given = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    for name in sorted(set(given) - known):
        print(f"tierlm serve: this engine has no {name} setting; --{name.replace('_', '-')} is ignored",
              file=sys.stderr)
    return EngineConfig(model=model, **{k: v for k, v in given.items() if k in known})


def set_cpu_threads(requested: int | None) -> None:
    """Leave a core to the event loop: torch's OpenMP threads spin-wait, and a GEMM whose two threads
    share a core with the HTTP side takes milliseconds instead of microseconds (measured on 2 cores)."""
    import torch

    threads = requested or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from tierlm.engine.llm_engine import LLMEngine
    from tierlm.model.loader import ModelNotFoundError
    from tierlm.server.api import build_app
    from tierlm.server.async_engine import AsyncEngine
    from tierlm.server.connection import protocol_with_read_timeout

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    set_cpu_threads(args.cpu_threads)
    from tierlm.demo_model import default_model_dir

    model = args.model or str(default_model_dir())
    name = args.served_model_name or (Path(model).name if Path(model).expanduser().is_dir() else model)
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise CliError(f"--limit-concurrency must be at least 1, got {args.limit_concurrency}")
    if args.timeout_keep_alive < 0:
        raise CliError(f"--timeout-keep-alive must be 0 or more, got {args.timeout_keep_alive}")
    try:
        http = protocol_with_read_timeout(args.request_read_timeout)
        engine = LLMEngine(engine_config(model, args))
        limits = {"max_stream_buffer_bytes": args.max_stream_buffer_bytes,
                  "stream_stall_timeout_s": args.stream_stall_timeout}
        async_engine = AsyncEngine(engine, name, **{k: v for k, v in limits.items() if v is not None})
    except (ValueError, ModelNotFoundError) as exc:
        raise CliError(str(exc)) from None
    try:
        app = build_app(
            async_engine, name, args.api_key, tool_parser=args.tool_call_parser,
            auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
            max_n=args.max_n, max_request_bytes=args.max_request_bytes,
            limit_mm_per_prompt=args.limit_mm_per_prompt, mm_processor_kwargs=args.mm_processor_kwargs,
            allowed_local_media_path=args.allowed_local_media_path, allowed_media_domains=args.allowed_media_domains,
            image_fetch_timeout=args.image_fetch_timeout,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", http=http, limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive,
    ))
    if engine.pipeline is not None:
        # a pipeline rank that dies stops the server, which then exits with the error naming it (below); not
        # a signal to this process: uvicorn raises a signal again once it has stopped, which would end it there
        engine.pipeline.on_failure = lambda: setattr(server, "should_exit", True)
        if engine.pipeline.failure is not None:  # it failed before the callback was set
            raise CliError(engine.pipeline.failure)
    print(f"tierlm serve: {model} as {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if engine.pipeline is not None and engine.pipeline.failure is not None:
        raise CliError(engine.pipeline.failure)
    return 0 if server.started else STARTUP_FAILURE
