"""A 200-token request's decode step time at max_model_len 8k vs 262k, side by side as a ratio.

Demo-scale model (built if missing), one request prefilled to --context tokens, then --steps decode steps
through the static decode runner (CUDA graphs on GPU, padded eager batches on CPU) at each max_model_len.
Two columns: block tables prepared in widths that grow with the context (what the engine runs), and one
width of max_model_len's blocks (how decode ran before: the indexer scored every compressed key up to
max_model_len each step). Results go to bench/results/context_cost_<device>.txt.

    python bench/context_cost.py                 # CPU
    python bench/context_cost.py --device cuda   # the GPU: CUDA graphs
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import re
import time
from pathlib import Path

import torch

from tierlm.demo_model import build_demo_model
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{platform.machine()}"


def step_times(model, cache: ModelCache, sides: dict, context: int, steps: int) -> dict:
    """Best seconds of one decode step of the prefilled request (slot 0, blocks 0..) per side
    {name: (max_model_len, one_width)}. The sides take turns step by step, so that load from other
    processes falls on all of them alike."""
    mode = "cuda_graph" if cache.device.type == "cuda" else "eager"
    runners = {}
    for name, (max_model_len, one_width) in sides.items():
        max_blocks = math.ceil(max_model_len / BLOCK_SIZE)
        runners[name] = StaticDecodeRunner(model, copy.deepcopy(cache), 1, max_blocks, mode,
                                           widths=[max_blocks] if one_width else None)
    times = {name: [] for name in sides}
    for step in range(steps + 2):  # the first two are warm-up
        position = context + step
        table = list(range(position // BLOCK_SIZE + 1))
        batch = ForwardBatch.build([[5 + step]], [position], [0], [table], BLOCK_SIZE, device=cache.device)
        names = list(runners)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            if cache.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            runners[name].run(batch)
            if cache.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: min(t[2:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-model-lens", type=int, nargs=2, default=[8192, 262_144])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (one: steadier on a shared machine)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    folder = ROOT / "models" / f"demo-{args.size}"
    if not (folder / "config.json").exists():
        build_demo_model(folder, args.size)
    with torch.inference_mode():
        model, config = load_model(folder, device=device)
        blocks = math.ceil((args.context + args.steps + 2) / BLOCK_SIZE) + 1
        cache = ModelCache(config, 1, blocks, BLOCK_SIZE, next(model.parameters()).dtype, device)
        cache.reset_slot(0)
        prompt = torch.randint(3, config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
        table = list(range(args.context // BLOCK_SIZE + 1))
        model(ForwardBatch.build([prompt.tolist()], [0], [0], [table], BLOCK_SIZE, device=device), cache)
        sides = {(length, one_width): (length, one_width) for length in args.max_model_lens for one_width in (False, True)}
        results = step_times(model, cache, sides, args.context, args.steps)
    short, long = args.max_model_lens
    lines = [
        (f"demo-{args.size} on {device_name(device)}: decode step of a {args.context}-token request, "
         f"best of {args.steps} steps (ms)"),
        f"{'max_model_len':>14}{'widths by context':>20}{'one full width':>17}",
        *(f"{n:>14,}{results[n, False] * 1e3:>20.2f}{results[n, True] * 1e3:>17.2f}" for n in (short, long)),
        (f"{f'{long / 1000:.0f}k / {short / 1000:.0f}k':>14}{results[long, False] / results[short, False]:>20.3f}"
         f"{results[long, True] / results[short, True]:>17.3f}"),
    ]
    print("\n".join(lines))
    out = ROOT / "bench" / "results" / f"context_cost_{device_name(device)}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
