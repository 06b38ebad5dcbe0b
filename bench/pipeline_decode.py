"""Pipeline parallel decode: PP=1 on one device against PP=2 over two (issue 13's figures).

For each pipeline size it starts the engine on MODEL (default: the `small` demo model, 8 layers in bf16,
built once into ~/.cache/tierlm/demo-small), then for 1 and 4 streams decodes --tokens tokens per stream
after their prefills and prints decode tok/s side by side with the PP=2 / PP=1 ratio. For PP=2 also:
- each rank's device memory (what its allocator holds, CUDA) against its plan (weights + cache);
- the stage-to-stage copy of one step's hidden state (a [streams, hc * hidden] round trip between ranks
  0 and 1, halved: `PipelineDriver.echo_seconds`);
- how much of that the deferred receive hides: per step, rank 1's host work done while its receive was
  posted (builds the batch, replays cache ops) and the time its compute still waited for the hidden
  state after that work (the stream's stall on CUDA, measured with events);
- each rank's host time per step that is its own work, waits left out (r0 host, r1 host), and rank 1's
  host held by its device (r1 held: after launching step t+1 it waits for its device to have sampled
  step t, then reads t back; harmless while that ends before the next step's message comes, which rank
  0 sends only once it has t's ids; a last rank that read t back before launching t+1 would show its
  whole layers and sampling here): a step cannot take less than the larger host, nor less than the
  device chain (both stages' layers, the sampling, two copies);
- where each rank's time goes per pipeline step (`PipelineDriver.timing`, the workers' phases): rank 0
  schedules (micro-batches only), waits for the previous step's sampled ids (overlap scheduling, CPU: the
  host's wait; CUDA: ~0, the stream's wait is queued in own layers), prepares the step, sends it, runs its layers and reads the step's
  sampled ids (and the last rank's answer, for log-probabilities only) (the rest of its step is the
  engine's own work: scheduling with overlap, applying tokens, detokenizing); rank 1 waits for the
  message, does its host work, launches its layers, launches the sampling (the ids go to rank 0's device),
  waits for its device to have sampled the step before ("read wait") and reads it back (+ its answer, if
  any); on CUDA also its stream's time in the layers, and how many steps ran from the static decode runners
  on each rank.
With overlap scheduling (the default) a step is one batch of every stream, launched before the host has
read the previous step's ids; --no-async-scheduling runs micro-batches instead (up to 2 in flight).
Results go to bench/results/pipeline_decode_<device>_<model>.json (e.g. nvidia-h200-x2_demo-small). On CPU
the figures only show that the script runs: the ranks share the cores (each gets cores / N threads), so PP=1 and PP=2 do not compare.

    python bench/pipeline_decode.py --device cuda                  # 2 GPUs: demo-small, bf16
    python bench/pipeline_decode.py --device cuda --model DIR      # any checkpoint folder
    python bench/pipeline_decode.py --device cuda --real-width 8   # decode_roofline's real-width stack, 8 layers
    python bench/pipeline_decode.py --device cpu --small           # the tiny demo model on CPU (gloo ranks)
    python bench/pipeline_decode.py --device cuda --no-async-scheduling   # micro-batches, no overlap
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from device_timing import device_label
from long_context_resident import model_dir

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model

STREAMS = (1, 4)


def demo_model(size: str) -> Path:
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm" / f"demo-{size}"
    if not (folder / "config.json").is_file():
        print(f"building the {size} demo model in {folder} (once)")
        build_demo_model(folder, size, overwrite=True)
    return folder


def decode_rate(llm: LLM, streams: int, tokens: int, snapshot=dict) -> dict:
    """tok/s of the decode steps of `streams` requests (their prefills run first, untimed); snapshot()
    is read when the timed steps start and when they end (returned as "before" and "after")."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    requests = [engine.add_request(f"# stream {i}\ndef f(x):", params) for i in range(streams)]
    token_ids = {request: [] for request in requests}
    while min(map(len, token_ids.values())) < 1:  # every stream has its first token: prefills done
        for out in engine.step():
            token_ids[out.request_id] = list(out.outputs[0].token_ids)
    before = snapshot()
    start_tokens, start, steps = sum(map(len, token_ids.values())), time.perf_counter(), 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            token_ids[out.request_id] = list(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    decoded = sum(map(len, token_ids.values())) - start_tokens
    return {"streams": streams, "tokens": decoded, "seconds": seconds, "tok_s": decoded / seconds, "steps": steps,
            "token_ids": list(token_ids.values()), "before": before, "after": snapshot()}


def run(model: str, pp: int, args) -> dict:
    options = {"dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": 4,
               "async_scheduling": args.async_scheduling}
    if args.real_width:
        options["load_format"] = "dummy"  # random weights drawn at load: nothing written to disk
    if args.kv_cache_memory_bytes:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    llm = LLM(model, **options, pipeline_parallel_size=pp)
    engine = llm.engine
    try:
        decode_rate(llm, 1, 4)  # warm-up (kernels, graphs)
        result = {"pp": pp, "rates": []}
        for streams in STREAMS:
            rate = decode_rate(llm, streams, args.tokens, functools.partial(_counters, engine))
            before, after = rate.pop("before"), rate.pop("after")
            rate["static_steps"] = after["static_steps"] - before["static_steps"]
            if engine.pipeline:
                rate["rank0"] = _per_step(before["rank0"], after["rank0"])
                rate["rank1"] = _per_step(before["rank1"], after["rank1"])
                config = engine.model_config
                shape = (streams, config.hc_count * config.hidden_size)
                rate["transfer_s"] = engine.pipeline.echo_seconds(shape, engine.cache.dtype)
            result["rates"].append(rate)
        result["memory"] = _memory(engine)
        return result
    finally:
        engine.close()
        del llm, engine
        gc.collect()  # the next run's budget is the device's free memory: this one's must be gone
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _counters(engine) -> dict:
    """The counters the phase table is made of: steps run from the static decode runner (rank 0); with
    a pipeline, rank 0's phases and rank 1's."""
    counters = {"static_steps": engine.runner.static_steps}
    if engine.pipeline:
        counters |= {"rank0": engine.pipeline.timing, "rank1": engine.pipeline.worker_stats()[0]}
    return counters


def _per_step(before: dict, after: dict) -> dict:
    """Each phase's seconds per step between two readings of a rank's counters, and the steps."""
    steps = max(after["steps"] - before["steps"], 1)
    per_step = {key: (after[key] - before[key]) / steps for key in after if key.endswith("_seconds")}
    return per_step | {"steps": after["steps"] - before["steps"],
                       "static_steps": after.get("static_steps", 0) - before.get("static_steps", 0)}


def _memory(engine) -> list[dict]:
    """Per rank: the allocator's bytes (CUDA) beside the plan's weights + cache."""
    from tierlm.engine.stage_setup import memory_report

    if engine.pipeline is None:
        plan, device = engine.cache_plan, engine.cache.device
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        return [{"rank": 0, "plan_device_bytes": plan.weights_bytes + plan.device_bytes(),
                 "device_memory_allocated": allocated}]
    ranks = [dict(rank=0, **memory_report(engine.pipeline.stage))]
    return ranks + [{k: s[k] for k in ("rank", "plan_device_bytes", "device_memory_allocated")}
                    for s in engine.pipeline.worker_stats()]


def report(results: dict[int, dict]) -> None:
    one, two = results[1], results[2]
    print(f"\n{'streams':>8} {'PP=1 tok/s':>11} {'PP=2 tok/s':>11} {'PP2/PP1':>8} {'copy ms':>8} "
          f"{'host ms':>8} {'stall ms':>9} {'hidden':>7} {'tokens':>7} {'r0 host':>8} {'r1 host':>8} {'r1 held':>8}")
    for a, b in zip(one["rates"], two["rates"]):
        r1, copy = b["rank1"], b["transfer_s"]
        hidden = min(r1["host_seconds"], copy) / copy if copy else 0.0
        same = "same" if b["same_tokens_as_pp1"] else "differ"
        print(f"{a['streams']:>8} {a['tok_s']:>11.1f} {b['tok_s']:>11.1f} {b['tok_s'] / a['tok_s']:>8.2f} "
              f"{copy * 1e3:>8.3f} {r1['host_seconds'] * 1e3:>8.3f} {r1['stall_seconds'] * 1e3:>9.3f} {hidden:>7.0%} "
              f"{same:>7} {_rank0_host(b) * 1e3:>8.3f} {_rank1_host(r1) * 1e3:>8.3f} "
              f"{r1.get('read_wait_seconds', 0.0) * 1e3:>8.3f}")
    print("  copy: one stage-to-stage hidden state copy; host: rank 1's work per step while its receive was "
          "posted; stall: what its compute still waited after that; hidden: share of the copy the host work covers; "
          "tokens: PP=2's greedy tokens against PP=1's (micro-batches change the batch shapes, so bf16 may differ); "
          "r0 host / r1 host: each rank's own host work per step, its waits for the other rank left out (a step "
          "takes at least the larger); r1 held: rank 1's host waiting for its device before reading step t back, "
          "after launching t+1 (small unless its host lags its device)")
    print("\nPP=2, where a pipeline step's time goes (ms per step; host phases, then the device streams):")
    for a, b in zip(one["rates"], two["rates"]):
        print(_phases(a, b))
    for pp, result in results.items():
        for rank in result["memory"]:
            allocated = rank["device_memory_allocated"]
            measured = "n/a (CPU)" if allocated is None else f"{allocated:,} B ({allocated / rank['plan_device_bytes']:.2f}x)"
            print(f"PP={pp} rank {rank['rank']}: planned {rank['plan_device_bytes']:,} B, allocated {measured}")


def _rank0_host(two: dict) -> float:
    """Rank 0's host work per step: the step's time less its waits for the last rank (ids, answer)."""
    r0, steps = two["rank0"], max(two["steps"], 1)
    return two["seconds"] / steps - r0["ids_wait_seconds"] - r0["wait_seconds"]


def _rank1_host(r1: dict) -> float:
    """Rank 1's host work per step: its phases less its waits (message, hidden state, its device)."""
    waits = ("idle_seconds", "receive_wait_seconds", "read_wait_seconds")
    return sum(v for k, v in r1.items() if k.endswith("_seconds") and k not in waits
               and k not in ("stall_seconds", "layers_seconds"))


def _phases(one: dict, two: dict) -> str:
    """One stream count's phase lines: rank 0's host phases (the rest of its step is the engine's own work:
    applying tokens, detokenizing), rank 1's, and both ranks' stream time."""
    r0, r1 = two["rank0"], two["rank1"]
    steps = max(two["steps"], 1)
    host0 = sum(r0[k] for k in r0 if k.endswith("_seconds") and k != "layers_seconds") * r0["steps"]

    def ms(row: dict, key: str) -> str:
        return f"{row.get(key, 0.0) * 1e3:.3f}"

    return (f"  {two['streams']} streams: step {two['seconds'] / steps * 1e3:.3f} (PP=1: "
            f"{one['seconds'] / max(one['steps'], 1) * 1e3:.3f} per step of all streams)\n"
            f"    rank 0: schedule {ms(r0, 'schedule_seconds')}, ids wait {ms(r0, 'ids_wait_seconds')}, prepare "
            f"{ms(r0, 'prepare_seconds')}, send "
            f"{ms(r0, 'send_seconds')}, own layers {ms(r0, 'forward_seconds')}, read ids "
            f"{ms(r0, 'wait_seconds')}, engine rest {(two['seconds'] - host0) / steps * 1e3:.3f}\n"
            f"    rank 1: wait for message {ms(r1, 'idle_seconds')}, host {ms(r1, 'host_seconds')}, receive wait "
            f"{ms(r1, 'receive_wait_seconds')}, launch layers {ms(r1, 'forward_seconds')}, sample "
            f"{ms(r1, 'sample_seconds')}, read wait {ms(r1, 'read_wait_seconds')}, read back "
            f"{ms(r1, 'send_seconds')}\n"
            f"    streams: rank 0 layers {ms(r0, 'layers_seconds')}; rank 1 stall {ms(r1, 'stall_seconds')}, layers "
            f"{ms(r1, 'layers_seconds')}; steps from graphs: rank 0 {r0['static_steps']}/{r0['steps']}, rank 1 "
            f"{r1['static_steps']}/{r1['steps']} (PP=1 {one['static_steps']}/{one['steps']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a demo model)")
    parser.add_argument("--small", action="store_true", help="the tiny demo model, fp32 (CPU check)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="decode tokens per stream (default 128; 16 small)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--real-width", type=int, default=None, metavar="LAYERS",
                        help="the real-width stack of decode_roofline.py with this many layers (random weights)")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="no overlap scheduling (PP=1 serial steps; PP=2 micro-batches in flight)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.small or args.device == "cpu" else "bfloat16")
    args.tokens = args.tokens or (16 if args.small else 128)
    with tempfile.TemporaryDirectory() as folder:
        if args.real_width:
            model = str(model_dir(Path(folder), args.small, args.max_model_len, args.real_width))
        else:
            model = args.model or str(demo_model("tiny" if args.small else "small"))
        results = {pp: run(model, pp, args) for pp in (1, 2)}
    for a, b in zip(results[1]["rates"], results[2]["rates"]):
        b["same_tokens_as_pp1"] = a.pop("token_ids") == b.pop("token_ids")
    report(results)
    device = device_label(torch.device(args.device))
    if args.device == "cuda":  # e.g. nvidia-h200-x2
        device += f"-x{torch.cuda.device_count()}"
    which = (f"real{args.real_width}" if args.real_width
             else "model" if args.model else f"demo-{'tiny' if args.small else 'small'}")
    tag = f"_{which}" + ("" if args.async_scheduling else "_serial")
    out = Path(__file__).parent / "results" / f"pipeline_decode_{device}{tag}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": model, "dtype": args.dtype, "host": platform.node(),
                               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "results": results}, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
