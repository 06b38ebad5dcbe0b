"""The quant_linear kernels (kernels/quant_linear/triton.py) at the target model's linear shapes, against
the device copy bandwidth and cuBLAS.

For N x K = 10240 x 2560 (GDN in_proj), 248320 x 2560 (lm_head) and 2560 x 6144, batches of 1, 4 and
16 rows, bf16 weights and packed INT8 (one scale per output channel) and INT4 (group 128) weights, it
measures in one run:
  - the device copy bandwidth: a large tensor copied, (bytes read + bytes written) / time;
  - the kernel's achieved bandwidth on the weight bytes it must read (the packed words and scales, or
    the bf16 weight) and its ratio to the copy bandwidth;
  - torch's F.linear on the bf16 weight of the same shape (cuBLAS), and the kernel's speed-up over it;
  - with --baseline ROOT, another checkout's quant_linear kernel (before/after in one run).
Each timed call cycles through enough copies of the weight that one call's weight is not in L2 for the
next (CUDA-graph replay of the cycle, best of 5). The kernel's output is checked against the torch
reference (`naive`: the weight dequantized, then F.linear): max |diff| relative to max |reference|.

    python bench/quant_linear_kernel.py            # CUDA
    python bench/quant_linear_kernel.py --sweep    # CUDA, also sweeps the tile sizes (best one reported)
    python bench/quant_linear_kernel.py --baseline ../main   # CUDA, before (../main's kernel) and after
    python bench/quant_linear_kernel.py --small    # CPU: Triton's interpreter, tiny shapes
    python bench/quant_linear_kernel.py --formats bf16 int6-g32 --shapes 1280x2560 2560x640 --batches 1 4 \
        --baseline ../main   # the INT6 shared expert's gate_up and down (int4-mixed), before and after
    python bench/quant_linear_kernel.py --sweep-dense           # CUDA: the bf16 GEMV's tiles, see below
    python bench/quant_linear_kernel.py --sweep-dense --small   # CPU: the same on tiny shapes, 2 candidates
Results go to bench/results/quant_linear_kernel_<device>.json.

--sweep-dense: the unquantized GEMV's tiles for the model's dense bf16 decode projections, which run it on
CUDA (`DenseFormat.kernel_linear`): GDN's in_proj (16384 x 2560) and out_proj (2560 x 6144), PLE's key/value
projection (12800 x 2560), at 1, 2 and 4 rows (2: a K=1 speculative verify step's rows, or two streams:
`DENSE_GEMV_MAX_ROWS` in model/quantization/base.py says which take the GEMV). For each row count, first the
tiles (BLOCK_N, BLOCK_K, warps; `DENSE_TILE_SWEEP`), then, with the best of them, the programs K is split to
fill (`GEMV_TARGET_PROGRAMS`): each candidate's time on every shape against torch.matmul's (cuBLAS), its
output checked against the reference (a candidate off by more than DENSE_TOLERANCE is reported and never
chosen); the best is the least total time over the shapes (what a decode step pays), and the best per shape
is printed too. One row sweeps the unquantized one-row tiles (`DENSE_GEMV_*`; the first candidate is the
shipped one, whose BLOCK_K depends on K; the others use one BLOCK_K at every K); 2 and 4 rows sweep the GEMV
tiles that unquantized rows share with INT6 (`GEMV_BLOCK_N`, `GEMV_BLOCK_K`, `GEMV_NUM_WARPS`). Results go
to bench/results/quant_linear_kernel_dense_sweep_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from device_timing import copy_bandwidth, timed

TARGET = {"shapes": [(10240, 2560), (248320, 2560), (2560, 6144)], "l2_bytes": 256 << 20}
SMALL = {"shapes": [(40, 256), (24, 512)], "l2_bytes": 1 << 20}
# (bits, group; None: per channel); int6-g32: int4-mixed's shared expert (not in the default run)
FORMATS = {"bf16": (None, None), "int8": (8, None), "int4-g128": (4, 128), "int6-g32": (6, 32)}
DEFAULT_FORMATS = ["bf16", "int8", "int4-g128"]
# --sweep: the GEMV tiles (batches up to GEMV_MAX_ROWS; the packed 4/8-bit GEMV has its own), then the K
# split, or the GEMM tiles of the format (larger batches); each candidate timed on every shape, the one
# with the best mean fraction of the copy bandwidth kept (module constants of quant_linear.triton)
GEMV_SWEEP = [{"GEMV_BLOCK_N": n, "GEMV_BLOCK_K": {1: k, 2: k, 4: k // 2}, "GEMV_NUM_WARPS": w}
              for n in (4, 8, 16) for k in (256, 512, 1024) for w in (4, 8) if w == 4 or k == 1024]
# packed (N, K, warps): 4-bit words per thread 2 to 16 (8-bit: twice as many); a candidate replaces the tiles of
# the swept batch's rows a program only (`packed_gemv_sweep`)
PACKED_GEMV_TILES = [(n, k, w) for n in (8, 16, 32) for k in (256, 512, 1024) for w in (4, 8)
                     if 2 <= n * k // 8 // (32 * w) <= 16]
SPLIT_SWEEP = [{"GEMV_TARGET_PROGRAMS": t, "GEMV_MIN_TILES_PER_SPLIT": m} for t in (264, 528, 1056) for m in (2, 4)]
# then, packed 4/8 bits at 2 to GEMV_MAX_ROWS rows: the GEMV as swept against the tl.dot GEMM (PACKED_GEMV_MAX_ROWS
# below the batch, PACKED_GEMM_MIN_N_TILES 0: every output width) with each of GEMM_SWEEP's tiles
# --sweep-dense (module docstring): the shapes, then (BLOCK_N, BLOCK_K, warps) with 16 to 64 fp32
# accumulators a thread (rows x BLOCK_N x BLOCK_K / threads: the GEMV's per-product accumulators), then
# the target programs
DENSE_SHAPES = {"target": [(16384, 2560), (2560, 6144), (12800, 2560)], "small": [(48, 256), (40, 384)]}
DENSE_TILE_SWEEP = {rows: [(n, k, w) for n in (4, 8, 16, 32) for k in (128, 256, 512, 1024) for w in (4, 8)
                           if 16 <= rows * n * k // (32 * w) <= 64] for rows in (1, 2, 4)}
DENSE_PROGRAMS_SWEEP = (264, 528, 1056, 2112)
DENSE_SWEPT = ("DENSE_GEMV_BLOCK_N", "DENSE_GEMV_BLOCK_K", "DENSE_GEMV_LONG_BLOCK_K", "DENSE_GEMV_NUM_WARPS",
               "GEMV_BLOCK_N", "GEMV_BLOCK_K", "GEMV_NUM_WARPS", "GEMV_TARGET_PROGRAMS")  # restored after each
DENSE_TOLERANCE = 1e-2  # max |kernel - reference| / max |reference| (bf16: a few units of roundoff)
GEMM_SWEEP = [(64, 64, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4), (32, 64, 2), (64, 128, 8)]  # N, K, warps






def make_weights(n: int, k: int, fmt: str, copies: int, device: torch.device, gen: torch.Generator):
    """copies of one random weight in a format: [(weight_or_packed, kwargs)], and the bytes of one copy.
    Packed words are random bits (every pattern is a valid code); scales small so outputs stay in range."""
    from tierlm.kernels.quant_linear.packing import packed_width

    bits, group = FORMATS[fmt]
    out = []
    for _ in range(copies):
        if bits is None:
            w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k**-0.5
            out.append((w, {}))
            continue
        words = torch.randint(-2**31, 2**31 - 1, (n, packed_width(k, bits)), generator=gen, device=device,
                              dtype=torch.int32)
        groups = 1 if group is None else k // group
        scales = (torch.rand(n, groups, generator=gen, device=device) * 0.5 / (k**0.5 * (1 << (bits - 1))))
        out.append((words, {"scales": scales.to(torch.bfloat16), "bits": bits, "group_size": group}))
    w, kw = out[0]
    nbytes = w.numel() * w.element_size() + (kw["scales"].numel() * 2 if kw else 0)
    return out, nbytes


def measure_shape(run: SimpleNamespace, n: int, k: int, fmt: str, batch: int, weights: list,
                  with_baseline: bool = False) -> dict:
    """One (shape, format, batch): the kernel with the tiles as set now (and the --baseline kernel)."""
    from tierlm.kernels.quant_linear import triton as kernels

    copies = len(weights) - 1
    xs = run.xs[(k, batch)]
    kernel_s = timed(lambda i: kernels.quant_linear(xs[i % len(xs)], weights[i][0], **weights[i][1]), copies,
                     run.device)
    result = {"kernel_s": kernel_s, "fraction": run.nbytes[(n, k, fmt)] / kernel_s / run.copy}
    if with_baseline and run.baseline is not None:
        result["baseline_s"] = timed(lambda i: run.baseline.quant_linear(xs[i % len(xs)], weights[i][0], **weights[i][1]),
                                     copies, run.device)
    return result


def packed_gemv_sweep(batch: int) -> list[dict]:
    """PACKED_GEMV_TILES as candidates for `sweep`: each replaces the entry of `batch`'s rows a program."""
    from tierlm.kernels.quant_linear import triton as kernels

    rows = 1 << (batch - 1).bit_length()  # (the next power of 2)
    return [{"PACKED_GEMV_BLOCK_N": {**kernels.PACKED_GEMV_BLOCK_N, rows: n},
             "PACKED_GEMV_BLOCK_K": {**kernels.PACKED_GEMV_BLOCK_K, rows: k},
             "PACKED_GEMV_NUM_WARPS": {**kernels.PACKED_GEMV_NUM_WARPS, rows: w}} for n, k, w in PACKED_GEMV_TILES]


def sweep(run: SimpleNamespace, fmt: str, batch: int, stage: list, weights_of: dict) -> dict:
    """Set the candidate of `stage` with the best mean fraction of the copy bandwidth over the shapes."""
    from tierlm.kernels.quant_linear import triton as kernels

    before = {name: getattr(kernels, name) for candidate in stage for name in candidate}
    best = None
    for candidate in stage:
        for name, value in {**before, **candidate}.items():
            setattr(kernels, name, value)
        fractions = [measure_shape(run, n, k, fmt, batch, weights_of[(n, k)])["fraction"] for n, k in run.shapes]
        mean = sum(fractions) / len(fractions)
        print(f"{fmt:>10}{batch:>6}  {candidate}: " + ", ".join(f"{f:.1%}" for f in fractions) + f"  mean {mean:.1%}")
        if best is None or mean > best[0]:
            best = (mean, candidate)
    for name, value in {**before, **best[1]}.items():  # (what the winner does not set, as it was before)
        setattr(kernels, name, value)
    return best[1]


def measure(args, device: torch.device) -> dict:
    from tierlm.kernels.quant_linear import naive
    from tierlm.kernels.quant_linear import triton as kernels

    target = SMALL if args.small else TARGET
    gen = torch.Generator(device=device).manual_seed(0)
    copy = copy_bandwidth(device, args.copy_bytes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    shapes = args.shapes or [tuple(s) for s in target["shapes"]]
    xs = {(k, b): [torch.randn(b, k, generator=gen, device=device).to(torch.bfloat16) for _ in range(4)]
          for k in {k for _, k in shapes} for b in args.batches}
    run = SimpleNamespace(device=device, copy=copy, shapes=shapes, xs=xs, nbytes={}, baseline=None)
    if args.baseline is not None:
        from kernel_baseline import load_baseline

        run.baseline = load_baseline(args.baseline, "quant_linear")
    print(f"device: {name}; copy bandwidth {copy / 1e9:.1f} GB/s (read + write)")
    print(f"{'format':>10}{'N x K':>14}{'batch':>6}{'MB':>9}{'kernel us':>11}{'GB/s':>8}{'of copy':>8}"
          f"{'before us':>11}{'speed-up':>9}{'cuBLAS bf16 us':>15}{'speed-up':>9}{'max rel diff':>13}  tiles")
    rows, chosen = [], {}
    bf16_us = {}
    for fmt in args.formats:
        weights_of = {}
        for n, k in shapes:
            one = make_weights(n, k, fmt, 1, device, gen)[1]
            copies = 1 if device.type != "cuda" else max(2, min(8, math.ceil(target["l2_bytes"] / one)))
            weights_of[(n, k)], run.nbytes[(n, k, fmt)] = make_weights(n, k, fmt, copies + 1, device, gen)
        for batch in args.batches:
            gemv = batch <= kernels.GEMV_MAX_ROWS
            if args.sweep:
                tiles = {}
                bits = FORMATS[fmt][0] or 0
                gemm = [{"GEMM_TILES": {**kernels.GEMM_TILES, bits: tiles}} for tiles in GEMM_SWEEP]
                packed = bits in (4, 8)
                if packed and gemv:
                    kernels.PACKED_GEMV_MAX_ROWS = kernels.GEMV_MAX_ROWS  # (an earlier batch's GEMM winner undone)
                stages = [packed_gemv_sweep(batch) if packed else GEMV_SWEEP, SPLIT_SWEEP] if gemv else [gemm]
                if packed and gemv and batch > 1:
                    stages.append([{"PACKED_GEMV_MAX_ROWS": kernels.GEMV_MAX_ROWS},
                                   *({"PACKED_GEMV_MAX_ROWS": batch - 1, "PACKED_GEMM_MIN_N_TILES": 0, **candidate}
                                     for candidate in gemm)])
                for stage in stages:
                    tiles.update(sweep(run, fmt, batch, stage, weights_of))
                chosen[f"{fmt}-b{batch}"] = tiles
            for n, k in shapes:
                weights = weights_of[(n, k)]
                result = measure_shape(run, n, k, fmt, batch, weights, with_baseline=True)
                x = xs[(k, batch)][0]
                if fmt == "bf16":
                    bf16_us[(n, k, batch)] = timed(lambda i, x=x, weights=weights: torch.nn.functional.linear(
                        x, weights[i][0]), len(weights) - 1, device) * 1e6
                ref = naive.quant_linear(x, weights[0][0], **weights[0][1]).float()
                out = kernels.quant_linear(x, weights[0][0], **weights[0][1]).float()
                diff = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                cfg = kernels.launch_config(batch, n, k, FORMATS[fmt][0])
                nbytes, us = run.nbytes[(n, k, fmt)], result["kernel_s"] * 1e6
                cublas = bf16_us.get((n, k, batch))
                row = {"format": fmt, "N": n, "K": k, "batch": batch, "weight_bytes": nbytes, "kernel_us": us,
                       "kernel_GBps": nbytes / result["kernel_s"] / 1e9, "kernel_vs_copy": result["fraction"],
                       "cublas_bf16_us": cublas, "speedup_over_cublas_bf16": None if cublas is None else cublas / us,
                       "max_rel_diff": diff, "launch": cfg._asdict()}
                rows.append(row)
                before = result.get("baseline_s")
                row["baseline_us"] = None if before is None else before * 1e6
                row["baseline_over_kernel"] = None if before is None else before * 1e6 / us
                before_text = " " * 20 if before is None else f"{before * 1e6:>11.1f}{before * 1e6 / us:>8.2f}x"
                cublas_text = " " * 24 if cublas is None else f"{cublas:>15.1f}{cublas / us:>8.2f}x"
                print(f"{fmt:>10}{f'{n}x{k}':>14}{batch:>6}{nbytes / 1e6:>9.2f}{us:>11.1f}{row['kernel_GBps']:>8.1f}"
                      f"{result['fraction']:>8.1%}{before_text}{cublas_text}{diff:>13.2e}  "
                      f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} splits {cfg.splits} warps {getattr(cfg, 'num_warps', 4)}")
        weights_of = None
    return {"device": name, "copy_bandwidth_GBps": copy / 1e9, "torch": torch.__version__, "cuda_graph": True,
            "swept_tiles": chosen, "rows": rows}


def sweep_dense(args, device: torch.device) -> dict:
    """--sweep-dense (module docstring): every candidate's row per (rows, shape), and the best per rows."""
    from tierlm.kernels.dependent_launch import pdl_enabled
    from tierlm.kernels.quant_linear import naive
    from tierlm.kernels.quant_linear import triton as kernels

    small = args.small
    shapes = DENSE_SHAPES["small" if small else "target"]
    l2_bytes = (SMALL if small else TARGET)["l2_bytes"]
    gen = torch.Generator(device=device).manual_seed(0)
    copy = copy_bandwidth(device, args.copy_bytes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}; copy bandwidth {copy / 1e9:.1f} GB/s (read + write)")
    run = SimpleNamespace(device=device, copy=copy, xs={}, nbytes={}, baseline=None)
    weights_of, cublas_us = {}, {}
    for n, k in shapes:
        one = make_weights(n, k, "bf16", 1, device, gen)[1]
        copies = 1 if device.type != "cuda" else max(2, min(8, math.ceil(l2_bytes / one)))
        weights_of[(n, k)], run.nbytes[(n, k, "bf16")] = make_weights(n, k, "bf16", copies + 1, device, gen)
    rows_out, best_of = [], {}
    for rows in (1, 2, 4):
        block_m = rows  # (GEMV_BLOCK_K's key)
        for k in {k for _, k in shapes}:
            run.xs[(k, rows)] = [torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16) for _ in range(4)]
        for n, k in shapes:
            x, weights = run.xs[(k, rows)], weights_of[(n, k)]
            cublas_us[(n, k, rows)] = timed(lambda i, x=x, weights=weights: torch.matmul(
                x[i % len(x)], weights[i][0].t()), len(weights) - 1, device) * 1e6
        saved = {name: getattr(kernels, name) for name in DENSE_SWEPT}
        tiles = DENSE_TILE_SWEEP[rows][:2] if small else DENSE_TILE_SWEEP[rows]
        programs = DENSE_PROGRAMS_SWEEP[:2] if small else DENSE_PROGRAMS_SWEEP
        if rows == 1:  # the unquantized one-row tiles (the shipped ones first)
            tile_stage = [{name: saved[name] for name in DENSE_SWEPT if name.startswith("DENSE_")}] + [
                {"DENSE_GEMV_BLOCK_N": n, "DENSE_GEMV_BLOCK_K": k, "DENSE_GEMV_LONG_BLOCK_K": k,
                 "DENSE_GEMV_NUM_WARPS": w} for n, k, w in tiles]
        else:  # the GEMV tiles shared with INT6
            tile_stage = [{"GEMV_BLOCK_N": n, "GEMV_BLOCK_K": {**saved["GEMV_BLOCK_K"], block_m: k},
                           "GEMV_NUM_WARPS": w} for n, k, w in tiles]
        stages = [tile_stage, [{"GEMV_TARGET_PROGRAMS": p} for p in programs]]
        print(f"\n{rows} row(s): {'tiles (N, K, warps), programs':<34}" + "".join(
            f"{f'{n}x{k} us':>14}{'vs cuBLAS':>10}" for n, k in shapes) + f"{'total us':>10}{'max rel diff':>13}")
        print(f"{'torch.matmul (cuBLAS)':>45}" + "".join(f"{cublas_us[(n, k, rows)]:>14.1f}{'':>10}" for n, k in shapes)
              + f"{sum(cublas_us[(n, k, rows)] for n, k in shapes):>10.1f}")
        chosen, best_row, rows_of_count = {}, None, []
        for stage in stages:
            best = None
            for candidate in stage:
                for attr, value in {**chosen, **candidate}.items():
                    setattr(kernels, attr, value)
                row = measure_dense_candidate(run, kernels, naive, shapes, rows, weights_of, cublas_us)
                rows_out.append(row)
                rows_of_count.append(row)
                print(f"{row['label']:>45}" + "".join(f"{s['kernel_us']:>14.1f}{s['speedup_over_cublas']:>9.2f}x"
                                                      for s in row["shapes"])
                      + f"{row['total_us']:>10.1f}{row['max_rel_diff']:>13.2e}" + ("" if row["ok"] else "  WRONG"))
                if row["ok"] and (best is None or row["total_us"] < best[0]["total_us"]):
                    best = (row, candidate)
            if best is not None:
                best_row = best[0]
                chosen.update(best[1])
        for attr, value in saved.items():
            setattr(kernels, attr, value)
        if best_row is not None:
            cublas_total = sum(cublas_us[(n, k, rows)] for n, k in shapes)
            best_of[rows] = {**best_row["config"], "total_us": best_row["total_us"], "cublas_total_us": cublas_total}
            print(f"best for {rows} row(s): {best_row['label']}: {best_row['total_us']:.1f} us vs cuBLAS "
                  f"{cublas_total:.1f} us ({cublas_total / best_row['total_us']:.2f}x)")
        for index, (n, k) in enumerate(shapes):
            fastest = min((row for row in rows_of_count if row["ok"]), key=lambda row: row["shapes"][index]["kernel_us"],
                          default=None)
            if fastest is not None:
                print(f"  best at {n}x{k}: {fastest['label']}: {fastest['shapes'][index]['kernel_us']:.1f} us")
    return {"device": name, "copy_bandwidth_GBps": copy / 1e9, "torch": torch.__version__, "cuda_graph": True,
            "pdl": pdl_enabled(device), "best": best_of, "rows": rows_out}


def measure_dense_candidate(run, kernels, naive, shapes, rows: int, weights_of: dict, cublas_us: dict) -> dict:
    """The tiles as set now in quant_linear.triton, on every shape at `rows`: time and check each."""
    cfg_of = {(n, k): kernels.launch_config(rows, n, k) for n, k in shapes}
    per_shape, worst = [], 0.0
    for n, k in shapes:
        weights = weights_of[(n, k)]
        result = measure_shape(run, n, k, "bf16", rows, weights)
        x = run.xs[(k, rows)][0]
        ref = naive.quant_linear(x, weights[0][0]).float()
        out = kernels.quant_linear(x, weights[0][0]).float()
        diff = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, diff)
        us = result["kernel_s"] * 1e6
        per_shape.append({"N": n, "K": k, "kernel_us": us, "kernel_vs_copy": result["fraction"],
                          "cublas_us": cublas_us[(n, k, rows)], "speedup_over_cublas": cublas_us[(n, k, rows)] / us,
                          "max_rel_diff": diff, "splits": cfg_of[(n, k)].splits})
    cfg = next(iter(cfg_of.values()))
    block_ks = sorted({c.block_k for c in cfg_of.values()})  # (the shipped one-row tiles: BLOCK_K by K)
    config = {"block_n": cfg.block_n, "block_k": block_ks, "warps": cfg.num_warps,
              "target_programs": kernels.GEMV_TARGET_PROGRAMS}
    label = f"{cfg.block_n}, {'/'.join(map(str, block_ks))}, {cfg.num_warps}; {config['target_programs']}"
    return {"rows": rows, "config": config, "label": label, "shapes": per_shape,
            "total_us": sum(s["kernel_us"] for s in per_shape), "max_rel_diff": worst, "ok": worst <= DENSE_TOLERANCE}


def n_by_k(text: str) -> tuple[int, int]:
    """'1280x2560' -> (1280, 2560): a weight shape N x K on the command line."""
    try:
        n, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is N x K, e.g. 1280x2560; got {text!r}") from None
    return n, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes; on a CPU, through Triton's interpreter")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS, choices=list(FORMATS))
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NxK", type=n_by_k,
                        help="weight shapes instead of the target model's (e.g. 1280x2560)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the tile sizes (best one reported)")
    parser.add_argument("--sweep-dense", action="store_true",
                        help="only sweep the bf16 GEMV's tiles at the model's dense decode projections (docstring)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                        help="also time ROOT's quant_linear kernel (another checkout: before/after in one run)")
    parser.add_argument("--copy-bytes", type=int, default=None, help="size of the copy-bandwidth tensor")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.small:
            parser.error("no CUDA device: run with --small (Triton's interpreter, tiny shapes)")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module first imports triton
        torch.set_num_threads(1)
    if args.copy_bytes is None:
        args.copy_bytes = 2 << 30 if device.type == "cuda" else 64 << 20
    result = sweep_dense(args, device) if args.sweep_dense else measure(args, device)
    slug = re.sub(r"[^a-z0-9]+", "_", result["device"].lower()).strip("_")
    kind = "_dense_sweep" if args.sweep_dense else ""
    out = args.out or Path(__file__).parent / "results" / f"quant_linear_kernel{kind}_{slug}{'_small' if args.small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
