"""Decode against the memory roofline at the target model's real layer widths (issue 12's measuring stick).

Builds the real-width Qwen4-Exp stack with random weights (hidden 2560, vocab 248,320, 512 experts top-10 of
width 640 and a shared expert of 640, GDN 16 key / 48 value heads of 128, QSA 24 heads over 2 KV heads of
256, indexer 8 heads x 128 with budget 2048 and ratio 4, 4 hyper-connection streams of low rank 320, PLE on
the second layer; N layers at 3 GDN : 1 QSA, default 4), measures the device's copy bandwidth in the same
run, then for each context and batch size decodes through `StaticDecodeRunner` (CUDA graphs on a GPU) and
prints: tok/s, bytes read per step (the weights a step touches: every dense weight, the routed experts'
rows, one embedding row per token, the PLE rows; plus the GDN state read and written and the QSA rows the
attention and indexer read), % of the roofline (those bytes at the copy bandwidth), kernels per step,
host time per step (wall time of `run_decode` beyond the GPU time of the replay), and a per-part table of
kernel time from one profiled step of the same fixed-shape batch run eagerly. A step is staged as the
engine stages a decode step under overlap scheduling (`StaticDecodeRunner.run_decode`: host lists in one
copy, each row's input id the previous step's sampled id, taken on the device).

The PLE table is shrunk (n-gram vocab 100,000 rows per head instead of 20,000,000): a step reads 16 rows
of it per token either way. Results go to bench/results/decode_roofline_<device>.json.

`--quantize int4-mixed` (or another `tierlm quantize` scheme) also quantizes the same random model in
memory after the bf16 run, each module in the format the scheme's quantization_config gives it (INT4
routed experts, INT6 shared expert, INT8 per-channel embedding, lm_head and hyper-connection
projections), round-to-nearest (`kernels/quant_linear/packing.quantize`; `tierlm quantize` adds a clip
search, which changes values, not bytes or speed), runs the same measurements and prints both side by
side with their tok/s ratio (results: decode_roofline_<device>_<scheme>.json).

`--ab SWITCH` (an environment variable the step reads as it launches or captures, e.g. TIERLM_NO_PDL)
measures every (context, batch) twice in the same process: with SWITCH unset (the table above it), then
set to 1 (its graphs captured again), and prints both tok/s and their ratio (unset / set: what the
feature a kill switch turns off gains); the results JSON holds both sides (each row's "ab").

    python bench/decode_roofline.py --device cuda                 # 4 layers, contexts 512 and 8192, batches 1/4/16
    python bench/decode_roofline.py --device cuda --quantize int4-mixed --contexts 512 --batches 1
    python bench/decode_roofline.py --device cuda --ab TIERLM_NO_PDL  # with and without PDL, row by row
    python bench/decode_roofline.py --device cpu --small          # a shrunk config, to check the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from device_timing import copy_bandwidth, device_label

from tierlm.config import ModelConfig
from tierlm.model.layers.gated_deltanet import GatedDeltaNet
from tierlm.model.layers.hyper_connection import HyperConnection
from tierlm.model.layers.moe import Experts, SparseMoeBlock, SwiGLU
from tierlm.model.layers.ple import PLELayer
from tierlm.model.layers.qsa_attention import QSAAttention
from tierlm.model.model_cache import ModelCache
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM
from tierlm.model.static_decode import StaticDecodeRunner

BLOCK_SIZE = 16


def real_width_config(layers: int, small: bool) -> dict:
    if small:  # the same shape of model, small enough for a CPU
        h, vocab, experts, inter, nv, nk, heads, lowrank, budget = 256, 4096, 32, 64, 8, 4, 4, 32, 64
    else:
        h, vocab, experts, inter, nv, nk, heads, lowrank, budget = 2560, 248320, 512, 640, 48, 16, 24, 320, 2048
    return {
        "vocab_size": vocab, "hidden_size": h, "num_hidden_layers": layers, "full_attention_interval": 4,
        "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": 256 if not small else 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128 if not small else 32,
        "linear_value_head_dim": 128 if not small else 32, "linear_num_key_heads": nk, "linear_num_value_heads": nv,
        "num_experts": experts, "num_experts_per_tok": 10 if not small else 4, "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": inter, "norm_topk_prob": True, "hc_count": 4, "hc_lowrank": lowrank,
        "ple_layer_ids": [2], "ple_embed_dim": h, "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
        "ngram_vocab_size_base": 100_000 if not small else 2_000, "split_ngram_parts": 4,
        "indexer_n_heads": 8, "indexer_kv_heads": 1, "indexer_head_dim": 128 if not small else 64,
        "indexer_budget": budget, "indexer_compress_ratio": 4, "eos_token_id": 1, "max_position_embeddings": 65536,
        "hidden_act": "silu", "rms_norm_eps": 1e-6,
    }


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Qwen4ExpForCausalLM:
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config).to(dtype)
    model = model.to_empty(device=device).requires_grad_(False).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    for param in model.parameters():
        param.normal_(0.0, 0.02, generator=gen)
    return model


def quantize_in_memory(model: Qwen4ExpForCausalLM, scheme: str, group_size: int) -> dict[str, int]:
    """Re-hold every weight the scheme quantizes in its packed format, in place, from the model's own
    weights (round-to-nearest, symmetric, per the scheme's groups); returns {format label: modules}."""
    from tierlm.kernels.quant_linear.packing import quantize
    from tierlm.model.quantization.base import DENSE
    from tierlm.model.quantization.config import QuantizationConfig, module_format
    from tierlm.tools.quantize import scheme_config

    rules = QuantizationConfig.from_config_json({"quantization_config": scheme_config(scheme, group_size, [])})
    counts: dict[str, int] = defaultdict(int)
    for path, module in list(model.named_modules()):
        if not hasattr(module, "checkpoint_modules"):
            continue
        kind = "embedding" if module.kind == "embedding" else "linear"
        fmt = module_format(rules, [part.name for part in module.checkpoint_modules(path)], kind, path)
        if fmt == DENSE:
            continue
        dense = {name: param for name, param in module.named_parameters(recurse=False)
                 if name in ("weight", "gate_up_proj", "down_proj")}
        dtype, device = next(iter(dense.values())).dtype, next(iter(dense.values())).device
        with torch.device(device):
            module.set_format(fmt)
        module.to(dtype)  # the new scales (packed words stay int32)
        for name, weight in dense.items():
            prefix = "" if name == "weight" else name.removesuffix("_proj") + "_"  # experts: gate_up_, down_
            packed_param, scale_param = (getattr(module, prefix + t) for t in ("weight_packed", "weight_scale"))
            step = 16 if weight.dim() == 3 else 16384  # experts, or rows, per chunk: bounded temporaries
            for start in range(0, weight.shape[0], step):
                packed, scales = quantize(weight[start:start + step], fmt.bits, fmt.group_size or weight.shape[-1])
                packed_param[start:start + step] = packed
                scale_param[start:start + step] = scales
        counts[fmt.label] += 1
    return dict(counts)




def gpu_time(fn, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000


def step_bytes(model: Qwen4ExpForCausalLM, config: ModelConfig, batch: int, context: int) -> int:
    """Bytes a decode step of `batch` requests at `context` must read (and the states it writes)."""
    c, total = config, 0
    experts_total, tables = 0, 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            experts_total += size
        elif "embed_tokens" in name:  # one row per token (of each of its tensors: packed words, scales)
            total += batch * (param.numel() // param.shape[0]) * param.element_size()
        elif ".ple." in name and param.dim() == 2 and param.shape[1] * c.num_ngram_heads == c.ple_embed_dim:
            tables += batch * c.num_ngram_heads * param.shape[1] * param.element_size()
        else:
            total += size
    hit = min(c.num_experts, batch * c.num_experts_per_tok)  # distinct experts touched, at most
    total += experts_total * hit // c.num_experts + tables
    gdn_layers = sum(t == "linear_attention" for t in c.layer_types)
    qsa_layers = c.num_hidden_layers - gdn_layers
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    total += 2 * batch * gdn_layers * state
    rows = min(context, c.indexer_budget + c.indexer_compress_ratio - 1)
    row_bytes = 2 * c.num_key_value_heads * c.head_dim * param.element_size()
    index_bytes = (context // c.indexer_compress_ratio) * c.indexer_head_dim * param.element_size()
    total += batch * qsa_layers * (rows * row_bytes + index_bytes)
    return total


PARTS = {  # (class, method) -> part name in the kernel-time table
    (HyperConnection, "mix"): "hyper-connections", (HyperConnection, "combine"): "hyper-connections",
    (HyperConnection, "combine_and_mix"): "hyper-connections",
    (GatedDeltaNet, "forward"): "GDN", (QSAAttention, "forward"): "QSA + indexer", (PLELayer, "forward"): "PLE",
    (Experts, "forward"): "MoE experts", (SwiGLU, "forward"): "shared expert", (SparseMoeBlock, "forward"): "router",
    (Experts, "with_shared"): "MoE experts",  # (with the shared expert fused in: TIERLM_NO_FUSED_SHARED_EXPERT)
}


@contextmanager
def labelled_parts():
    """Wrap each part's method in a profiler range named after the part (undone on exit)."""
    saved = []
    for (cls, method), part in PARTS.items():
        raw = cls.__dict__[method]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        def wrapped(*args, _fn=fn, _part=part, **kwargs):
            with torch.profiler.record_function(f"part:{_part}"):
                return _fn(*args, **kwargs)

        setattr(cls, method, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        saved.append((cls, method, raw))
    try:
        yield
    finally:
        for cls, method, raw in saved:
            setattr(cls, method, raw)


def kernel_table(fn, device: torch.device, listing: list | None = None) -> tuple[int, dict[str, tuple[int, float]]]:
    """Kernels launched by one call of fn, and {part: (kernels, seconds)} by innermost part range.

    With `listing`, every GPU kernel is also appended to it as (part, kernel name, seconds) in launch order."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with labelled_parts(), torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    parts: dict[str, list] = defaultdict(lambda: [0, 0.0])
    seen = set()

    def walk(event, part: str) -> None:
        if event.name.startswith("part:"):
            part = event.name[5:]
        for kernel in getattr(event, "kernels", []):
            parts[part][0] += 1
            parts[part][1] += kernel.duration / 1e6
            seen.add(kernel.name)
        for child in event.cpu_children:
            walk(child, part)

    for event in prof.events():
        if event.cpu_parent is None and event.device_type == torch.autograd.DeviceType.CPU:
            walk(event, "other (embedding, lm_head, norms, copies)")
    # kernels no torch op launched (Triton's) are attached to no op: each goes to the innermost part whose
    # GPU-side range (the profiler's annotation of a record_function, named like it) contains its start
    cuda = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ranges = [(e.time_range.start, e.time_range.end, e.name[5:]) for e in cuda if e.name.startswith("part:")]
    for event in sorted(cuda, key=lambda e: e.time_range.start):
        if event.name.startswith("part:"):
            continue
        start = event.time_range.start
        inside = [(end - begin, part) for begin, end, part in ranges if begin <= start < end]
        part = min(inside)[1] if inside else "other (embedding, lm_head, norms, copies)"
        if listing is not None:
            listing.append((part, event.name, event.device_time / 1e6))
        if event.name in seen:
            continue
        parts[part][0] += 1
        parts[part][1] += event.device_time / 1e6
    return sum(n for n, _ in parts.values()), {k: (n, t) for k, (n, t) in parts.items()}


def measure(model, config, dtype, device, batch: int, context: int, steps: int, listing: list | None = None) -> dict:
    blocks_each = (context + steps + BLOCK_SIZE) // BLOCK_SIZE + 1
    cache = ModelCache(config, batch, batch * blocks_each, BLOCK_SIZE, dtype, device)
    for state in cache.layers:  # the context's K/V, indexer keys and states: random contents
        for tensor in vars(state).values():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                tensor.normal_(0.0, 0.02)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    mode = "cuda_graph" if device.type == "cuda" else "eager"
    runner = StaticDecodeRunner(model, cache, batch, blocks_each, mode, sizes=[batch])
    gen = torch.Generator().manual_seed(batch)
    rows = list(range(batch))

    def inputs_at(step: int) -> tuple:
        """A decode step's `run_decode` arguments as the engine stages them under overlap scheduling: host
        lists, every row's input id the previous step's sampled id (on the device: `previous`)."""
        previous = torch.randint(2, config.vocab_size, (batch,), generator=gen).to(device)
        return [0] * batch, [context + step] * batch, rows, tables, rows, previous

    for step in range(3):
        runner.run_decode(*inputs_at(step))
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, gpu = 0.0, 0.0
    for step in range(steps):
        inputs = inputs_at(3 + step)
        start = time.perf_counter()
        gpu += gpu_time(lambda inputs=inputs: runner.run_decode(*inputs), device)
        wall += time.perf_counter() - start
    eager = StaticDecodeRunner(model, cache, batch, blocks_each, "eager", sizes=[batch])
    eager.run_decode(*inputs_at(steps + 3))  # its block tables sent: the profiled step is a steady one
    inputs = inputs_at(steps + 4)
    kernels, parts = kernel_table(lambda: eager.run_decode(*inputs), device, listing)
    nbytes = step_bytes(model, config, batch, context)
    return {
        "batch": batch, "context": context, "tok_s": batch * steps / wall, "step_ms": 1000 * wall / steps,
        "gpu_step_ms": 1000 * gpu / steps, "host_ms": 1000 * max(0.0, wall - gpu) / steps, "bytes_per_step": nbytes,
        "kernels_per_step": kernels, "parts": parts,
    }


@contextmanager
def environment(name: str, value: str | None):
    """The environment variable `name` set to value (None: unset) inside the block, restored after."""
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def run_all(model, config, dtype, device, args, bandwidth: float) -> list[dict]:
    """Every (context, batch) of args, printed as one table (with --ab: with the switch unset, and after
    it their A/B table)."""
    results = []
    print(f"{'ctx':>6} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'GB/step':>8} {'roofline':>9} {'kernels':>8} "
          f"{'host ms':>8}")
    for context in args.contexts:
        for batch in args.batches:
            listing = [] if args.kernels and not results else None
            with environment(args.ab, None) if args.ab else nullcontext():
                r = measure(model, config, dtype, device, batch, context, args.steps, listing)
            if listing:
                r["kernels"] = listing
            r["roofline_fraction"] = r["bytes_per_step"] / bandwidth / (r["step_ms"] / 1000)
            if args.ab:
                with environment(args.ab, "1"):
                    switched = measure(model, config, dtype, device, batch, context, args.steps)
                switched["roofline_fraction"] = switched["bytes_per_step"] / bandwidth / (switched["step_ms"] / 1000)
                r["ab"] = {"switch": args.ab, "set": switched, "tok_s_ratio": r["tok_s"] / switched["tok_s"]}
            results.append(r)
            print(f"{context:>6} {batch:>5} {r['tok_s']:>9.1f} {r['step_ms']:>8.3f} {r['bytes_per_step'] / 1e9:>8.3f} "
                  f"{100 * r['roofline_fraction']:>8.1f}% {r['kernels_per_step']:>8} {r['host_ms']:>8.3f}")
    if args.ab:
        print(f"\n{'ctx':>6} {'batch':>5} {'tok/s':>9} {'tok/s ' + args.ab + '=1':>{len(args.ab) + 8}} "
              f"{'unset/set':>9} {'GPU ms':>7} {'GPU ms set':>10}")
        for r in results:
            switched = r["ab"]["set"]
            print(f"{r['context']:>6} {r['batch']:>5} {r['tok_s']:>9.1f} {switched['tok_s']:>{len(args.ab) + 8}.1f} "
                  f"{r['ab']['tok_s_ratio']:>8.3f}x {r['gpu_step_ms']:>7.3f} {switched['gpu_step_ms']:>10.3f}")
    first = results[0]
    print(f"\nwhere a step's kernel time goes (ctx {first['context']}, batch {first['batch']}, eager fixed-shape step):")
    total = sum(t for _, t in first["parts"].values()) or 1.0
    for part, (n, t) in sorted(first["parts"].items(), key=lambda kv: -kv[1][1]):
        print(f"  {part:<44} {n:>5} kernels {1e3 * t:>8.3f} ms {100 * t / total:>5.1f}%")
    if "kernels" in first:
        print("\nevery kernel of that step in launch order (part, us, name):")
        for part, name, seconds in first["kernels"]:
            print(f"  {part[:16]:<16} {1e6 * seconds:>7.1f}  {name[:110]}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--small", action="store_true", help="a shrunk config (CPU check)")
    parser.add_argument("--kernels", action="store_true",
                        help="also list every kernel of the first profiled step (part, time, name) in launch order")
    parser.add_argument("--quantize", default=None, metavar="SCHEME",
                        help="also run the same model quantized in memory with this `tierlm quantize` scheme "
                             "(int4-mixed, int8, int4) and print the two side by side")
    parser.add_argument("--group-size", type=int, default=32, help="--quantize's group size (INT4/INT6)")
    parser.add_argument("--ab", default=None, metavar="SWITCH",
                        help="measure each row with the environment variable SWITCH unset and set to 1 (e.g. "
                             "TIERLM_NO_PDL), in this process, and print both tok/s and their ratio")
    parser.add_argument("--tag", default="", help="appended to the results file's name (e.g. an A/B's side: "
                        "run once as is and once with TIERLM_NO_FUSED_* set)")
    args = parser.parse_args()
    if args.quantize is not None:
        from tierlm.tools.quantize import SCHEMES

        if args.quantize not in SCHEMES:
            parser.error(f"--quantize: unknown scheme {args.quantize!r}; choose one of {', '.join(SCHEMES)}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = ModelConfig.from_dict(real_width_config(args.layers, args.small))
    model = build_model(config, dtype, device)
    name = device_label(device)
    bandwidth = copy_bandwidth(device, 2 << 30 if device.type == "cuda" else 64 << 20)
    params = sum(p.numel() for p in model.parameters())
    switches = {k: v for k, v in os.environ.items() if k.startswith("TIERLM_")}  # kill switches set
    print(f"{name}: {args.layers} layers {config.layer_types}, {params / 1e9:.2f}B params, {args.dtype}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); switches set: {' '.join(switches) or 'none'}")
    results = run_all(model, config, dtype, device, args, bandwidth)
    if len(results) > 1:
        one = next((r for r in results if r["batch"] == 1), None)
        four = next((r for r in results if r["batch"] == 4 and one and r["context"] == one["context"]), None)
        if one and four:
            print(f"batch 4 / batch 1 total tok/s at ctx {one['context']}: {four['tok_s'] / one['tok_s']:.2f}x")
    report = {"device": name, "dtype": args.dtype, "layers": args.layers, "switches": switches, "ab": args.ab,
              "copy_bandwidth": bandwidth, "results": results}
    tag = f"_{args.tag}" if args.tag else ""
    out = Path(__file__).parent / "results" / f"decode_roofline_{name}{tag}.json"
    if args.quantize is not None:
        formats = quantize_in_memory(model, args.quantize, args.group_size)
        print(f"\n{args.quantize} (group {args.group_size}, in memory, round-to-nearest): modules per format {formats}")
        quantized = run_all(model, config, dtype, device, args, bandwidth)
        print(f"\n{'ctx':>6} {'batch':>5} {args.dtype + ' tok/s':>16} {args.quantize + ' tok/s':>18} {'ratio':>7} "
              f"{'GB/step':>8} {'->':>3} {'GB/step':>8}")
        for base, quant in zip(results, quantized, strict=True):
            quant["tok_s_ratio"] = quant["tok_s"] / base["tok_s"]
            print(f"{base['context']:>6} {base['batch']:>5} {base['tok_s']:>16.1f} {quant['tok_s']:>18.1f} "
                  f"{quant['tok_s_ratio']:>6.2f}x {base['bytes_per_step'] / 1e9:>8.3f} {'':>3} "
                  f"{quant['bytes_per_step'] / 1e9:>8.3f}")
        report.update(quantize=args.quantize, group_size=args.group_size, formats=formats, quantized=quantized)
        out = out.with_name(f"decode_roofline_{name}_{args.quantize}{tag}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
