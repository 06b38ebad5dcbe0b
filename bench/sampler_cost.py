"""What sampling costs a decode step: the batched sampler on one step's logits rows, side by side.

Rows of --vocab logits (random, on --device) for --batch requests that each generated --output-tokens
tokens; three columns, each the sampler's whole pass (host preparation, device math, the copy back):
greedy (argmax only), temperature + top-p + top-k, and the issue-14 worst case: a json_schema grammar,
presence / frequency / repetition penalties and a logit_bias on every row. The vocabulary is the demo
tokenizer's, padded to --vocab (xgrammar sees a real tokenizer; padded ids are never allowed).

The decode step it is compared with is measured in the same run (`--step-layers`, on a GPU): the real-width
stack of `decode_roofline.py` (random weights, CUDA graphs, context 512) decoding a batch of --batch at
4 and at 8 layers; the per-layer cost (their difference / 4) extrapolates to the target model's 48 layers
(12 QSA : 36 GDN, as in the 4-layer stack). The last column is printed as a fraction of both the measured
4-layer step and the 48-layer step (the issue's target: at most 5% of the model's decode step). Results go
to bench/results/sampler_cost_<device>.json.

    python bench/sampler_cost.py                                              # CPU, tiny shapes
    python bench/sampler_cost.py --device cuda --vocab 248320 --batch 16 --step-layers
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from decode_roofline import build_model, device_label, measure, real_width_config

from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.structured_output import StructuredOutputManager
from tierlm.sampling_params import SamplingParams, StructuredOutputRequest
from tierlm.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of fn() over `repeats` runs (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def print_profile(name: str, fn, device: torch.device, repeats: int = 5) -> None:
    """torch.profiler's ops of `repeats` calls of fn (after one warm-up), by self host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = prof.key_averages()
    print(f"--- profile of {name} ({repeats} calls)")
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
    if device.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=48))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--step-layers", action="store_true",
                        help="also measure the real-width decode step at 4 and 8 layers (a GPU run)")
    parser.add_argument("--target-layers", type=int, default=48, help="the depth the step extrapolates to")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads (1: no OpenMP spin on a busy host)")
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's op table (host and device time) for each column")
    args = parser.parse_args()
    torch.set_num_threads(args.cpu_threads)
    device = torch.device(args.device)
    folder = Path(tempfile.gettempdir()) / "tierlm-bench-demo-tiny"
    if not (folder / "config.json").is_file():
        build_demo_model(folder, "tiny", overwrite=True)
    tokenizer = Tokenizer.from_pretrained(folder)
    manager = StructuredOutputManager(tokenizer, args.vocab, list(tokenizer.eos_token_ids))
    grammar = StructuredOutputRequest(json_schema=json.dumps(SCHEMA))
    generator = torch.Generator().manual_seed(0)
    outputs = torch.randint(0, tokenizer.vocab_size, (args.batch, args.output_tokens), generator=generator).tolist()
    logits = torch.randn(args.batch, args.vocab, generator=generator).to(device) * 3

    def requests(**fields) -> list[Request]:
        rows = []
        for i in range(args.batch):
            params = SamplingParams(max_tokens=10**6, seed=i, **fields).with_defaults(None, None, None)
            state = manager.new_state(grammar) if params.structured_output else None
            rows.append(Request(f"r{i}", [1, 2, 3], params, frozenset(tokenizer.eos_token_ids), 10**7,
                                output_token_ids=list(outputs[i]), structured_output=state))
        return rows

    sampler = Sampler(0)
    columns = {
        "greedy": requests(temperature=0),
        "top-p/top-k": requests(temperature=0.7, top_p=0.8, top_k=20),
        "json+penalties+bias": requests(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=0.5,
                                        frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={5: 2.0, 9: -3.0},
                                        structured_output=grammar),
    }
    results = {name: timed(lambda rows=rows: sampler.sample(logits, rows, str), args.repeats, device)
               for name, rows in columns.items()}
    if args.profile:
        for name, rows in columns.items():
            print_profile(name, lambda rows=rows: sampler.sample(logits, rows, str), device)
    base = results["greedy"]
    steps = decode_steps(args, device) if args.step_layers else {}
    report = {"device": device_label(device), "batch": args.batch, "vocab": args.vocab, "sampler_ms": results,
              "decode_step_ms": steps}
    print(f"sampler, {args.batch} rows x {args.vocab} vocab on {device} ({args.output_tokens} output tokens each)")
    for name, ms in results.items():
        line = f"  {name:<22} {ms:8.3f} ms   {ms / base:5.2f}x greedy"
        for label, step in steps.items():
            line += f"   {100 * ms / step:5.2f}% of {label}"
        print(line)
    if steps:
        print("decode steps (ms): " + ", ".join(f"{label} {step:.3f}" for label, step in steps.items()))
    out = Path(__file__).parent / "results" / f"sampler_cost_{report['device']}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"saved {out}")


def decode_steps(args, device: torch.device) -> dict[str, float]:
    """The real-width stack's decode step at --batch (CUDA graphs, context 512) at 4 and 8 layers, and the
    step at --target-layers from the per-layer difference: {label: ms}."""
    measured = {}
    for layers in (4, 8):
        config = ModelConfig.from_dict(real_width_config(layers, small=device.type != "cuda"))
        model = build_model(config, torch.bfloat16, device)
        measured[layers] = measure(model, config, torch.bfloat16, device, args.batch, 512, 30)["step_ms"]
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    per_layer = (measured[8] - measured[4]) / 4
    return {"the 4-layer step": measured[4], "the 8-layer step": measured[8],
            f"a {args.target_layers}-layer step": measured[4] + per_layer * (args.target_layers - 4)}


if __name__ == "__main__":
    main()
