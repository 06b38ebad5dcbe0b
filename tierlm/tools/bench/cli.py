"""`tierlm bench`: its arguments, their checks, and the order of work.

Checks every argument before the first request (a mistake costs one line and exit status 2), makes
the prompt plan (reserving cold-lane text), runs warmup and measured runs under a progress bar,
then prints the tables, writes the result JSON and the plot, and exits 1 if no request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime
from pathlib import Path

from tierlm.cli import CliError

DESCRIPTION = """\
Client-side serving benchmark for any OpenAI-compatible server (tierlm, vLLM, llama.cpp server).
Streams requests and timestamps every chunk on arrival: TTFT, inter-token latency (ITL), TPOT and
end-to-end latency as a user sees them, plus throughput and failures.

examples:
  tierlm bench --base-url http://127.0.0.1:8000 --model my-model --concurrency 4 --num-requests 32
  tierlm bench --base-url http://127.0.0.1:8000/v1 --model m --lane warm --turns 5 --result-json a.json
  tierlm bench --base-url http://127.0.0.1:8080 --model m --request-rate 2 --compare a.json --plot b.png
"""


def _positive_int(text: str) -> int:
    value = _parse(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _parse(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _parse(float, text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _parse(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a valid {kind.__name__}: {text!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        usage="tierlm bench --base-url URL --model NAME [options]",
        help="client-side serving benchmark (TTFT, ITL, throughput) against an OpenAI-compatible server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", required=True, help="server root or its /v1 URL, e.g. http://127.0.0.1:8000"
    )
    server.add_argument("--model", required=True, help="model name sent in every request")
    server.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions or /v1/completions (default: chat)",
    )
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    server.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds to wait for a connection or the next byte before failing a request (default: 600)",
    )

    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=256,
        help="length of each user message in tokens (default: 256)",
    )
    workload.add_argument(
        "--output-tokens", type=_positive_int, default=128, help="max_tokens of each request (default: 128)"
    )
    workload.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos/min_tokens (by default they force --output-tokens tokens; "
        "they are dropped by themselves if the server rejects them)",
    )
    workload.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    workload.add_argument(
        "--lane",
        choices=("cold", "warm"),
        default="cold",
        help="cold: every request gets text no earlier request sent (default); "
        "warm: every request gets the same fixed text",
    )
    workload.add_argument(
        "--corpus",
        metavar="DIR",
        help="take cold-lane text from the files under DIR instead of generating words",
    )
    workload.add_argument(
        "--state-file",
        default=None,
        help="JSON file of cold-lane text already used (default: ~/.cache/tierlm/bench_state.json)",
    )
    workload.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the model's tokenizer.json (or its directory): exact prompt lengths and output "
        "counts when the server sends no usage; without it, ~4 characters per token",
    )
    load = workload.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_positive_int,
        help="closed loop: N workers, each sending its next request when the previous finished (default: 1)",
    )
    load.add_argument(
        "--request-rate",
        type=_positive_float,
        metavar="R",
        help="open loop: conversations start as a Poisson process of R per second",
    )
    workload.add_argument(
        "--num-requests",
        type=_positive_int,
        default=16,
        help="conversations per run, each of --turns requests (default: 16)",
    )
    workload.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        help="turns per conversation; each turn resends the history, answers included (default: 1)",
    )

    images = parser.add_argument_group("images (chat endpoint; a server with a vision tower)")
    image = images.add_mutually_exclusive_group()
    image.add_argument(
        "--image",
        metavar="FILE",
        help="send this image (a data: URL) before the text of each conversation's first message; the "
        "same image every time, so a server's encoder cache may serve it",
    )
    image.add_argument(
        "--image-size",
        metavar="WxH",
        help="send a generated WxH image before the text of each conversation's first message, drawn "
        "from that text: unseen on the cold lane, one image on the warm lane",
    )

    method = parser.add_argument_group("method")
    method.add_argument(
        "--warmup", type=_non_negative_int, default=1, help="unreported runs first (default: 1)"
    )
    method.add_argument(
        "--runs",
        type=_positive_int,
        default=1,
        help="measured runs, each reported, plus the median across them (default: 1)",
    )
    method.add_argument(
        "--seed", type=int, default=0, help="seeds the generated text and the arrivals (default: 0)"
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--result-json", metavar="PATH", help="write the results (vllm bench serve's field names)"
    )
    output.add_argument(
        "--compare",
        metavar="OTHER_JSON",
        help="a previous --result-json to print side by side, with ratios ours/other",
    )
    output.add_argument("--plot", metavar="PATH.png", help="plot ITL over time per stream and TTFT per turn")
    output.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(func=run_bench)
    return parser


def _load_comparison(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise CliError(f"--compare: no such file: {path}")
    try:
        other = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"--compare: {path} is not a readable JSON file: {exc}") from exc
    if not isinstance(other, dict):
        raise CliError(f"--compare: {path} is not a result JSON object")
    return other


def _images(args: argparse.Namespace):
    """The --image / --image-size source (None without them); bad values are CliErrors."""
    from tierlm.tools.bench.images import GeneratedImages, ImageFile

    if not (args.image or args.image_size):
        return None
    if args.endpoint != "chat":
        raise CliError("--image / --image-size need --endpoint chat (the completions API takes no images)")
    try:
        return ImageFile(args.image) if args.image else GeneratedImages(args.image_size)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tierlm.tools.bench.client import GenerationSettings, ServerTarget
    from tierlm.tools.bench.report import (
        print_comparison,
        print_failures,
        print_notes,
        print_results,
        print_speculative_decoding,
        write_plot,
    )
    from tierlm.tools.bench.runner import Schedule, run_benchmark
    from tierlm.tools.bench.stats import build_result, compare_results, speculative_decoding
    from tierlm.tools.bench.workload import (
        DEFAULT_STATE_FILE,
        CorpusText,
        GeneratedText,
        PromptPlan,
        StateFile,
        TokenCounter,
    )

    if not args.base_url.startswith(("http://", "https://")):
        raise CliError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    images = _images(args)
    other = _load_comparison(args.compare) if args.compare else None
    counter = TokenCounter.from_path(args.tokenizer)
    if args.corpus:
        source = CorpusText(args.corpus, args.prompt_tokens, counter)
    else:
        source = GeneratedText(args.seed, args.prompt_tokens, counter)
    plan = PromptPlan(
        source,
        lane=args.lane,
        conversations=args.num_requests,
        turns=args.turns,
        total_runs=args.warmup + args.runs,
        state_file=StateFile(args.state_file or DEFAULT_STATE_FILE),
    )
    target = ServerTarget.from_base_url(args.base_url, args.model, args.endpoint, args.api_key)
    settings = GenerationSettings(
        max_tokens=args.output_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature
    )
    concurrency = None if args.request_rate else (args.concurrency or 1)
    schedule = Schedule(concurrency=concurrency, request_rate=args.request_rate, seed=args.seed)

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not args.progress,
    )
    with progress:
        outcome = asyncio.run(
            run_benchmark(
                target, settings, plan, counter, schedule, args.warmup, args.runs, args.timeout, progress, images
            )
        )

    run_settings = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint == "chat" else "openai",
        "model_id": args.model,
        "tokenizer_id": args.tokenizer,
        "base_url": target.api_base,
        "endpoint": args.endpoint,
        "lane": args.lane,
        "seed": args.seed,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "ignore_eos": settings.ignore_eos,
        "turns": args.turns,
        "conversations_per_run": args.num_requests,
        "warmup_runs": args.warmup,
        "num_runs": args.runs,
        "max_concurrency": concurrency,
        "request_rate": args.request_rate,
        "image": args.image or args.image_size,
        "notes": outcome.notes,
    }
    result = build_result(outcome.measured, args.turns, run_settings)
    if outcome.server_metrics_before is not None or outcome.server_metrics_after is not None:
        result["server_metrics_before"] = outcome.server_metrics_before
        result["server_metrics_after"] = outcome.server_metrics_after
    speculation = speculative_decoding(outcome.server_metrics_before, outcome.server_metrics_after)
    if speculation is not None:
        result["speculative_decoding"] = speculation

    console = Console()
    print_notes(console, outcome.notes)
    print_results(console, result)
    if speculation is not None:
        print_speculative_decoding(console, speculation)
    print_failures(console, outcome.measured)
    if other is not None:
        print_comparison(console, compare_results(result, other), args.compare)
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"results written to {path}")
    if args.plot:
        title = f"{args.model}: {args.lane} lane, {args.prompt_tokens} prompt / {args.output_tokens} output tokens"
        write_plot(args.plot, outcome.measured, args.turns, title)
        console.print(f"plot written to {args.plot}")
    if result["completed"] == 0:
        console.print("[bold red]every request failed[/bold red]")
        return 1
    return 0
