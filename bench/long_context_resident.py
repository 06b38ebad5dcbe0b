"""Four requests of ~247k tokens resident at once, QSA K/V in host RAM, and batch invariance of their decode.

Issue 10's check at the target model's real layer widths: the 4-layer stack of `decode_roofline.py` (3 GDN
+ 1 QSA, 512 experts, hc 4, PLE on one layer; random weights through `--load-format dummy`, so no checkpoint
is written) served by the engine with `--qsa-kv-offload` at max_model_len 262,144 and max_num_seqs 4.
Four distinct random prompts of --context tokens are submitted together and decoded greedily (each request
generates enough tokens that all four then decode together for --steps steps); then each prompt is run alone on the same engine (prefix caching off, so every prefill is
recomputed). Printed: the plan (device and host tiers), whether all four were decoding at once with no
preemption, prefill tok/s, decode tok/s at batch 4 and at batch 1, the host K/V pool, the device peak, and
for each request whether its tokens equal those of its run alone, and the largest |logprob| difference of
the chosen tokens over the positions where they agree.

    python bench/long_context_resident.py --device cuda                      # H200, bf16, 4 x 252,928 tokens
    python bench/long_context_resident.py --device cuda --dtype float32      # the same in fp32
    python bench/long_context_resident.py --device cpu --small               # shrunk widths, to check the script

The runs can be split over several processes (each under a time limit): with `--progress FILE` the finished
runs (the together run, then each run alone) are saved to FILE after each one and skipped when the script is
run again with the same FILE; `--budget-s` stops starting runs alone that would not finish in time (each is
estimated from the together run's time per request). The report covers what FILE holds.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from decode_roofline import real_width_config

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{platform.machine()}"


def model_dir(folder: Path, small: bool, max_len: int, layers: int = 4, mtp: bool = False) -> Path:
    """config.json of the real-width stack (`layers` layers; mtp: and an MTP draft head of one layer) beside
    the demo tokenizer's files (the weights are drawn)."""
    demo = ROOT / "models" / "demo-tiny"
    if not (demo / "config.json").exists():
        build_demo_model(demo, "tiny")
    for name in TOKENIZER_FILES:
        shutil.copy(demo / name, folder / name)
    config = real_width_config(layers, small) | {
        "architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text", "dtype": "bfloat16",
        "max_position_embeddings": max_len,
    } | ({"mtp_num_hidden_layers": 1} if mtp else {})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit `prompts` together and step to the end: tokens, chosen-token logprobs, timings, residency."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    results, all_decoding, decode_steps, decode_seconds = {}, False, 0, 0.0
    preempted_before = engine.stats().num_preemptions
    sync()
    began = time.perf_counter()
    prefill_done = None
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decoding = len(running) == len(prompts) and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        if decoding and prefill_done is None:
            prefill_done = time.perf_counter()
        all_decoding |= decoding
        step_began = time.perf_counter()
        outputs = engine.step()
        sync()
        if decoding:
            decode_steps += 1
            decode_seconds += time.perf_counter() - step_began
        for out in outputs:
            if out.finished:
                results[out.request_id] = out.outputs[0]
    stats = engine.stats()
    return {
        "tokens": [results[i].token_ids for i in ids],
        "logprobs": [[pos[tok].logprob for pos, tok in zip(results[i].logprobs, results[i].token_ids)]
                     for i in ids],
        "prefill_seconds": (prefill_done or time.perf_counter()) - began,
        "decode_tok_s": decode_steps * len(prompts) / decode_seconds if decode_seconds else float("nan"),
        "all_resident_decoding": all_decoding,
        "preemptions": stats.num_preemptions - preempted_before,
        "device_peak": stats.device_memory_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--small", action="store_true", help="shrunk widths and context (a CPU check)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 252,928 = 247k)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32,
                        help="decode steps with every request decoding (each request generates more: it decodes "
                        "while the later ones prefill)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default 262,144 (small: 4,096)")
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--progress", type=Path, default=None, help="JSON of the finished runs (see above)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run alone that would end later")
    args = parser.parse_args()
    began = time.perf_counter()
    context = args.context or (3000 if args.small else 247 * 1024)
    max_len = args.max_model_len or (4096 if args.small else 262_144)
    # the first request decodes one token a step while the others prefill, chunk by chunk
    max_tokens = args.steps + (args.requests - 1) * -(-context // args.chunk) + args.requests
    if context + max_tokens > max_len:
        parser.error(f"--context {context} + {max_tokens} generated tokens exceed max_model_len {max_len}")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (context,), generator=gen).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(str(model_dir(Path(folder), args.small, max_len)), load_format="dummy", dtype=args.dtype,
                  device=args.device, max_model_len=max_len, max_num_seqs=args.requests,
                  max_num_batched_tokens=args.chunk, qsa_kv_offload=True, enable_prefix_caching=False)
        plan = llm.engine.cache_plan.lines()
        run(llm, [prompts[0][:600]], 4)  # warm-up: kernels compiled, decode graphs captured
        done = json.loads(args.progress.read_text()) if args.progress and args.progress.is_file() else {}

        def save() -> None:
            if args.progress:
                args.progress.write_text(json.dumps(done))

        if "together" not in done:
            done["together"] = run(llm, prompts, max_tokens)
            save()
        together, finished = done["together"], done.setdefault("alone", {})
        per_request = (together["prefill_seconds"] + max_tokens * args.requests / together["decode_tok_s"]
                       ) / args.requests
        for i, prompt in enumerate(prompts):
            late = args.budget_s and time.perf_counter() - began + 1.5 * per_request > args.budget_s
            if str(i) not in finished and not late:
                finished[str(i)] = run(llm, [prompt], max_tokens)
                save()
    alone = [finished[str(i)] for i in range(args.requests) if str(i) in finished]
    if len(alone) < args.requests:
        print(f"runs alone done: {sorted(map(int, finished))} of {args.requests}; run again with the same "
              f"--progress for the rest")
    single_tok_s = sum(a["decode_tok_s"] for a in alone) / len(alone) if alone else float("nan")
    lines = [
        (f"{'small' if args.small else 'real'} widths, 4 layers (3 GDN + 1 QSA), {args.dtype} on "
        f"{device_name(args.device)}; {args.requests} requests of {context:,} prompt tokens, max_model_len "
        f"{max_len:,}, QSA K/V in host pools, prefill chunks of {args.chunk:,}, {max_tokens} greedy tokens each"),
        *plan,
        (f"all {args.requests} resident and decoding at once: {together['all_resident_decoding']}; "
        f"preemptions: {together['preemptions']}; device peak {together['device_peak'] / 2**30:.2f} GiB"),
        (f"prefill of all {args.requests}: {together['prefill_seconds']:.1f} s "
        f"({args.requests * context / together['prefill_seconds']:,.0f} tok/s)"),
        (f"decode tok/s: batch {args.requests} {together['decode_tok_s']:.1f}, batch 1 {single_tok_s:.1f} (mean of "
        f"the runs alone); ratio {together['decode_tok_s'] / single_tok_s:.2f}"),
        f"{'request':>8}{'tokens = alone':>16}{'first difference':>18}{'max |dlogprob|':>16}",
    ]
    equal = 0
    for i, single in sorted((int(k), v) for k, v in finished.items()):
        mine, theirs = together["tokens"][i], single["tokens"][0]
        same = mine == theirs
        equal += same
        first = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        agree = len(mine) if first is None else first
        delta = max((abs(a - b) for a, b in zip(together["logprobs"][i][:agree], single["logprobs"][0][:agree])),
                    default=0.0)
        lines.append(f"{i:>8}{same!s:>16}{'-' if first is None else first:>18}{delta:>16.2e}")
    lines.append(f"batch invariance: {equal} of {len(alone)} requests run alone ({args.requests} in all) equal "
                 "their tokens in the batch")
    print("\n".join(lines))
    out = ROOT / "bench" / "results" / (
        f"long_context_resident_{device_name(args.device)}_{args.dtype}{'_small' if args.small else ''}.txt")
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
