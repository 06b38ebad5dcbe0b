"""Decode against the memory roofline at the target model's real layer widths (issue 12's measuring stick).

Builds the real-width Qwen4-Exp stack with random weights (hidden 2560, vocab 248,320, 512 experts top-10 of
width 640 and a shared expert of 640, GDN 16 key / 48 value heads of 128, QSA 24 heads over 2 KV heads of
256, indexer 8 heads x 128 with budget 2048 and ratio 4, 4 hyper-connection streams of low rank 320, PLE on
the second layer; N layers at 3 GDN : 1 QSA, default 4), measures the device's copy bandwidth in the same
run, then for each context and batch size decodes through `StaticDecodeRunner` (CUDA graphs on a GPU) and
prints: tok/s, bytes read per step (the weights a step touches: every dense weight, the routed experts'
rows, one embedding row per token, the PLE rows; plus the GDN state read and written and the QSA rows the
attention and indexer read), % of the roofline (those bytes at the copy bandwidth), kernels per step,
and a per-part table of kernel time from one profiled step of the same fixed-shape batch run eagerly. A
step is staged as the engine stages a decode step under overlap scheduling (`StaticDecodeRunner.run_decode`:
host lists in one copy, each row's input id the previous step's sampled id, taken on the device), and
queued while the step before it runs, as the engine's overlap scheduling queues decode steps: tok/s and
"step ms" are that loop's wall time. The same steps again, one at a time, each waited for before the next
is staged, give "replay", the device time of a step's graph replay alone, and "host ms", the host's time
to stage and launch a step (hidden while below the step's); "gap ms" is the queued step's wall time beyond
its replay: device time between replays (the issue's host time between steps). (Timing each step waited
for, staging included, moved the figures 10-20% from one process to the next with the host's share:
bench/results/decode_roofline_nvidia-h200_bisect_s10.txt.)

The PLE table is shrunk (n-gram vocab 100,000 rows per head instead of 20,000,000): a step reads 16 rows
of it per token either way. Results go to bench/results/decode_roofline_<device>.json.

`--quantize int4-mixed` (or another `tierlm quantize` scheme) also quantizes the same random model in
memory after the bf16 run, each module in the format the scheme's quantization_config gives it (INT4
routed experts, INT6 shared expert, INT8 per-channel embedding, lm_head and hyper-connection
projections), round-to-nearest (`kernels/quant_linear/packing.quantize`; `tierlm quantize` adds a clip
search, which changes values, not bytes or speed), runs the same measurements and prints both side by
side with their tok/s ratio (results: decode_roofline_<device>_<scheme>.json).

Every (context, batch) is timed in --rounds rounds of --steps steps (default 5 x 50); the tables print
the median tok/s and its range over the rounds. The same build reads up to 10-15% apart from one process
to the next, so switches are compared within one process, interleaved: `--variants SPEC [SPEC ...]`
measures every (context, batch) under each variant of the environment, a SPEC being `base` (none of the
variables the variants name set) or NAME=VALUE[,NAME=VALUE...] (the other variables the variants name
unset). Each variant's graphs are captured once, under its environment (`DecodeSetup`: one cache, the
runners captured apart from their timing); then each round times every variant on that cache, in an
order rotated by one each round, so none always goes first. Per variant it prints the median tok/s, the
min-max over the rounds, the ratio of its median to the first variant's, and the range of the same
round's ratios (a drift over the rounds moves both sides of a round alike), replay, gap and host ms and kernels
per step; the results JSON holds every round (each row's "variants"; the row's own figures are the first
variant's). `--ab SWITCH` is `--variants base SWITCH=1` (its ratio is set / unset: what turning the
feature off costs is 1 / it).

    python bench/decode_roofline.py --device cuda                 # 4 layers, contexts 512 and 8192, batches 1/4/16
    python bench/decode_roofline.py --device cuda --quantize int4-mixed --contexts 512 --batches 1
    python bench/decode_roofline.py --device cuda --ab TIERLM_NO_PDL  # with and without PDL, interleaved
    python bench/decode_roofline.py --device cuda --contexts 512 --batches 1 4 \
        --variants base TIERLM_NO_PDL=1 TIERLM_PDL_TRIGGER=wait TIERLM_PDL_TRIGGER=exit  # PDL triggers
    python bench/decode_roofline.py --device cpu --small          # a shrunk config, to check the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
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




def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def replay_timer(device: torch.device):
    """Start timing what is launched on `device` from now; the returned function waits for it and gives its
    seconds (CUDA: events around it on the stream; CPU: the wall time until called)."""
    if device.type != "cuda":
        start = time.perf_counter()
        return lambda: time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()

    def seconds() -> float:
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000

    return seconds


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


def randomize_caches(cache: ModelCache) -> None:
    """The context's K/V, indexer keys and states (every floating pool of every layer's typed caches):
    random contents, so the indexer's block scores differ as a trained model's do (zeros tie every score:
    the selection's slowest case). Raises where a layer has no floating pool to fill."""
    for index, caches in enumerate(cache.layers):
        filled = 0
        for typed in vars(caches).values():  # GDN, PLE, QSA K/V, indexer (None where the kind has none)
            for tensor in vars(typed).values() if typed is not None else ():
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
                    filled += 1
        if not filled:
            raise RuntimeError(f"layer {index}: no cache pool to fill with random contents")


class DecodeSetup:
    """One (context, batch) of the benchmark: a cache holding `context` tokens of random K/V, indexer keys and
    states for each of `batch` requests, and the decode steps' inputs as the engine stages them. Runners are
    captured on it (`capture`, under the environment as it is then) apart from their timing (`time`), so
    several variants' graphs, each captured once, take turns on the same cache: every timing decodes the same
    positions (context + 3 ...), rewriting the same K/V rows, so each does the same work."""

    WARMUP_STEPS = 3  # untimed steps before each timing: the first replays after another graph ran

    def __init__(self, model, config, dtype, device, batch: int, context: int, steps: int) -> None:
        self.model, self.config, self.device = model, config, device
        self.batch, self.context, self.steps = batch, context, steps
        self.blocks_each = (context + steps + BLOCK_SIZE) // BLOCK_SIZE + 1  # warm-up, timed and profiled steps
        self.cache = ModelCache(config, batch, batch * self.blocks_each, BLOCK_SIZE, dtype, device)
        randomize_caches(self.cache)
        self.tables = [list(range(i * self.blocks_each, (i + 1) * self.blocks_each)) for i in range(batch)]
        self.rows = list(range(batch))
        # the "sampled" ids steps take as input, made once on the device (a copy from the host inside the
        # timing would wait for the step before it, which the engine's device-sampled ids never do)
        gen = torch.Generator().manual_seed(batch)
        self.sampled = torch.randint(2, config.vocab_size, (self.SAMPLED_STEPS, batch), generator=gen).to(device)

    SAMPLED_STEPS = 64  # distinct input-id rows the steps cycle through

    def inputs_at(self, step: int) -> tuple:
        """A decode step's `run_decode` arguments as the engine stages them under overlap scheduling: host
        lists, every row's input id the previous step's sampled id (on the device: `previous`)."""
        previous = self.sampled[step % self.SAMPLED_STEPS]
        return [0] * self.batch, [self.context + step] * self.batch, self.rows, self.tables, self.rows, previous

    def capture(self, mode: str | None = None) -> StaticDecodeRunner:
        """A static decode runner of this batch size (CUDA graphs on a GPU, unless `mode`), built now."""
        mode = mode or ("cuda_graph" if self.device.type == "cuda" else "eager")
        return StaticDecodeRunner(self.model, self.cache, self.batch, self.blocks_each, mode, sizes=[self.batch])

    def time(self, runner: StaticDecodeRunner) -> dict:
        """`steps` decode steps through `runner` after WARMUP_STEPS, each queued while the one before it runs
        (as the engine's overlap scheduling runs decode: nothing waits for a step's result before the next
        is staged): tok/s and wall ms a step. Then the same steps one at a time, each waited for before the
        next is staged: the device ms of its graph replay alone and the host ms to stage and launch it
        (nothing to wait for then; in the queued loop the host also waits for a staging buffer's copy two
        steps back)."""
        for step in range(self.WARMUP_STEPS):
            logits = runner.run_decode(*self.inputs_at(step))
        # the cache has run many steps by now (every round of every variant): a state that overflowed
        # would route every row to the same experts, and time another step (reading it waits for the device)
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"ctx {self.context} batch {self.batch}: the decode step's logits are not finite")
        start = time.perf_counter()
        for step in range(self.steps):
            runner.run_decode(*self.inputs_at(self.WARMUP_STEPS + step))
        synchronize(self.device)
        wall = time.perf_counter() - start
        host = replay = 0.0
        for step in range(self.steps):
            token_ids, positions, slots, tables, sources, previous = self.inputs_at(self.WARMUP_STEPS + step)
            synchronize(self.device)
            staging = time.perf_counter()
            staged = runner.stage_decode(token_ids, positions, slots, tables, sources)
            runner.previous_tokens[: previous.shape[0]].copy_(previous)
            seconds = replay_timer(self.device)
            runner.replay(*staged)
            host += time.perf_counter() - staging
            replay += seconds()
        return {"tok_s": self.batch * self.steps / wall, "step_ms": 1000 * wall / self.steps,
                "replay_ms": 1000 * replay / self.steps, "host_ms": 1000 * host / self.steps}

    def profile(self, listing: list | None = None) -> tuple[int, dict[str, tuple[int, float]]]:
        """`kernel_table` of one step of the same fixed shape run eagerly (after one step that sends its block
        tables: the profiled step is a steady one)."""
        eager = self.capture("eager")
        after = self.WARMUP_STEPS + self.steps
        eager.run_decode(*self.inputs_at(after))
        inputs = self.inputs_at(after + 1)
        return kernel_table(lambda: eager.run_decode(*inputs), self.device, listing)


def measure(model, config, dtype, device, batch: int, context: int, steps: int, listing: list | None = None) -> dict:
    """One (context, batch) timed once under the environment as it is (sampler_cost.py's step)."""
    setup = DecodeSetup(model, config, dtype, device, batch, context, steps)
    timing = setup.time(setup.capture())
    kernels, parts = setup.profile(listing)
    return {"batch": batch, "context": context, **timing, "bytes_per_step": step_bytes(model, config, batch, context),
            "kernels_per_step": kernels, "parts": parts}


class Variant:
    """One side of a comparison: environment assignments, from a SPEC `base` (none) or
    NAME=VALUE[,NAME=VALUE...]. A variant runs with its own assignments set and every other variable that
    some variant of the comparison names unset (so `base` is none of them set)."""

    def __init__(self, spec: str) -> None:
        self.spec, self.assignments = spec, {}
        if spec == "base":
            return
        for assignment in spec.split(","):
            name, equals, value = assignment.partition("=")
            if not equals or not name or name in self.assignments:
                raise ValueError(f"variant {spec!r}: `base`, or NAME=VALUE assignments joined by commas, each "
                                 "name once")
            self.assignments[name] = value

    def environment(self, names: set[str]) -> dict[str, str | None]:
        """{name: value, None for unset} for every one of `names` (the variables the comparison names)."""
        return {name: self.assignments.get(name) for name in sorted(names)}


def parse_variants(specs: list[str]) -> list[Variant]:
    variants = [Variant(spec) for spec in specs]
    if len({v.spec for v in variants}) < len(variants):
        raise ValueError(f"variants {specs}: each one once")
    return variants


@contextmanager
def environment(values: dict[str, str | None]):
    """Each environment variable of `values` set to its value (None: unset) inside the block, restored after."""
    saved = {name: os.environ.get(name) for name in values}

    def assign(pairs: dict[str, str | None]) -> None:
        for name, value in pairs.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    assign(values)
    try:
        yield
    finally:
        assign(saved)


def measure_variants(model, config, dtype, device, batch: int, context: int, variants: list[Variant], steps: int,
                     rounds: int, listing: list | None = None) -> list[dict]:
    """One (context, batch) under every variant: each variant's graphs captured once (under its environment),
    then `rounds` rounds, each timing every variant for `steps` steps, the order rotated by one each round
    (so no variant always runs first after another (context, batch)'s captures). Per variant: every round's timing, the
    medians over the rounds, the tok/s range, its eager step's kernel table (the first variant's with
    `listing`)."""
    setup = DecodeSetup(model, config, dtype, device, batch, context, steps)
    names = {name for variant in variants for name in variant.assignments}
    sides = []
    for variant in variants:
        with environment(variant.environment(names)):
            runner = setup.capture()
            kernels, parts = setup.profile(listing if not sides else None)
        sides.append({"variant": variant.spec, "env": variant.assignments, "runner": runner,
                      "kernels_per_step": kernels, "parts": parts, "rounds": []})
    order = list(zip(sides, variants))
    for round_index in range(rounds):
        shift = round_index % len(order)
        for side, variant in order[shift:] + order[:shift]:
            with environment(variant.environment(names)):
                side["rounds"].append(setup.time(side["runner"]))
    for side in sides:
        del side["runner"]  # its graphs freed before the next (context, batch) captures its own
        for key in ("tok_s", "step_ms", "replay_ms", "host_ms"):
            side[key] = statistics.median(r[key] for r in side["rounds"])
        side["gap_ms"] = max(0.0, side["step_ms"] - side["replay_ms"])  # device time between replays
        side["tok_s_min"], side["tok_s_max"] = (f(r["tok_s"] for r in side["rounds"]) for f in (min, max))
        # against the first variant: of the medians, and the range of the same round's ratios (drift across
        # rounds hits both sides of a round alike)
        pairs = [mine["tok_s"] / first["tok_s"] for mine, first in zip(side["rounds"], sides[0]["rounds"])]
        side["tok_s_ratio"] = side["tok_s"] / sides[0]["tok_s"]
        side["round_ratio_min"], side["round_ratio_max"] = min(pairs), max(pairs)
    return sides


def run_all(model, config, dtype, device, args, bandwidth: float) -> list[dict]:
    """Every (context, batch) of args under every variant, printed as one table of the first variant's medians
    (with several variants, then their comparison)."""
    results = []
    first = args.variants[0].spec
    print(f"{'ctx':>6} {'batch':>5} {'tok/s':>9} {'min-max':>17} {'step ms':>8} {'replay':>7} {'gap ms':>7} "
          f"{'GB/step':>8} {'roofline':>9} {'kernels':>8} {'host ms':>8}   (variant {first}: medians of {args.rounds} "
          f"rounds of {args.steps} steps)")
    for context in args.contexts:
        for batch in args.batches:
            listing = [] if args.kernels and not results else None
            sides = measure_variants(model, config, dtype, device, batch, context, args.variants, args.steps,
                                     args.rounds, listing)
            nbytes = step_bytes(model, config, batch, context)
            for side in sides:
                side["roofline_fraction"] = nbytes / bandwidth / (side["step_ms"] / 1000)
            r = {"batch": batch, "context": context, "bytes_per_step": nbytes,  # the first variant's figures
                 **{k: sides[0][k] for k in ("tok_s", "tok_s_min", "tok_s_max", "step_ms", "replay_ms", "gap_ms", "host_ms",
                                             "roofline_fraction", "kernels_per_step", "parts")}, "variants": sides}
            if listing:
                r["kernels"] = listing
            results.append(r)
            spread = f"{r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}"
            print(f"{context:>6} {batch:>5} {r['tok_s']:>9.1f} {spread:>17} {r['step_ms']:>8.3f} {r['replay_ms']:>7.3f} "
                  f"{r['gap_ms']:>7.3f} {nbytes / 1e9:>8.3f} "
                  f"{100 * r['roofline_fraction']:>8.1f}% {r['kernels_per_step']:>8} {r['host_ms']:>8.3f}")
    if len(args.variants) > 1:
        width = max(len(v.spec) for v in args.variants)
        print(f"\n{'ctx':>6} {'batch':>5} {'variant':<{width}} {'tok/s':>9} {'min-max':>17} {'/ ' + first:>{len(first) + 3}} "
              f"{'round ratios':>15} {'replay':>7} {'gap ms':>7} {'host ms':>7} {'kernels':>7}")
        for r in results:
            for side in r["variants"]:
                spread = f"{side['tok_s_min']:.1f}-{side['tok_s_max']:.1f}"
                ratios = f"{side['round_ratio_min']:.3f}-{side['round_ratio_max']:.3f}"
                print(f"{r['context']:>6} {r['batch']:>5} {side['variant']:<{width}} {side['tok_s']:>9.1f} "
                      f"{spread:>17} {side['tok_s_ratio']:>{len(first) + 2}.3f}x {ratios:>15} "
                      f"{side['replay_ms']:>7.3f} {side['gap_ms']:>7.3f} {side['host_ms']:>7.3f} {side['kernels_per_step']:>7}")
    first_row = results[0]
    print(f"\nwhere a step's kernel time goes (ctx {first_row['context']}, batch {first_row['batch']}, eager "
          f"fixed-shape step, variant {first}):")
    total = sum(t for _, t in first_row["parts"].values()) or 1.0
    for part, (n, t) in sorted(first_row["parts"].items(), key=lambda kv: -kv[1][1]):
        print(f"  {part:<44} {n:>5} kernels {1e3 * t:>8.3f} ms {100 * t / total:>5.1f}%")
    if "kernels" in first_row:
        print("\nevery kernel of that step in launch order (part, us, name):")
        for part, name, seconds in first_row["kernels"]:
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
    parser.add_argument("--variants", nargs="+", default=None, metavar="SPEC",
                        help="measure each row under each environment variant, interleaved: `base` (none of "
                             "the variables the variants name set) or NAME=VALUE[,NAME=VALUE...]; ratios are "
                             "to the first (default: base alone)")
    parser.add_argument("--ab", default=None, metavar="SWITCH",
                        help="the same as --variants base SWITCH=1 (e.g. TIERLM_NO_PDL)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timings of each variant per row, --steps steps each, in rotating order")
    parser.add_argument("--tag", default="", help="appended to the results file's name (e.g. an A/B's side: "
                        "run once as is and once with TIERLM_NO_FUSED_* set)")
    args = parser.parse_args()
    if args.ab is not None and args.variants is not None:
        parser.error("--ab SWITCH is --variants base SWITCH=1: give one of them")
    try:
        args.variants = parse_variants(args.variants or (["base", f"{args.ab}=1"] if args.ab else ["base"]))
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps: at least 1")
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
    report = {"device": name, "dtype": args.dtype, "layers": args.layers, "switches": switches,
              "variants": [{"spec": v.spec, "env": v.assignments} for v in args.variants], "rounds": args.rounds,
              "steps": args.steps, "copy_bandwidth": bandwidth, "results": results}
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
