"""What sampling costs a decode step: the batched sampler on one step's logits rows, side by side.

Rows of --vocab logits (random, on --device) for --batch requests that each generated --output-tokens
tokens; three columns, each the sampler's whole pass (host preparation, device math, the copy back):
greedy (argmax only), temperature + top-p + top-k, and the issue-14 worst case: a json_schema grammar,
presence / frequency / repetition penalties and a logit_bias on every row. The vocabulary is the demo
tokenizer's, padded to --vocab (xgrammar sees a real tokenizer; padded ids are never allowed). With
--decode-step-ms (the model's own decode step at this batch, e.g. from bench/decode_roofline.py) the
last column is printed as a fraction of the step (the issue's target: at most 5%).

    python bench/sampler_cost.py                                  # CPU, tiny shapes
    python bench/sampler_cost.py --device cuda --vocab 248320 --batch 16 --decode-step-ms 30
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decode-step-ms", type=float, default=None)
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads (1: no OpenMP spin on a busy host)")
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
    base = results["greedy"]
    print(f"sampler, {args.batch} rows x {args.vocab} vocab on {device} ({args.output_tokens} output tokens each)")
    for name, ms in results.items():
        line = f"  {name:<22} {ms:8.3f} ms   {ms / base:5.2f}x greedy"
        if args.decode_step_ms:
            line += f"   {100 * ms / args.decode_step_ms:5.2f}% of a {args.decode_step_ms:g} ms decode step"
        print(line)


if __name__ == "__main__":
    main()
