"""`tierlm generate [MODEL] --prompt TEXT`: one completion, streamed to the terminal as it is produced.
Without MODEL: the embedded default model, as `tierlm serve` (`demo_model.default_model_dir`)."""

from __future__ import annotations

import argparse
import sys

from tierlm.cli import CliError
from tierlm.config import LOAD_FORMATS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt, streaming the text")
    parser.add_argument("model", nargs="?", default=None,
                        help="a local checkpoint folder (default: the embedded trained code model)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's generation_config")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation for decode")
    parser.add_argument("--compile-decode", action="store_true", help="CPU: torch.compile the decode step")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="overlap scheduling: launch the next decode step before reading this one's ids")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write a Chrome-trace / Perfetto JSON of every step (host phases, GPU time) to FILE")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                        help="dummy: random weights from config.json alone, no checkpoint read (benchmarks)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="split the layers over this many processes (one per GPU; gloo ranks on CPU)")
    parser.add_argument("--pp-layer-partition", default=None,
                        help="layers per rank, e.g. 16,17,15 (default: balanced by each rank's memory)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads on CPU (default: torch's own, one per core)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='MTP speculative decoding with the checkpoint\'s draft head, e.g. '
                        '\'{"method": "mtp", "num_speculative_tokens": 2}\'; "speculative_token_map": FILE drafts '
                        'from those token ids only (`tierlm draft-vocab`)')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierlm.demo_model import default_model_dir
    from tierlm.distributed.group import PipelineError
    from tierlm.engine.llm_engine import EngineConfig, LLMEngine
    from tierlm.model.loader import ModelNotFoundError
    from tierlm.sampling_params import SamplingParams

    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            raise CliError(f"--cpu-threads must be at least 1, got {args.cpu_threads}")
        import torch

        torch.set_num_threads(args.cpu_threads)
    model = args.model or str(default_model_dir())
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        )
        engine = LLMEngine(EngineConfig(
            model=model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
            compile_decode=args.compile_decode, load_format=args.load_format, trace=args.trace,
            pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=args.pp_layer_partition,
            speculative_config=args.speculative_config, async_scheduling=args.async_scheduling,
        ))
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        request_id = engine.add_request(prompt, params)
    except (ValueError, ModelNotFoundError) as exc:
        raise CliError(str(exc)) from None
    try:
        _stream(engine, request_id)
    except PipelineError as exc:
        raise CliError(str(exc)) from None
    finally:
        engine.close()
    return 0


def _stream(engine, request_id: str) -> None:
    shown = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if output.finished:
                sys.stdout.write("\n")
                print(f"[finish_reason={output.outputs[0].finish_reason}, "
                      f"tokens={len(output.outputs[0].token_ids)}]", file=sys.stderr)
