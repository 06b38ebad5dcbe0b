"""Host time between decode steps, overlap scheduling off vs on (or, with --ab sampler-graphs, the sampler's
passes launched eagerly vs replayed from CUDA graphs, overlap on), side by side (from the engine's --trace).

For each batch size: B requests (greedy, or with --sampling default the default model's generation config:
temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05) decode --steps tokens each through the whole
engine (scheduler, runner, sampler, detokenizer), once with each setting; the step trace of each run gives,
over the decode steps after --warmup:
- step ms: wall time from one step's end to the next's;
- host ms: the part of a step the host is busy, not waiting for the device (CPU: the step minus the
  forward and the sampler, which run inline there; CUDA: the step minus the wait for the sampled ids);
- gap ms (CUDA): device time from the end of one forward (graph replay) to the start of the next,
  measured with CUDA events: sampling, the input copy and any time the device waited for the host (the
  issue's target: at most 0.1 ms). On CPU the forward runs inline, so overlap cannot hide the host time
  there; its host ms says how much a device would have to hide.

    python bench/host_overlap.py                                   # CPU, the tiny demo model
    python bench/host_overlap.py --static-eager                    # CPU, through the graphs' input path
    python bench/host_overlap.py --device cuda --demo small --batch 1 16 --steps 256
    python bench/host_overlap.py --device cuda --model DIR --dtype bfloat16 --batch 1 16
    python bench/host_overlap.py --device cuda --demo small --sampling default --ab sampler-graphs
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from tierlm.demo_model import build_demo_model
from tierlm.engine.llm_engine import EngineConfig, LLMEngine
from tierlm.sampling_params import SamplingParams

SAMPLING = {"greedy": {"temperature": 0},
            "default": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "seed": 0}}


def run(args, model: str, batch: int, on: bool, trace_path: Path) -> dict[str, float]:
    """One engine run with the A/B's setting off or on."""
    overlap = on or args.ab != "overlap"
    os.environ["TIERLM_NO_SAMPLER_GRAPHS"] = "1" if args.ab == "sampler-graphs" and not on else "0"
    if args.static_eager:  # CPU: the engine's own static runner (the graphs' host-list path), run eagerly
        os.environ["TIERLM_STATIC_DECODE_EAGER"] = "1"
    engine = LLMEngine(EngineConfig(
        model=model, dtype=args.dtype, device=args.device, max_num_seqs=batch, max_model_len=args.max_model_len,
        max_num_batched_tokens=max(256, batch * args.prompt_tokens), trace=str(trace_path),
        async_scheduling=overlap, load_format=args.load_format, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    ))
    assert engine.overlap is overlap
    params = SamplingParams(**SAMPLING[args.sampling], max_tokens=args.warmup + args.steps + 1, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(7 + 31 * i + 17 * j) % (vocab - 2) + 1 for j in range(args.prompt_tokens)]
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    atexit.unregister(engine.trace.flush)  # written; its folder is gone at exit
    return summarize(json.loads(trace_path.read_text())["traceEvents"], batch, args.warmup,
                     cuda=engine.cache.device.type == "cuda")


def summarize(events: list[dict], batch: int, warmup: int, cuda: bool) -> dict[str, float]:
    """Medians over the decode steps (every request decoding one token) after the first `warmup`."""
    marks = sorted((e for e in events if e["name"] == "step"), key=lambda e: e["ts"])
    decode = [m["args"]["step"] for m in marks if m["args"]["tokens"] == batch][warmup:]
    end_of = {m["args"]["step"]: m["ts"] for m in marks}
    per_step: dict[int, dict[str, float]] = {}
    for event in events:
        if event["ph"] == "X":
            phases = per_step.setdefault(event["args"]["step"], {})
            phases[event["name"]] = phases.get(event["name"], 0.0) + event["dur"]
    rows, phase_times = [], {}
    for step in decode:
        if step - 1 not in end_of:
            continue
        wall = end_of[step] - end_of[step - 1]
        phases = per_step.get(step, {})
        for name, duration in phases.items():
            phase_times.setdefault(name, []).append(duration)
        device = phases.get("read sampled ids", 0.0) if cuda else (
            phases.get("launch forward", 0.0) + phases.get("sample", 0.0))
        forward = phases.get("forward") if cuda else phases.get("launch forward")
        rows.append((wall, wall - device, phases.get("between forwards"), forward))
    def median_ms(values: list) -> float:
        values = [v for v in values if v is not None]
        return statistics.median(values) / 1000 if values else float("nan")

    return {"step": median_ms([r[0] for r in rows]), "host": median_ms([r[1] for r in rows]),
            "gap": median_ms([r[2] for r in rows]), "forward": median_ms([r[3] for r in rows]), "steps": len(rows),
            "phases": {name: median_ms(times) for name, times in phase_times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a demo model, --demo)")
    parser.add_argument("--demo", default="tiny", choices=["tiny", "small"], help="the demo model to build")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=48, help="decode steps measured")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps left out first")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20, help="the cache budget (small: fast start)")
    parser.add_argument("--static-eager", action="store_true",
                        help="CPU: decode steps through the StaticDecodeRunner's host-list path (what CUDA "
                        "graphs take), run eagerly, instead of the plain forward")
    parser.add_argument("--phases", action="store_true", help="also each host phase's median, off and on")
    parser.add_argument("--sampling", default="greedy", choices=list(SAMPLING), help="the requests' sampling")
    parser.add_argument("--ab", default="overlap", choices=["overlap", "sampler-graphs"],
                        help="what is off and on: overlap scheduling, or the sampler's CUDA graphs (overlap on)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads (1: no OpenMP spin on a busy host)")
    args = parser.parse_args()
    torch.set_num_threads(args.cpu_threads)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = args.model or str(build_demo_model(scratch / args.demo, args.demo))
        device = args.device if args.device != "cuda" else torch.cuda.get_device_name()
        path = " (static runner, eager)" if args.static_eager and args.device == "cpu" else ""
        print(f"# host time between decode steps: {args.model or 'demo ' + args.demo}, {device}{path}, "
              f"{args.sampling} sampling, {args.steps} steps after {args.warmup}; off / on: {args.ab}; "
              "medians in ms (gap: CUDA only)")
        print(f"{'batch':>5} | {'step off':>8} {'step on':>8} {'ratio':>6} | {'host off':>8} {'host on':>8} | "
              f"{'gap off':>8} {'gap on':>8} {'ratio':>6} | {'forward':>8}")
        for batch in args.batch:
            off = run(args, model, batch, False, scratch / f"off-{batch}.json")
            on = run(args, model, batch, True, scratch / f"on-{batch}.json")
            print(f"{batch:>5} | {off['step']:8.3f} {on['step']:8.3f} {off['step'] / on['step']:5.2f}x | "
                  f"{off['host']:8.3f} {on['host']:8.3f} | {off['gap']:8.3f} {on['gap']:8.3f} "
                  f"{off['gap'] / on['gap'] if on['gap'] == on['gap'] and on['gap'] else float('nan'):5.2f}x | "
                  f"{on['forward']:8.3f}")
            if args.phases:
                for name in dict.fromkeys([*off["phases"], *on["phases"]]):
                    print(f"{'':>5} | {name:>26}: off {off['phases'].get(name, 0):8.3f}  on {on['phases'].get(name, 0):8.3f}")


if __name__ == "__main__":
    main()
