"""The decode fusions of issue 12 items 2, 3 and 6 at the real widths, torch vs fused kernels, side by side.

Times the MoE router (`SparseMoeBlock.route`: 512 experts top-10 + the shared gate over hidden 2560), the
hyper-connections (`HyperConnection.mix` with and without injection gates, and with its mixer weights
INT8 per channel as int4-mixed checkpoints hold them, `HyperConnection.combine`: 4 streams of 2560, low
rank 320) and the PLE layer's decode step (`PLELayer.forward`: n-gram hash and
gather of 16 rows of 160, the key/value projection 2560 -> 12800, gate, norms, dilated conv, history,
residual add; the projection is the same GEMV in both forms) per call at batch 1, 4 and 16, in bf16, each
call replayed from a CUDA graph (as a decode step runs them), with TIERLM_NO_FUSED_ROUTER /
TIERLM_NO_FUSED_HC / TIERLM_NO_FUSED_PLE set (torch) and unset (fused); prints microseconds per call, the
ratio, kernels per call, and the bandwidth the fused form reaches on its weights; then what a decode step
of the 4-layer benchmark model spends on them (4 routers, 8 mixes and 8 combines, 1 final mix, 1 PLE
layer; the INT8 mix is a row of its own, not in that sum). Results: bench/results/decode_fusions_<device>.json.

    python bench/decode_fusions.py
    python bench/decode_fusions.py --sweep-hc     # also: the hc mix kernels' tiles and warps, each checked
    python bench/decode_fusions.py --sweep-hc --int8  # the same sweep over INT8 per-channel mixer weights
    python bench/decode_fusions.py --sweep-router # the router kernels' K slice and warps, each checked

`--sweep-router` times `SparseMoeBlock.route` for each candidate (BLOCK_K, GEMV_WARPS, ROUTE_WARPS) of
`kernels/moe_router.triton`, checks the expert ids equal the torch form's and the weights' max |difference|,
and prints the fastest correct one per batch (results: decode_fusions_router_sweep_<device>.json).

`--sweep-hc` times `HyperConnection.mix` (with injection) for each candidate of the mix kernels' module
constants (launch 1: BLOCK_J rows x BLOCK_K columns, SPLIT slices per stream, warps; launch 2: BLOCK_H
columns x BLOCK_R low-rank columns, warps), checks each against the torch form (max |difference| of the
block input), and prints the fastest correct one per batch (results: decode_fusions_hc_sweep_<device>.json;
with --int8 the mix over INT8 mixer weights, decode_fusions_hc_int8_sweep_<device>.json).
"""

from __future__ import annotations

import argparse
import json
import os
from functools import lru_cache
from pathlib import Path

import torch
from decode_roofline import real_width_config

from tierlm.config import ModelConfig
from tierlm.model.cache import PLEState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.hyper_connection import HyperConnection
from tierlm.model.layers.moe import SparseMoeBlock
from tierlm.model.layers.ple import NgramIds, PLELayer
from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

HIDDEN, HC, LOWRANK, EXPERTS, TOP_K = 2560, 4, 320, 512, 10
SWITCHES = ("TIERLM_NO_FUSED_ROUTER", "TIERLM_NO_FUSED_HC", "TIERLM_NO_FUSED_PLE")
STEP_CALLS = {"router": 4, "hc mix": 8, "hc mix (final, no inject)": 1, "hc combine": 8, "ple": 1}  # 4 layers
HC_INT8 = "hc mix (int8)"


def random_module(module: torch.nn.Module, device, dtype) -> torch.nn.Module:
    module = module.to(dtype).to_empty(device=device).requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    for param in module.parameters():
        param.normal_(0.0, 0.02, generator=gen)
    return module


def router_block(device, dtype) -> SparseMoeBlock:
    """A MoE block whose router alone is materialised (the experts stay on meta: route never reads them)."""
    config = ModelConfig.from_dict({
        "hidden_size": HIDDEN, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
        "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640, "vocab_size": 1000,
        "num_hidden_layers": 1, "layer_types": ["linear_attention"], "hc_count": HC, "hc_lowrank": LOWRANK,
    })
    with torch.device("meta"):
        block = SparseMoeBlock(config)
    block.router = random_module(block.router, device, dtype)
    return block


def int8_mixer(hc: HyperConnection) -> HyperConnection:
    """hc with its mixer projections re-held as INT8 per channel (round to nearest, as int4-mixed stores them)."""
    from tierlm.kernels.quant_linear.packing import quantize

    for linear in (hc.down_and_inject, hc.input_mix_weight_up):
        words, scales = quantize(linear.weight.float(), 8, linear.in_features, scale_dtype=linear.weight.dtype)
        linear.set_format(PackQuantizedFormat(8, None))
        linear.weight_packed = torch.nn.Parameter(words, requires_grad=False)
        linear.weight_scale = torch.nn.Parameter(scales, requires_grad=False)
    return hc


@lru_cache(maxsize=1)
def ple_layer(device, dtype) -> tuple[ModelConfig, PLELayer]:
    """decode_roofline's PLE layer (its n-gram table shrunk to 100,000 rows per head), random weights."""
    config = ModelConfig.from_dict(real_width_config(4, small=False))
    with torch.device("meta"):
        layer = PLELayer(config, 0)
    return config, random_module(layer, device, dtype)


def ple_call(device, dtype, batch: int):
    """(one decode step of the PLE layer for `batch` requests, the bytes it reads: the projection and rows)."""
    config, layer = ple_layer(device, dtype)
    gen = torch.Generator(device=device).manual_seed(batch)
    tokens = torch.randint(2, config.vocab_size, (batch,), generator=gen, device=device).tolist()
    forward_batch = ForwardBatch.build([[t] for t in tokens], [0] * batch, list(range(batch)), [[0]] * batch, 16,
                                       device=device)
    context = torch.randint(2, config.vocab_size, (batch, config.ngram_size - 1), generator=gen, device=device)
    width = config.hc_count * config.hidden_size
    streams = torch.randn(batch, width, generator=gen, device=device).to(dtype)
    state = PLEState(torch.zeros(batch, width, layer.history, dtype=dtype, device=device))

    def call():
        ids = NgramIds(forward_batch, context, config.eos_token_id, config.ngram_size)
        return layer(streams, forward_batch, state, ids)

    rows = batch * config.num_ngram_heads * config.ngram_head_dim * dtype.itemsize
    return call, layer.key_value_proj.weight.numel() * dtype.itemsize + rows


def ops(device, dtype, batch: int) -> dict:
    """name -> (callable, weight bytes it reads)."""
    gen = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, HIDDEN, device=device, generator=gen).to(dtype)
    streams = torch.randn(batch, HC * HIDDEN, device=device, generator=gen).to(dtype)
    inject = torch.rand(batch, HC, device=device, generator=gen).to(dtype)
    block = router_block(device, dtype)
    with torch.device("meta"):
        hc, final = HyperConnection(HIDDEN, HC, LOWRANK, 1e-6, True), HyperConnection(HIDDEN, HC, LOWRANK, 1e-6, False)
    hc, final = random_module(hc, device, dtype), random_module(final, device, dtype)
    with torch.device("meta"):
        hc_int8 = HyperConnection(HIDDEN, HC, LOWRANK, 1e-6, True)
    hc_int8 = int8_mixer(random_module(hc_int8, device, dtype))

    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    return {
        "router": (lambda: block.route(x), nbytes(block.router)),
        "hc mix": (lambda: hc.mix(streams), nbytes(hc)),
        "hc mix (final, no inject)": (lambda: final.mix(streams), nbytes(final)),
        HC_INT8: (lambda: hc_int8.mix(streams), nbytes(hc_int8)),
        "hc combine": (lambda: HyperConnection.combine(streams, x, inject), 0),
        "ple": ple_call(device, dtype, batch),
    }


def per_call_seconds(fn, reps: int) -> float:
    for _ in range(2):  # lazily made tensors (arrival counters) and compiled kernels, outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1000 / reps)
    return best


def kernels_per_call(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# (BLOCK_J, BLOCK_K, SPLIT, DOWN_WARPS) x (BLOCK_H, BLOCK_R, UP_WARPS); the first of each is the default
DOWN_CANDIDATES = [(16, 128, 2, 4), (16, 128, 5, 4), (16, 256, 10, 4), (32, 256, 10, 4), (16, 128, 20, 4),
                   (32, 128, 10, 4), (16, 256, 5, 8), (64, 128, 10, 8)]
UP_CANDIDATES = [(16, 64, 4), (16, 128, 4), (16, 512, 4), (8, 512, 4), (32, 512, 8), (8, 128, 4)]


def sweep_hc(device, dtype, batches: list[int], reps: int, op: str = "hc mix") -> list[dict]:
    """Every launch-1 candidate with the default launch 2, then every launch-2 candidate with the best
    launch 1 (per batch): us per `op` call and max |difference| from the torch form."""
    import tierlm.kernels.hyper_connection.triton as kernels

    names_up = ("BLOCK_H", "BLOCK_R", "UP_WARPS")
    defaults = kernels.DOWN_TILES, [getattr(kernels, n) for n in names_up]
    rows = []
    print(f"\n{op} sweep (us per call; diff: max |fused - torch| of the block input)")
    for batch in batches:
        set_fused(False)
        fn, _ = ops(device, dtype, batch)[op]
        expected = fn()[0].float()
        set_fused(True)

        def trial(down, up, fn=fn, expected=expected, batch=batch) -> dict:
            kernels.DOWN_TILES = ((kernels.MAX_TOKENS, down),)
            for name, value in zip(names_up, up):
                setattr(kernels, name, value)
            try:
                diff = (fn()[0].float() - expected).abs().max().item()
                us = 1e6 * per_call_seconds(fn, reps)
            except Exception as exc:  # noqa: BLE001 (a candidate the compiler refuses: reported, skipped)
                return {"batch": batch, "down": down, "up": up, "error": f"{type(exc).__name__}: {exc}"[:200]}
            return {"batch": batch, "down": down, "up": up, "us": us, "diff": diff}

        results = [trial(down, UP_CANDIDATES[0]) for down in DOWN_CANDIDATES]
        tolerance = 4 * max(results[0].get("diff", 0.0), 1e-2)  # the default's own distance, with room
        good = [r for r in results if "us" in r and r["diff"] <= tolerance]
        best_down = min(good, key=lambda r: r["us"])["down"]
        results += [trial(best_down, up) for up in UP_CANDIDATES[1:]]
        for r in results:
            state = f"{r['us']:8.1f} us  diff {r['diff']:.3g}" if "us" in r else r["error"]
            print(f"  batch {batch:>2}  down {r['down']}  up {r['up']}  {state}")
        good = [r for r in results if "us" in r and r["diff"] <= tolerance]
        best = min(good, key=lambda r: r["us"])
        print(f"  batch {batch:>2} best: down {best['down']} up {best['up']} {best['us']:.1f} us "
              f"(default {results[0]['us']:.1f} us)")
        rows += results
    kernels.DOWN_TILES = defaults[0]
    for name, value in zip(names_up, defaults[1]):
        setattr(kernels, name, value)
    return rows


# (BLOCK_K, GEMV_WARPS, ROUTE_WARPS); the first is the default
ROUTER_CANDIDATES = [(512, 8, 1), (512, 4, 1), (256, 4, 1), (256, 8, 1), (1024, 8, 1), (512, 8, 2), (512, 8, 4),
                     (256, 4, 2), (128, 4, 1)]


def sweep_router(device, dtype, batches: list[int], reps: int) -> list[dict]:
    """Every router candidate per batch: us per route call, whether the ids equal the torch form's, and the
    weights' max |difference|."""
    import tierlm.kernels.moe_router.triton as kernels

    names = ("BLOCK_K", "GEMV_WARPS", "ROUTE_WARPS")
    defaults = [getattr(kernels, n) for n in names]
    rows = []
    print("\nrouter sweep (us per call; ids: equal to torch's; diff: max |fused - torch| of the weights)")
    for batch in batches:
        set_fused(False)
        fn, _ = ops(device, dtype, batch)["router"]
        expected = fn()
        set_fused(True)
        results = []
        for candidate in ROUTER_CANDIDATES:
            for name, value in zip(names, candidate):
                setattr(kernels, name, value)
            try:
                got = fn()
                row = {"batch": batch, "candidate": candidate, "ids_equal": bool(torch.equal(got[1], expected[1])),
                       "diff": (got[0].float() - expected[0].float()).abs().max().item(),
                       "us": 1e6 * per_call_seconds(fn, reps)}
            except Exception as exc:  # noqa: BLE001 (a candidate the compiler refuses: reported, skipped)
                row = {"batch": batch, "candidate": candidate, "error": f"{type(exc).__name__}: {exc}"[:200]}
            results.append(row)
            state = (f"{row['us']:8.1f} us  ids {'equal' if row['ids_equal'] else 'DIFFER'}  diff {row['diff']:.3g}"
                     if "us" in row else row["error"])
            print(f"  batch {batch:>2}  (BLOCK_K, GEMV_WARPS, ROUTE_WARPS) {candidate}  {state}")
        good = [r for r in results if "us" in r and r["ids_equal"]]
        if good:
            best = min(good, key=lambda r: r["us"])
            print(f"  batch {batch:>2} best: {best['candidate']} {best['us']:.1f} us (default "
                  f"{results[0].get('us', float('nan')):.1f} us)")
        rows += results
    for name, value in zip(names, defaults):
        setattr(kernels, name, value)
    return rows


def set_fused(fused: bool) -> None:
    for name in SWITCHES:
        if fused:
            os.environ.pop(name, None)
        else:
            os.environ[name] = "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=50, help="calls per captured graph")
    parser.add_argument("--sweep-hc", action="store_true", help="only the hc mix tile sweep (see above)")
    parser.add_argument("--sweep-router", action="store_true", help="only the router kernels' sweep (see above)")
    parser.add_argument("--int8", action="store_true", help="with --sweep-hc: sweep the mix over INT8 mixer weights")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name(device).replace(" ", "-").lower()
    print(f"{name}: bf16, hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, hc {HC} x lowrank {LOWRANK}; "
          "us per call replayed from CUDA graphs")
    if args.sweep_hc or args.sweep_router:
        kind = ("hc_int8" if args.int8 else "hc") if args.sweep_hc else "router"
        if args.sweep_hc:
            rows = sweep_hc(device, dtype, args.batches, args.reps, HC_INT8 if args.int8 else "hc mix")
        else:
            rows = sweep_router(device, dtype, args.batches, args.reps)
        out = Path(__file__).parent / "results" / f"decode_fusions_{kind}_sweep_{name}.json"
        out.write_text(json.dumps({"device": name, "dtype": "bfloat16", "rows": rows}, indent=1))
        print(f"saved {out}")
        return
    print(f"{'op':<27} {'batch':>5} {'torch us':>9} {'fused us':>9} {'speedup':>8} {'kernels':>9} {'fused TB/s':>10}")
    rows = []
    for batch in args.batches:
        for op in (*STEP_CALLS, HC_INT8):
            row = {"op": op, "batch": batch}
            for fused in (False, True):
                set_fused(fused)
                fn, weight_bytes = ops(device, dtype, batch)[op]
                key = "fused" if fused else "torch"
                row[f"{key}_us"] = 1e6 * per_call_seconds(fn, args.reps)
                row[f"{key}_kernels"] = kernels_per_call(fn)
                row["weight_bytes"] = weight_bytes
            set_fused(True)
            rows.append(row)
            bandwidth = row["weight_bytes"] / (row["fused_us"] * 1e-6) / 1e12
            print(f"{op:<27} {batch:>5} {row['torch_us']:>9.1f} {row['fused_us']:>9.1f} "
                  f"{row['torch_us'] / row['fused_us']:>7.2f}x {row['torch_kernels']:>4} ->{row['fused_kernels']:>2} "
                  f"{bandwidth:>10.2f}")
    print("\nper decode step of the 4-layer benchmark model (4 routers, 8 mixes, 1 final mix, 8 combines, 1 PLE):")
    for batch in args.batches:
        step = [r for r in rows if r["batch"] == batch and r["op"] in STEP_CALLS]
        torch_us = sum(r["torch_us"] * STEP_CALLS[r["op"]] for r in step)
        fused_us = sum(r["fused_us"] * STEP_CALLS[r["op"]] for r in step)
        print(f"  batch {batch:>2}: torch {torch_us:7.1f} us, fused {fused_us:7.1f} us ({torch_us / fused_us:.2f}x)")
    out = Path(__file__).parent / "results" / f"decode_fusions_{name}.json"
    out.write_text(json.dumps({"device": name, "dtype": "bfloat16", "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
