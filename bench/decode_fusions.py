"""The decode fusions of issue 12 items 2, 3 and 6 at the real widths, torch vs fused kernels, side by side.

Times the MoE router (`SparseMoeBlock.route`: 512 experts top-10 + the shared gate over hidden 2560), the
hyper-connections (`HyperConnection.mix` with and without injection gates, and with its mixer weights INT8
per channel as int4-mixed checkpoints hold them; `HyperConnection.combine`; `combine_and_mix`, a layer's
attention residual folded into its MoE mix: 4 streams of 2560, low rank 320) and the PLE layer's decode
step (`PLELayer.forward`: n-gram hash and gather of 16 rows of 160, the key/value projection 2560 -> 12800,
gate, norms, dilated conv, history, residual add; the projection is the same GEMV in both forms) per call at
batch 1, 4 and 16, in bf16, each call replayed from a CUDA graph (as a decode step runs them), with
TIERLM_NO_FUSED_ROUTER / TIERLM_NO_FUSED_HC / TIERLM_NO_FUSED_PLE set (torch) and unset (fused); prints
microseconds per call, the ratio, kernels per call, and the bandwidth the fused form reaches on its
weights; then what a decode step of the 4-layer benchmark model spends on them (4 routers, 4 mixes,
4 combine + mix, 4 combines, 1 final mix, 1 PLE layer; the INT8 mix is a row of its own, not in that sum).
Results: bench/results/decode_fusions_<device>.json.

    python bench/decode_fusions.py
    python bench/decode_fusions.py --baseline ROOT  # also the hc mixes through ROOT's kernels, side by side
    python bench/decode_fusions.py --sweep-hc --baseline ROOT  # the hc mix kernels' tiles, old vs new
    python bench/decode_fusions.py --sweep-router # the router kernels' K slice and warps, each checked

`--sweep-router` times `SparseMoeBlock.route` for each candidate (BLOCK_K, GEMV_WARPS, ROUTE_WARPS) of
`kernels/moe_router.triton`, checks the expert ids equal the torch form's and the weights' max |difference|,
and prints the fastest correct one per batch (results: decode_fusions_router_sweep_<device>.json).

--baseline ROOT: the hc mix kernels of another checkout (ROOT holds tierlm/kernels/, e.g. a worktree of main
or `git archive main tierlm/kernels | tar -x -C ROOT`; loaded by `kernel_baseline`) on the same weights and
inputs: rows marked [baseline] in the table, and a column in the sweep.

`--sweep-hc` times `HyperConnection.mix` (with injection) at the real widths (hc 4 x 2560, r 320) and the
demo-small model's (hc 4 x 512, r 32; --hc-widths), with bf16 and with INT8 per-channel mixer weights, at
each batch: the --baseline kernels, this checkout's MIX_TILES, and each candidate `MixTiles` of
`kernels/hyper_connection.triton` (tokens per program: below 16 the broadcast-multiply GEMV form, from 16
tl.dot; down programs' rows x columns and warps; up programs' columns and warps), each checked against the
torch form (max |difference| of the block input). It prints every trial, then one line per (widths,
weights, batch): baseline, MIX_TILES and the best candidate side by side, then per batch the candidate
closest to the best everywhere (geometric mean of its time over each case's best): the MIX_TILES entry to
pick (results: decode_fusions_hc_sweep_<device>.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch
from decode_roofline import real_width_config
from device_timing import device_label, kernels_per_call

from tierlm.config import ModelConfig
from tierlm.model.cache import PLEState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.hyper_connection import HyperConnection
from tierlm.model.layers.moe import SparseMoeBlock
from tierlm.model.layers.ple import NgramIds, PLELayer
from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

HIDDEN, HC, LOWRANK, EXPERTS, TOP_K = 2560, 4, 320, 512, 10
SWITCHES = ("TIERLM_NO_FUSED_ROUTER", "TIERLM_NO_FUSED_HC", "TIERLM_NO_FUSED_PLE")
STEP_CALLS = {"router": 4, "hc mix": 4, "hc combine + mix": 4, "hc mix (final, no inject)": 1, "hc combine": 4,
              "ple": 1}  # 4 layers
HC_INT8 = "hc mix (int8)"
BASELINE = "[baseline]"  # rows of the hc mixes through --baseline's kernels
HC_WIDTHS = {"real": (HIDDEN, LOWRANK), "demo-small": (512, 32)}  # stream width H, low rank r (hc 4)


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


def hc_mixer(device, dtype, hidden: int, lowrank: int, with_inject: bool = True,
             int8: bool = False) -> HyperConnection:
    """A HyperConnection of random weights (its mixer INT8 per channel with int8)."""
    with torch.device("meta"):
        hc = HyperConnection(hidden, HC, lowrank, 1e-6, with_inject)
    hc = random_module(hc, device, dtype)
    return int8_mixer(hc) if int8 else hc


def baseline_mix(kernels: ModuleType, hc: HyperConnection, streams: torch.Tensor):
    """hc.mix(streams) through another checkout's mix kernels (`kernels`, --baseline) in place of this
    one's, with the arguments `HyperConnection.kernel_call` gives this one's (the torch form where that
    takes no kernel, as hc.mix)."""

    def call():
        kernel_call = hc.kernel_call(streams)
        if kernel_call is None:
            return hc.mix(streams)
        return kernels.mix(streams, *kernel_call[1])

    return call


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


def ops(device, dtype, batch: int, baseline: ModuleType | None = None) -> dict:
    """name -> (callable, weight bytes it reads); with `baseline` (another checkout's hc kernels) also the
    hc mixes through them, named "... [baseline]"."""
    gen = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, HIDDEN, device=device, generator=gen).to(dtype)
    streams = torch.randn(batch, HC * HIDDEN, device=device, generator=gen).to(dtype)
    inject = torch.rand(batch, HC, device=device, generator=gen).to(dtype)
    block = router_block(device, dtype)
    hc, final = hc_mixer(device, dtype, HIDDEN, LOWRANK), hc_mixer(device, dtype, HIDDEN, LOWRANK, False)
    hc_int8 = hc_mixer(device, dtype, HIDDEN, LOWRANK, int8=True)

    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    table = {
        "router": (lambda: block.route(x), nbytes(block.router)),
        "hc mix": (lambda: hc.mix(streams), nbytes(hc)),
        "hc mix (final, no inject)": (lambda: final.mix(streams), nbytes(final)),
        HC_INT8: (lambda: hc_int8.mix(streams), nbytes(hc_int8)),
        "hc combine": (lambda: HyperConnection.combine(streams, x, inject), 0),
        "hc combine + mix": (lambda: hc.combine_and_mix(streams, x, inject), nbytes(hc)),
        "ple": ple_call(device, dtype, batch),
    }
    if baseline is not None:
        table[f"hc mix {BASELINE}"] = (baseline_mix(baseline, hc, streams), nbytes(hc))
        table[f"{HC_INT8} {BASELINE}"] = (baseline_mix(baseline, hc_int8, streams), nbytes(hc_int8))
    return table


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


def hc_candidates(batch: int) -> list:
    """MixTiles to try at `batch` tokens: (block_n, block_j, block_k, down_warps, block_h, up_warps[, up_finish]); the
    GEMV form (block_n < 16) up to 8 tokens, tl.dot (block_n 16) at every batch. (About 20 compilations per
    widths and weight format: the tl.dot ones are shared by the batches.)"""
    from tierlm.kernels.hyper_connection.triton import MixTiles

    dot = [MixTiles(16, 16, 512, 4, 16, 4), MixTiles(16, 32, 256, 4, 16, 4), MixTiles(16, 16, 256, 4, 16, 4),
           MixTiles(16, 16, 1024, 8, 16, 4), MixTiles(16, 16, 512, 4, 32, 8), MixTiles(16, 32, 512, 8, 16, 4)]
    if batch > 8:
        return dot
    n = 1 << (batch - 1).bit_length()  # tokens per program: the batch's power of 2
    gemv = [MixTiles(n, 16, 512, 4, 8, 4), MixTiles(n, 32, 256, 4, 8, 4), MixTiles(n, 16, 256, 4, 8, 4),
            MixTiles(n, 8, 512, 4, 8, 4), MixTiles(n, 16, 1024, 8, 8, 4), MixTiles(n, 16, 512, 4, 4, 4),
            MixTiles(n, 16, 512, 4, 16, 4), MixTiles(n, 16, 512, 4, 8, 8)]
    # the up programs finishing the down projection: few slices a stream, as their partials are each up
    # program's registers (sm_90, ptxas, real widths, the up tile a stream each (session 21): one token 125-163
    # registers a thread, 2 tokens fit only at block_h 2-4, 4 tokens took 193-210, and both read slower in
    # the 4-layer stack; the merged up tile's: kernels/hyper_connection's docstring)
    up_finish = [MixTiles(n, 2, 4096, 4, 8, 4, True), MixTiles(n, 4, 4096, 8, 8, 4, True),
                 MixTiles(n, 4, 2048, 4, 8, 4, True), MixTiles(n, 8, 1024, 4, 8, 4, True),
                 MixTiles(n, 2, 4096, 4, 4, 4, True), MixTiles(n, 2, 4096, 4, 16, 4, True),
                 MixTiles(n, 8, 512, 4, 8, 4, True)]
    return gemv + (up_finish if batch == 1 else []) + dot[:2]


def sweep_hc(device, dtype, batches: list[int], reps: int, widths: list[str],
             baseline: ModuleType | None = None) -> list[dict]:
    """For each widths x (bf16, INT8 mixer) x batch: us per hc mix call (with injection) through the
    --baseline kernels, this checkout's MIX_TILES and each candidate, and max |difference| of the block
    input from the torch form; a summary, old vs new, and the MIX_TILES entry to pick per batch."""
    import tierlm.kernels.hyper_connection.triton as kernels

    defaults, rows = kernels.MIX_TILES, []
    print("\nhc mix sweep (us per call; diff: max |fused - torch| of the block input)")
    for name in widths:
        hidden, lowrank = HC_WIDTHS[name]
        for weights in ("bf16", "int8"):
            hc = hc_mixer(device, dtype, hidden, lowrank, int8=weights == "int8")
            for batch in batches:
                gen = torch.Generator(device=device).manual_seed(batch)
                streams = torch.randn(batch, HC * hidden, device=device, generator=gen).to(dtype)
                set_fused(False)
                expected = hc.mix(streams)[0].float()
                set_fused(True)
                case = {"widths": name, "weights": weights, "batch": batch}

                def trial(tiles, fn, case=case, expected=expected) -> dict:
                    kernels.MIX_TILES = defaults if tiles is None else ((kernels.MAX_TOKENS, tiles),)
                    try:
                        diff = (fn()[0].float() - expected).abs().max().item()
                        return {**case, "tiles": tiles, "diff": diff, "us": 1e6 * per_call_seconds(fn, reps)}
                    except Exception as exc:  # noqa: BLE001 (a candidate the compiler refuses: reported, skipped)
                        return {**case, "tiles": tiles, "error": f"{type(exc).__name__}: {exc}"[:200]}

                def mix(hc=hc, streams=streams):
                    return hc.mix(streams)

                results = [trial(None, mix) | {"tiles": "MIX_TILES"}]
                if baseline is not None:
                    results.append(trial(None, baseline_mix(baseline, hc, streams)) | {"tiles": BASELINE})
                for tiles in hc_candidates(batch):
                    try:
                        kernels.check_tiles(tiles, weights == "int8")
                    except ValueError:
                        continue  # (tl.dot's least sizes: not a tile INT8 weights can take)
                    results.append(trial(tiles, mix) | {"tiles": tuple(tiles)})
                tolerance = 4 * max(results[0].get("diff", 0.0), 1e-2)  # MIX_TILES' own distance, with room
                for r in results:
                    r["ok"] = "us" in r and r["diff"] <= tolerance
                    state = f"{r['us']:8.1f} us  diff {r['diff']:.3g}" if "us" in r else r["error"]
                    print(f"  {name:<10} {weights} batch {batch:>2}  {r['tiles']!s:<30} {state}"
                          f"{'' if r['ok'] or 'us' not in r else '  (OFF: beyond tolerance)'}")
                rows += results
    kernels.MIX_TILES = defaults
    summarize_hc_sweep(rows, baseline is not None)
    return rows


def summarize_hc_sweep(rows: list[dict], with_baseline: bool) -> None:
    """Per case: baseline, MIX_TILES and the best candidate side by side; per batch: the candidate whose
    geometric mean time over each case's best is least (the MIX_TILES entry to pick)."""
    def us(r):
        return f"{r['us']:7.1f}" if r and r.get("ok") else "    n/a"

    print(f"\n{'widths':<10} {'weights':<7} {'batch':>5} {'baseline':>8} {'MIX_TILES':>9} {'best':>7} "
          f"{'old/new':>7}  best tiles")
    cases = sorted({(r["widths"], r["weights"], r["batch"]) for r in rows}, key=lambda c: (c[0], c[1], c[2]))
    best_of = {}
    for case in cases:
        mine = [r for r in rows if (r["widths"], r["weights"], r["batch"]) == case]
        pick = {r["tiles"]: r for r in mine if isinstance(r["tiles"], str)}
        candidates = [r for r in mine if not isinstance(r["tiles"], str) and r["ok"]]
        best = min(candidates, key=lambda r: r["us"], default=None)
        best_of[case] = best["us"] if best else None
        old, new = pick.get(BASELINE), pick.get("MIX_TILES")
        ratio = f"{old['us'] / new['us']:6.2f}x" if with_baseline and old and new and old.get("ok") and new.get("ok") \
            else "    n/a"
        print(f"{case[0]:<10} {case[1]:<7} {case[2]:>5} {us(old) if with_baseline else '    n/a':>8} {us(new):>9} "
              f"{us(best):>7} {ratio:>7}  {best['tiles'] if best else '-'}")
    print("\nper batch, the candidate nearest each case's best (geometric mean of us / best us over the cases):")
    for batch in sorted({c[2] for c in cases}):
        scores = {}
        for tiles in {r["tiles"] for r in rows if r["batch"] == batch and not isinstance(r["tiles"], str)}:
            mine = [r for r in rows if r["batch"] == batch and r["tiles"] == tiles]
            if len(mine) == sum(1 for c in cases if c[2] == batch) and all(r["ok"] for r in mine):
                ratios = [r["us"] / best_of[(r["widths"], r["weights"], batch)] for r in mine]
                scores[tiles] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        if scores:
            tiles = min(scores, key=scores.get)
            print(f"  batch {batch:>2}: MixTiles{tiles}  ({scores[tiles]:.3f} x the best, every case correct)")


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
    parser.add_argument("--hc-widths", nargs="+", choices=list(HC_WIDTHS), default=list(HC_WIDTHS),
                        help="with --sweep-hc: the widths to sweep the mix at")
    parser.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                        help="also the hc mixes through the kernels of the checkout at ROOT (see above)")
    args = parser.parse_args()
    baseline = None
    if args.baseline is not None:
        from kernel_baseline import load_baseline

        baseline = load_baseline(args.baseline, "hyper_connection")
    device, dtype = torch.device("cuda"), torch.bfloat16
    name = device_label(device)
    print(f"{name}: bf16, hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, hc {HC} x lowrank {LOWRANK}; "
          "us per call replayed from CUDA graphs")
    if args.sweep_hc or args.sweep_router:
        kind = "hc" if args.sweep_hc else "router"
        if args.sweep_hc:
            rows = sweep_hc(device, dtype, args.batches, args.reps, args.hc_widths, baseline)
        else:
            rows = sweep_router(device, dtype, args.batches, args.reps)
        out = Path(__file__).parent / "results" / f"decode_fusions_{kind}_sweep_{name}.json"
        out.write_text(json.dumps({"device": name, "dtype": "bfloat16", "rows": rows}, indent=1))
        print(f"saved {out}")
        return
    print(f"{'op':<27} {'batch':>5} {'torch us':>9} {'fused us':>9} {'speedup':>8} {'kernels':>9} {'fused TB/s':>10}")
    rows = []
    for batch in args.batches:
        for op in (*STEP_CALLS, HC_INT8, *((f"hc mix {BASELINE}", f"{HC_INT8} {BASELINE}") if baseline else ())):
            row = {"op": op, "batch": batch}
            for fused in (False, True):
                set_fused(fused)
                fn, weight_bytes = ops(device, dtype, batch, baseline)[op]
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
    print("\nper decode step of the 4-layer benchmark model (4 routers, 4 mixes, 4 combine + mix, 1 final mix, "
          "4 combines, 1 PLE):")
    for batch in args.batches:
        step = [r for r in rows if r["batch"] == batch and r["op"] in STEP_CALLS]
        torch_us = sum(r["torch_us"] * STEP_CALLS[r["op"]] for r in step)
        fused_us = sum(r["fused_us"] * STEP_CALLS[r["op"]] for r in step)
        print(f"  batch {batch:>2}: torch {torch_us:7.1f} us, fused {fused_us:7.1f} us ({torch_us / fused_us:.2f}x)")
    if baseline is not None:
        print(f"\nhc mix, this checkout's kernels vs {args.baseline}'s (us per call):")
        for batch in args.batches:
            fused = {r["op"]: r["fused_us"] for r in rows if r["batch"] == batch}
            for op in ("hc mix", HC_INT8):
                old, new = fused[f"{op} {BASELINE}"], fused[op]
                print(f"  {op:<14} batch {batch:>2}: {old:6.1f} -> {new:6.1f} us ({old / new:.2f}x)")
    out = Path(__file__).parent / "results" / f"decode_fusions_{name}.json"
    out.write_text(json.dumps({"device": name, "dtype": "bfloat16", "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
