"""End-to-end decode tok/s with QSA K/V on the device, in host pools, and in host pools + row cache.
(Each measured request follows a short warm-up request; decode is timed from its first token on, and
the prefill before it, through the staging arena when offloaded, is reported beside it.)

Demo-scale model (built if missing), one request at 8k and at 32k tokens of context, greedy, decode
steps through the engine (CUDA graphs on GPU); also checks that the row cache changes no token, nor
do host pools (the same attention kernel reads device pools on CUDA).

    python bench/qsa_offload_decode.py --device cuda
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

ROOT = Path(__file__).resolve().parent.parent


def decode_rate(llm: LLM, prompt: list[int], steps: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode tok/s timed from the first token, token ids) of one request."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    submitted, start, out = time.perf_counter(), None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if start is None and out.outputs[0].token_ids:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                start = time.perf_counter()
    return start - submitted, steps / (time.perf_counter() - start), out.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    model = ROOT / "models" / f"demo-{args.size}"
    if not (model / "config.json").exists():
        build_demo_model(model, args.size)
    max_len = max(args.contexts) + args.steps + 16
    sides = {
        "device pools": {"qsa_kv_offload": False},
        "host pools": {"qsa_kv_offload": True, "qsa_row_cache": False},
        "host + row cache": {"qsa_kv_offload": True, "qsa_row_cache": True},
    }
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, 4000, (n,), generator=gen).tolist() for n in args.contexts}
    results, prefill, tokens = {}, {}, {}
    for side, options in sides.items():
        llm = LLM(str(model), device=args.device, max_model_len=max_len, max_num_seqs=1,
                  enable_prefix_caching=False, **options)
        for n, prompt in prompts.items():
            decode_rate(llm, prompt[:600], 4)  # warm-up (decode runs fixed shapes: a short prompt does)
            prefill[side, n], results[side, n], tokens[side, n] = decode_rate(llm, prompt, args.steps)
        del llm
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    print(f"model demo-{args.size} on {args.device}, {args.steps} decode steps")
    print(f"{'context':>8}" + "".join(f"{side + ' tok/s':>24}" for side in sides)
          + f"{'cache = no cache':>18}{'host = device':>15}")
    for n in args.contexts:
        row = "".join(f"{results[side, n]:>24.1f}" for side in sides)
        cached_same = tokens["host + row cache", n] == tokens["host pools", n]
        host_same = tokens["host pools", n] == tokens["device pools", n]
        print(f"{n:>8}{row}{cached_same!s:>18}{host_same!s:>15}")
    print(f"{'context':>8}" + "".join(f"{side + ' prefill s':>28}" for side in sides))
    for n in args.contexts:
        print(f"{n:>8}" + "".join(f"{prefill[side, n]:>28.2f}" for side in sides))


if __name__ == "__main__":
    main()
