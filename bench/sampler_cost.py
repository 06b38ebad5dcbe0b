"""What sampling costs a decode step: the batched sampler on one step's logits rows, side by side.

Rows of --vocab logits (random, on --device) for --batch requests of --prompt-tokens that each generated
--output-tokens tokens; one line per kind of request, each the sampler's whole pass (host preparation,
device math, the copy back): greedy (argmax only), top-p (a sort over the vocabulary), top-p + top-k, the
same with a repetition penalty (the default model's generation config), and the issue-14 worst case: a
json_schema grammar, presence / frequency / repetition penalties and a logit_bias on every row. On CUDA
each is timed launched eagerly and replayed from the sampler's CUDA graphs (`SamplingGraphs`), side by
side, with the host's planning alone (the plan and its packing, before any launch). The vocabulary is
the demo tokenizer's, padded to --vocab (xgrammar sees a real tokenizer; padded ids are never allowed).

The decode step it is compared with is measured in the same run (`--step-layers`, on a GPU): the real-width
stack of `decode_roofline.py` (random weights, CUDA graphs, context 512) decoding a batch of --batch at
4 and at 8 layers; the per-layer cost (their difference / 4) extrapolates to the target model's 48 layers
(12 QSA : 36 GDN, as in the 4-layer stack). The last column is printed as a fraction of both the measured
4-layer step and the 48-layer step. Then what sampling adds to a step (issue 14's target: at most 5% of the
model's decode step): the 8-layer step alone, and followed by each column's sampling on its own logits in
the engine's order (the forward queued first, so the sampler's host work runs while the device computes;
its kernels after; the ids read back), alternated step by step; the difference of the medians, as a
fraction of the 48-layer step. Results go to
bench/results/sampler_cost_<device>_b<batch>_p<prompt tokens>.json.

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
from decode_roofline import BLOCK_SIZE, build_model, device_label, measure, real_width_config

from tierlm.config import ModelConfig
from tierlm.demo_model import build_demo_model
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.sampling_pass import PackedPlan
from tierlm.engine.sampling_plan import plan_rows
from tierlm.engine.structured_output import StructuredOutputManager
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner
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
    parser.add_argument("--prompt-tokens", type=int, default=1000,
                        help="each request's prompt (a repetition penalty counts its ids as seen)")
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
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt_tokens), generator=generator).tolist()
    logits = torch.randn(args.batch, args.vocab, generator=generator).to(device) * 3

    def requests(**fields) -> list[Request]:
        rows = []
        for i in range(args.batch):
            params = SamplingParams(max_tokens=10**6, seed=i, **fields).with_defaults(None, None, None)
            state = manager.new_state(grammar) if params.structured_output else None
            rows.append(Request(f"r{i}", prompts[i], params, frozenset(tokenizer.eos_token_ids), 10**7,
                                output_token_ids=list(outputs[i]), structured_output=state))
        return rows

    columns = {
        "greedy": requests(temperature=0),
        "top-p": requests(temperature=0.7, top_p=0.9),
        "top-p/top-k": requests(temperature=0.7, top_p=0.8, top_k=20),
        "top-k+repetition": requests(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
        "json+penalties+bias": requests(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=0.5,
                                        frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={5: 2.0, 9: -3.0},
                                        structured_output=grammar),
    }
    samplers = {"eager": Sampler(0, graphs=False)}
    if device.type == "cuda" and Sampler(0).graphs is not None:
        samplers["graphs"] = Sampler(0)
    results = {name: {mode: timed(lambda rows=rows, s=sampler: s.sample(logits, rows, str), args.repeats, device)
                      for mode, sampler in samplers.items()}
               for name, rows in columns.items()}
    planning = {name: host_planning_us(rows, args.vocab, args.repeats) for name, rows in columns.items()}
    if args.profile:
        for name, rows in columns.items():
            for mode, sampler in samplers.items():
                print_profile(f"{name} ({mode})", lambda rows=rows, s=sampler: s.sample(logits, rows, str), device)
    base = results["greedy"]["eager"]
    sampler = samplers.get("graphs", samplers["eager"])
    steps, added = decode_steps(args, device, sampler, columns) if args.step_layers else ({}, {})
    report = {"device": device_label(device), "batch": args.batch, "vocab": args.vocab,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "sampler_ms": results,
              "host_planning_us": planning,
              "decode_step_ms": steps, "added_to_the_8_layer_step_ms": added, "added_by": list(samplers)[-1]}
    print(f"sampler, {args.batch} rows x {args.vocab} vocab on {device} ({args.prompt_tokens} prompt and "
          f"{args.output_tokens} output tokens each); "
          f"each pass launched, run and read back (ms, median of {args.repeats})")
    for name, times in results.items():
        line = f"  {name:<22}" + "".join(f" {mode} {ms:8.3f} ms" for mode, ms in times.items())
        line += f"   eager {times['eager'] / base:5.2f}x eager greedy"
        if "graphs" in times:
            line += f"   graphs {times['eager'] / times['graphs']:5.2f}x faster than eager"
        line += f"   host planning {planning[name]:7.1f} us"
        for label, step in steps.items():
            line += f"   {100 * min(times.values()) / step:5.2f}% of {label}"
        print(line)
    if steps:
        print("decode steps (ms): " + ", ".join(f"{label} {step:.3f}" for label, step in steps.items()))
        target = steps[f"a {args.target_layers}-layer step"]
    if added:
        print(f"what sampling ({report['added_by']}) adds to a step (the 8-layer step, then the sampler on its "
              "logits, as the engine orders them; minus the step alone, alternated):")
        for name, ms in added.items():
            print(f"  {name:<22} {ms:8.3f} ms   {100 * ms / target:5.2f}% of a {args.target_layers}-layer step")
    name = f"sampler_cost_{report['device']}_b{args.batch}_p{args.prompt_tokens}.json"
    out = Path(__file__).parent / "results" / name
    out.write_text(json.dumps(report, indent=1))
    print(f"saved {out}")


def host_planning_us(rows: list[Request], vocab: int, repeats: int) -> float:
    """Median us of the host's part before any launch: the plan (`plan_rows`) and its packing (`PackedPlan`)."""
    keys = Sampler(0, graphs=False).row_keys(rows)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        PackedPlan(plan_rows(rows, vocab, keys))
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times[2:])[len(times[2:]) // 2]


def decode_steps(args, device: torch.device, sampler: Sampler, columns: dict[str, list[Request]]
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """The real-width stack's decode step at --batch (CUDA graphs, context 512) at 4 and 8 layers, and the
    step at --target-layers from the per-layer difference ({label: ms}); and what each column's sampling
    adds to the 8-layer step ({column: ms}, `added_by_sampling`)."""
    measured, added = {}, {}
    for layers in (4, 8):
        config = ModelConfig.from_dict(real_width_config(layers, small=device.type != "cuda"))
        model = build_model(config, torch.bfloat16, device)
        measured[layers] = measure(model, config, torch.bfloat16, device, args.batch, 512, 30)["step_ms"]
        if layers == 8 and config.vocab_size == args.vocab:  # the columns' grammars are built for --vocab
            added = added_by_sampling(model, config, device, args.batch, sampler, columns)
        elif layers == 8:
            print(f"(what sampling adds to a step: not measured; --vocab {args.vocab} is not the stack's "
                  f"{config.vocab_size})")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    per_layer = (measured[8] - measured[4]) / 4
    steps = {"the 4-layer step": measured[4], "the 8-layer step": measured[8],
             f"a {args.target_layers}-layer step": measured[4] + per_layer * (args.target_layers - 4)}
    return steps, added


def added_by_sampling(model, config, device: torch.device, batch: int, sampler: Sampler,
                      columns: dict[str, list[Request]], steps: int = 30, context: int = 512) -> dict[str, float]:
    """Median ms of a decode step (graph replay, then a device sync) and of the same step followed by each
    column's sampling on its logits, in the engine's order: the forward queued, the sampler's host work
    while the device runs it, its kernels after, the ids read back. The runs alternate step by step;
    {column: its median - the step's}. The logits are the stack's own (vocab = the model's)."""
    columns = {name: rows for name, rows in columns.items() if len(rows) == batch}
    blocks_each = (context + (len(columns) + 1) * (steps + 3) + BLOCK_SIZE) // BLOCK_SIZE + 1
    cache = ModelCache(config, batch, batch * blocks_each, BLOCK_SIZE, torch.bfloat16, device)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    runner = StaticDecodeRunner(model, cache, batch, blocks_each, "cuda_graph" if device.type == "cuda" else "eager",
                                sizes=[batch])
    gen = torch.Generator().manual_seed(batch)
    position = context

    def step() -> torch.Tensor:
        nonlocal position
        tokens = torch.randint(2, config.vocab_size, (batch,), generator=gen).tolist()
        inputs = ForwardBatch.build([[t] for t in tokens], [position] * batch, list(range(batch)), tables,
                                    BLOCK_SIZE, device=device)
        position += 1
        return runner.run(inputs)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {"step": [], **{name: [] for name in columns}}
    for repeat in range(steps + 3):
        for name, samples in times.items():
            sync()
            began = time.perf_counter()
            logits = step()
            if name == "step":
                sync()
            else:
                sampler.sample(logits, columns[name], str)
            if repeat >= 3:  # the first three: warm-up
                samples.append(time.perf_counter() - began)
    median = {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return {name: median[name] - median["step"] for name in columns}

if __name__ == "__main__":
    main()
