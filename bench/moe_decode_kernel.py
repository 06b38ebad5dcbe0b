"""The fused MoE kernels (kernels/fused_moe/triton.py) vs the torch reference, at decode batch sizes.

At the target model's expert shapes (hidden 2560, 512 experts, top-10, expert intermediate 640) and
batches of 1, 4 and 16 tokens, for bf16 experts and INT4 experts with group 32 and 128, it measures in
one run:
  - the device copy bandwidth: a large tensor copied, (bytes read + bytes written) / time;
  - each form's achieved bandwidth on the expert weights a call must read (the packed words and
    scales, or the bf16 weights, of the distinct experts its tokens selected), and its ratio to the
    copy bandwidth: the kernels (2-3 launches at decode, replayed from a CUDA graph on a GPU), with
    --baseline ROOT also another checkout's kernels (before/after in one run), the torch reference (`naive`: a loop over the hit experts, each dequantized), and for bf16 the
    model's sync-free torch path (`FusedExpertsMethod._gathered`: the selected experts copied out, then
    bmm; what a static step took before the fused kernel, and takes with TIERLM_NO_FUSED_MOE=1).
Each timed call cycles through ROUTINGS different routings, so the weights of one call are not in L2
for the next (INT4 experts of one token fit in an H200's L2). The kernel's output is checked against
the reference on every routing (max |diff| relative to max |reference|).

    python bench/moe_decode_kernel.py                 # CUDA
    python bench/moe_decode_kernel.py --sweep         # CUDA, also sweeps the tile sizes (best reported)
    python bench/moe_decode_kernel.py --baseline ../main   # CUDA, before (../main's kernels) and after
    python bench/moe_decode_kernel.py --small         # CPU: Triton's interpreter, tiny shapes
    python bench/moe_decode_kernel.py --packed-sweep --no-reference   # CUDA: INT4 tile sweep, phase by phase
    python bench/moe_decode_kernel.py --shared --no-reference   # CUDA: also the MoE block's shared expert
    python bench/moe_decode_kernel.py --formats int4-g32 int4-g128 --batches 1 4 --no-reference \
        --packed-variants v1 v2 v2:gate_up_chunks=1 v2:gate_up_block_n=64   # CUDA: the K loops side by side
    python bench/moe_decode_kernel.py --formats int4-g32 int4-g128 --no-reference \
        --packed-variants v1:early=1 v1:early=0 v2:early=1 v2:early=0   # CUDA: early weights on and off
    python bench/moe_decode_kernel.py --formats bf16 --early-down-tiles 0 1 2 3 --no-reference   # CUDA
--shared adds, per format and batch, the experts with the block's shared expert (width 640; bf16 beside
bf16 experts, INT6 with the experts' group beside INT4 ones, as `tierlm quantize --scheme int4-mixed`
writes it) as the model ran them before (the routed kernel, then the shared SwiGLU through its own layers:
cuBLAS or the INT6 GEMV, SiLU, mul, the gate's product, the add) and fused (the shared expert one more
expert of every token in the routed launches, whatever PACKED_SHARED_APART_TOKENS says), each with its %
of the copy bandwidth on the distinct routed experts' bytes plus the shared expert's, and the batches at
which fused wins and loses (what `fused_moe.triton.PACKED_SHARED_APART_TOKENS` should say);
--shared-sweep also tries SHARED_SWEEP's K tiles first.
The packed sweep times the INT4 decode form's tiles (`packed_decode`) phase by phase at every batch size
and group (PACKED_GATE_UP_SWEEP with the default down, PACKED_DOWN_SWEEP with the default gate_up, then the
best of each together), prints their % of the copy bandwidth side by side with bf16's and with the INT4
kernel's recorded figures (RECORDED: session 7's H200 run), picks the best per batch size and measures the
rows with it; the shapes are compiled first by --compile-workers processes (Triton's disk cache).
--packed-variants times the INT4 decode form under each TIERLM_PACKED_MOE_VARIANT (`packed_decode.packed_variant`),
NAME or NAME:FIELD=VALUE,... (fields of the variant's tiles replaced: DECODE_TILES[4] for v1, PACKED_V2_TILES
for v2; early=0 / early=1: weights loaded after the wait / before it at any group, `packed_decode`'s early weights),
side by side per format and batch: each one's time, % of the copy bandwidth and max rel diff, and its speed-up over the first
(instead of the usual rows: they would time the default variant again).
Results go to bench/results/moe_decode_kernel_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from device_timing import copy_bandwidth, copy_floor, cuda_events, timed

ROUTINGS = 8  # (2 on the CPU, where the interpreter takes seconds per call)
TARGET = {"hidden": 2560, "experts": 512, "top_k": 10, "intermediate": 640, "shared": 640, "groups": (32, 128)}
SMALL = {"hidden": 32, "experts": 8, "top_k": 2, "intermediate": 32, "shared": 32, "groups": (16, 32)}
# --shared-sweep: the shared expert's K tiles (gate_up, down) per routed format's bits (DecodeTiles /
# PackedDecodeTiles .shared_*_block_k), at the first batch size; later ones keep the best
SHARED_SWEEP = {0: [(512, 128), (256, 128), (512, 256), (256, 64)],
                4: [(32, 16), (64, 16), (16, 16), (64, 32), (128, 16), (128, 64), (256, 64), (512, 128)]}
# --sweep: at the first batch size (later ones keep the tiles chosen there), the decode GEMV tiles of the
# unquantized format (fused_moe.triton.DECODE_TILES), one kernel at a time (gate_up with the down tiles as
# set, then down with the best gate_up), or the grouped GEMM's tiles (8 warps never won on an H200: not
# swept). Packed formats: --packed-sweep
GATE_UP_SWEEP = [{"gate_up_block_n": n, "gate_up_block_k": k} for n in (8, 16, 32) for k in (256, 512)]
DOWN_SWEEP = [{"down_block_n": n, "down_block_k": k, "down_ranks": r} for n in (16, 32) for k in (128, 256)
              for r in (5, 2)]
# --packed-sweep: the INT4 decode form's tiles (fused_moe.packed_decode.PackedDecodeTiles), one phase at a
# time (gate_up and down are separate launches): each gate_up shape (columns of I x words of H per program,
# warps) with the default down, each down shape (rows of H x words of I, warps) with the default gate_up,
# then the best of each together. At the target (H = 320 words, I = 80 words of INT4) a program's words
# set the K splits: gate_up 64 -> 5, 32 -> 10, 128 -> 3 (the last part-full); down 16 -> 5, 8 -> 10,
# 32 -> 3. Compiled for sm_90 (triton 3.9): (16, 64, 4) gate_up 72 registers, (64, 16, 4) down 56, every
# load of a program issued before its first FMA, no spills.
PACKED_GATE_UP_SWEEP = [(8, 64, 4), (16, 64, 4), (32, 64, 4), (16, 32, 4), (32, 32, 4), (16, 128, 4), (32, 64, 8),
                        (8, 32, 2), (16, 64, 2)]
PACKED_DOWN_SWEEP = [(32, 16, 4), (64, 16, 4), (128, 16, 4), (64, 8, 4), (128, 8, 4), (64, 32, 4), (128, 16, 8),
                     (32, 16, 2), (256, 16, 8)]
# the INT4 decode kernel's % of copy bandwidth before the split-K form (session 7, H200, the looped-tile
# packed form: bench/results/moe_decode_kernel_shared_nvidia_h200.txt)
RECORDED = {("int4-g32", 1): 0.240, ("int4-g32", 4): 0.338, ("int4-g32", 16): 0.353,
            ("int4-g128", 1): 0.244, ("int4-g128", 4): 0.390, ("int4-g128", 16): 0.402}
GROUPED_SWEEP = [{"PREFILL_BLOCK_M": m, "PREFILL_BLOCK_N": n, "PREFILL_BLOCK_K": k, "PREFILL_NUM_WARPS": w}
                 for m, n, k, w in ((16, 64, 64, 4), (16, 64, 128, 4), (16, 128, 64, 4), (16, 32, 128, 4),
                                    (16, 64, 128, 8), (32, 64, 64, 4), (16, 128, 128, 8), (16, 32, 64, 2))]






def make_experts(shape: dict, fmt: str, group: int | None, device: torch.device, gen: torch.Generator):
    """(w_gate_up, w_down, scales or None, bytes per expert): random weights; packed words are random
    bits (every pattern is a valid code), scales small so outputs stay in range."""
    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    if fmt == "bf16":
        w_gate_up = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) * h**-0.5
        w_down = torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16) * i**-0.5
        return w_gate_up, w_down, None, (w_gate_up[0].numel() + w_down[0].numel()) * 2
    from tierlm.kernels.quant_linear.packing import packed_width

    def words(n: int, k: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, (e, n, packed_width(k, 4)), generator=gen, device=device,
                             dtype=torch.int32)

    def scales(n: int, k: int) -> torch.Tensor:
        return (torch.rand(e, n, k // group, generator=gen, device=device) * 0.02 / k**0.5).to(torch.bfloat16)

    w_gate_up, w_down = words(2 * i, h), words(h, i)
    s = (scales(2 * i, h), scales(h, i))
    per_expert = sum(t[0].numel() * t.element_size() for t in (w_gate_up, w_down, *s))
    return w_gate_up, w_down, s, per_expert


def rel_diff(out: torch.Tensor, reference: torch.Tensor) -> float:
    """max |out - reference| over max |reference|, in fp32."""
    out, reference = out.float(), reference.float()
    return ((out - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def routings(batch: int, shape: dict, device: torch.device, gen: torch.Generator):
    """ROUTINGS random (weights, ids) of a decode batch: distinct experts per token, renormalised weights."""
    out = []
    for _ in range(ROUTINGS):
        probs = torch.softmax(torch.randn(batch, shape["experts"], generator=gen, device=device), dim=-1)
        weights, ids = torch.topk(probs, shape["top_k"], dim=-1)
        out.append(((weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16), ids))
    return out


def measure_batch(run: SimpleNamespace, experts: tuple, label: str, batch: int) -> dict:
    """One format at one batch size: kernel (best tiles if sweeping), reference, gathered; checked."""
    from tierlm.kernels.fused_moe import naive
    from tierlm.kernels.fused_moe import triton as kernels
    from tierlm.model.quantization.base import DENSE
    from tierlm.model.quantization.experts import FusedExpertsMethod

    w_gate_up, w_down, kw, per_expert = experts
    shape, device = run.shape, run.device
    x = [torch.randn(batch, shape["hidden"], generator=run.gen, device=device).to(torch.bfloat16)
         for _ in range(ROUTINGS)]
    routes = routings(batch, shape, device, run.gen)
    distinct = sum(torch.unique(ids).numel() for _, ids in routes) / ROUTINGS
    nbytes = distinct * per_expert
    decode = batch * shape["top_k"] <= kernels.DECODE_MAX_PAIRS

    def kernel(i: int) -> torch.Tensor:
        return kernels.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw)

    def reference(i: int) -> torch.Tensor:
        return naive.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw)

    bits = 0 if not kw else int(kw["format"][3:])

    def apply(candidate: dict) -> None:
        if decode:
            kernels.DECODE_TILES[bits] = kernels.DECODE_TILES[bits]._replace(**candidate)
        else:
            for name, value in candidate.items():
                setattr(kernels, name, value)

    if run.packed_best is not None and (label, batch) in run.packed_best:
        kernels.DECODE_TILES[bits] = run.packed_best[label, batch]
    elif (run.sweep is not None and (not run.sweep or label in run.sweep) and batch == run.sweep_batch
          and not (decode and bits in (4, 8))):
        for stage in (GATE_UP_SWEEP, DOWN_SWEEP) if decode else (GROUPED_SWEEP,):
            best = None
            for candidate in stage:
                apply(candidate)
                seconds = timed(kernel, ROUTINGS, device, run.use_graph)
                print(f"{'':>10}{batch:>6}  {candidate}: {seconds * 1e6:.1f} us, {nbytes / seconds / run.copy:.1%} of copy")
                if best is None or seconds < best[0]:
                    best = (seconds, candidate)
            apply(best[1])
    config = kernels.DECODE_TILES[bits]._asdict() if decode else {name: getattr(kernels, name) for name in GROUPED_SWEEP[0]}
    kernel_s = timed(kernel, ROUTINGS, device, run.use_graph)
    baseline_s = None
    if run.baseline is not None:  # the kernels of another checkout (--baseline), with their own tiles
        baseline_s = timed(lambda i: run.baseline.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw), ROUTINGS,
                           device, run.use_graph)
    reference_s = None if run.no_reference else timed(reference, ROUTINGS, device, use_graph=False)
    gathered_s = None
    if not kw:  # bf16: the model's static path today, on the same weights (no copy of the stack)
        holder = SimpleNamespace(gate_up_proj=w_gate_up, down_proj=w_down)
        torch_path = FusedExpertsMethod(DENSE)
        gathered_s = timed(lambda i: torch_path._gathered(holder, x[i], *routes[i]), ROUTINGS, device,
                           run.use_graph)
    diff = 0.0
    for i in range(ROUTINGS):
        diff = max(diff, rel_diff(kernel(i), reference(i)))
    row = {
        "format": label, "batch": batch, "path": "decode" if decode else "grouped", "distinct_experts": distinct,
        "weight_bytes_per_call": nbytes, "kernel_us": kernel_s * 1e6, "kernel_GBps": nbytes / kernel_s / 1e9,
        "kernel_vs_copy": nbytes / kernel_s / run.copy,
        "baseline_us": None if baseline_s is None else baseline_s * 1e6,
        "baseline_vs_copy": None if baseline_s is None else nbytes / baseline_s / run.copy,
        "baseline_over_kernel": None if baseline_s is None else baseline_s / kernel_s,
        "reference_us": None if reference_s is None else reference_s * 1e6,
        "reference_GBps": None if reference_s is None else nbytes / reference_s / 1e9,
        "reference_over_kernel": None if reference_s is None else reference_s / kernel_s,
        "gathered_us": None if gathered_s is None else gathered_s * 1e6,
        "gathered_over_kernel": None if gathered_s is None else gathered_s / kernel_s,
        "max_rel_diff": diff, "tiles": config,
    }
    if run.copy_floor and decode:
        row.update(copy_floor_row(run, nbytes, kernel_s))
    if run.phases and device.type == "cuda":
        row["launches_us"] = launch_times(kernel)
    baseline = (" " * 28 if baseline_s is None else
                f"{baseline_s * 1e6:>11.1f}{nbytes / baseline_s / run.copy:>8.1%}{baseline_s / kernel_s:>8.2f}x")
    gathered = " " * 22 if gathered_s is None else f"{gathered_s * 1e6:>12.1f}{gathered_s / kernel_s:>9.2f}x"
    reference_text = " " * 19 if reference_s is None else f"{reference_s * 1e6:>10.1f}{reference_s / kernel_s:>8.2f}x"
    print(f"{label:>10}{batch:>6}{row['path']:>8}{distinct:>8.1f}{nbytes / 1e6:>9.2f}{kernel_s * 1e6:>11.1f}"
          f"{row['kernel_GBps']:>8.1f}{row['kernel_vs_copy']:>8.1%}{baseline}{reference_text}{gathered}{diff:>13.2e}")
    if "copy_one_launch_us" in row:
        print(f"{'':>16}the copy kernel moving the same {nbytes / 1e6:.2f} MB: in one launch "
              f"{row['copy_one_launch_us']:.1f} us ({row['copy_one_launch_vs_copy']:.1%} of copy), as gate_up's and "
              f"down's shares in two launches {row['copy_two_launches_us']:.1f} us ({row['copy_two_launches_vs_copy']:.1%});"
              f" the kernel at {row['kernel_vs_one_launch_copy']:.1%} / {row['kernel_vs_two_launch_copy']:.1%} of "
              "their speed")
    if "launches_us" in row:
        print(f"{'':>16}each launch alone (eager, PDL off): "
              + ", ".join(f"{name} {us:.1f} us" for name, us in row["launches_us"]))
    return row


def launch_times(kernel, repeats: int = 5) -> list[tuple[str, float]]:
    """--phases: (kernel name, us) of each launch of one call, in launch order, averaged over `repeats`
    passes over the ROUTINGS calls: eager with TIERLM_NO_PDL=1 (each launch starts once the one before it
    has ended, so its time is its own)."""
    from decode_roofline import environment

    def passes(count: int) -> None:
        for _ in range(count):
            for i in range(ROUTINGS):
                kernel(i)

    with environment({"TIERLM_NO_PDL": "1"}):
        passes(1)
        torch.cuda.synchronize()
        events = cuda_events(lambda: passes(repeats))
    per_call = len(events) // (repeats * ROUTINGS)
    return [(events[j].name, sum(e.device_time_total for e in events[j::per_call]) / (repeats * ROUTINGS))
            for j in range(per_call)]


def copy_floor_row(run: SimpleNamespace, nbytes: float, kernel_s: float) -> dict:
    """--copy-floor: the copy kernel moving the call's bytes in one launch, and in the decode form's two
    dependent launches' shares (gate_up reads 2 / 3 of an expert's bytes, down 1 / 3, in every format: the
    same K groups over 2I x H and H x I values), each over ROUTINGS distinct buffers as the kernel reads
    distinct experts; with the kernel's time against theirs."""
    one = copy_floor([int(nbytes)], ROUTINGS, run.device, run.use_graph)
    two = copy_floor([int(nbytes * 2 / 3), int(nbytes / 3)], ROUTINGS, run.device, run.use_graph)
    return {"copy_one_launch_us": one * 1e6, "copy_one_launch_vs_copy": nbytes / one / run.copy,
            "copy_two_launches_us": two * 1e6, "copy_two_launches_vs_copy": nbytes / two / run.copy,
            "kernel_vs_one_launch_copy": one / kernel_s, "kernel_vs_two_launch_copy": two / kernel_s}


def packed_tiles(gate_up: tuple[int, int, int] | None = None, down: tuple[int, int, int] | None = None):
    """The INT4 decode form's default tiles with a gate_up and/or a down shape (n, words, warps) swapped in."""
    from tierlm.kernels.fused_moe import triton as kernels

    tiles = kernels.DECODE_TILES[4]
    if gate_up is not None:
        tiles = tiles._replace(**dict(zip(("gate_up_block_n", "gate_up_block_w", "gate_up_warps"), gate_up)))
    if down is not None:
        tiles = tiles._replace(**dict(zip(("down_block_n", "down_block_w", "down_warps"), down)))
    return tiles


def packed_stages() -> list[tuple[str, list, list]]:
    """The packed sweep's two stages: (name, shapes, tiles of each)."""
    return [("gate_up", PACKED_GATE_UP_SWEEP, [packed_tiles(gate_up=c) for c in PACKED_GATE_UP_SWEEP]),
            ("down", PACKED_DOWN_SWEEP, [packed_tiles(down=c) for c in PACKED_DOWN_SWEEP])]


def _compile_packed(task: tuple) -> None:
    """One packed tile shape at one group size run once (in a worker process, on a stack of a few
    experts of the target's width: the compiled kernels are the same and land in Triton's disk cache)."""
    group, tiles, shape, device = task
    from tierlm.kernels.fused_moe import triton as kernels
    from tierlm.kernels.quant_linear.packing import packed_width

    experts, h, inter, top_k = max(16, shape["top_k"]), shape["hidden"], shape["intermediate"], shape["top_k"]
    words = [torch.zeros(experts, n, packed_width(k, 4), dtype=torch.int32, device=device) for n, k in
             ((2 * inter, h), (h, inter))]
    scales = tuple(torch.ones(experts, n, k // group, dtype=torch.bfloat16, device=device) for n, k in
                   ((2 * inter, h), (h, inter)))
    x = torch.ones(1, h, dtype=torch.bfloat16, device=device)
    ids = torch.arange(top_k, device=device)[None, :]
    kernels.DECODE_TILES[4] = tiles
    routing = torch.full((1, top_k), 1 / top_k, dtype=torch.bfloat16, device=device)
    kernels.fused_moe(x, *words, routing, ids, format="int4", scales=scales, group_size=group)
    if device.type == "cuda":
        torch.cuda.synchronize()


def precompile_packed(shape: dict, workers: int, device: torch.device) -> None:
    """--packed-sweep on CUDA: compile every stage's tiles at every group in parallel processes first
    (each compiles the split copy and two phases per group: serially most of the sweep's time)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(group, tiles, shape, device) for group in shape["groups"] for _, _, stage in packed_stages()
             for tiles in stage]
    with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_packed, tasks))


def sweep_packed(run: SimpleNamespace, experts: tuple, label: str, batches: list[int]) -> list[dict]:
    """--packed-sweep: at every batch size, one format, each stage's shapes (`PACKED_GATE_UP_SWEEP` with the
    default down, `PACKED_DOWN_SWEEP` with the default gate_up) and then the two stages' best together;
    prints each one's % of the copy bandwidth (measured in this run) side by side (a shape whose output
    is off the reference by more than 5% is marked and never chosen), sets run.packed_best[label, batch];
    returns the measurements."""
    from tierlm.kernels.fused_moe import naive
    from tierlm.kernels.fused_moe import triton as kernels

    w_gate_up, w_down, kw, per_expert = experts
    shape, device = run.shape, run.device
    bits = int(kw["format"][3:])
    saved = kernels.DECODE_TILES[bits]
    cells, results = {}, []

    def measure_tiles(tiles, x, routes, reference, nbytes, batch):
        kernels.DECODE_TILES[bits] = tiles
        diff = rel_diff(kernels.fused_moe(x[0], w_gate_up, w_down, *routes[0], **kw), reference)
        seconds = timed(lambda i: kernels.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw), ROUTINGS, device,
                        run.use_graph)
        results.append({"format": label, "batch": batch, "tiles": tiles._asdict(), "us": seconds * 1e6,
                        "vs_copy": nbytes / seconds / run.copy, "max_rel_diff": diff})
        return seconds, diff

    for batch in batches:
        x = [torch.randn(batch, shape["hidden"], generator=run.gen, device=device).to(torch.bfloat16)
             for _ in range(ROUTINGS)]
        routes = routings(batch, shape, device, run.gen)
        nbytes = sum(torch.unique(ids).numel() for _, ids in routes) / ROUTINGS * per_expert
        reference = naive.fused_moe(x[0], w_gate_up, w_down, *routes[0], **kw).float()
        chosen = {}
        for stage, shapes, stage_tiles in packed_stages():
            best = None
            for candidate, tiles in zip(shapes, stage_tiles):
                seconds, diff = measure_tiles(tiles, x, routes, reference, nbytes, batch)
                cells[stage, candidate, batch] = f"{nbytes / seconds / run.copy:>7.1%}{'!' if diff > 0.05 else ' '}"
                if diff <= 0.05 and (best is None or seconds < best[0]):
                    best = (seconds, candidate)
            chosen[stage] = None if best is None else best[1]
        tiles = packed_tiles(chosen["gate_up"], chosen["down"])
        seconds, diff = measure_tiles(tiles, x, routes, reference, nbytes, batch)
        cells["both", batch] = f"{nbytes / seconds / run.copy:>7.1%}{'!' if diff > 0.05 else ' '}"
        if diff <= 0.05:
            run.packed_best[label, batch] = tiles
    kernels.DECODE_TILES[bits] = saved
    print(f"{label}: % of the copy bandwidth per tile shape and batch ('!': output off the reference by > 5%); "
          f"default {tuple(saved)}")
    print(f"{'phase':<9}{'n x words, warps':<22}" + "".join(f"{'b' + str(b):>9}" for b in batches))
    for stage, shapes, _ in packed_stages():
        for c in shapes:
            print(f"{stage:<9}{f'{c[0]} x {c[1]}, {c[2]}':<22}" + "".join(f"{cells[stage, c, b]:>9}" for b in batches))
    for name, values in (("recorded INT4 kernel (session 7)", [f"{RECORDED.get((label, b), float('nan')):>8.1%} "
                                                                for b in batches]),
                         ("bf16 kernel, this run", [f"{run.bf16_share.get(b, float('nan')):>8.1%} " for b in batches]),
                         ("best gate_up + best down", [cells.get(("both", b), "     none") for b in batches])):
        print(f"{name:<31}" + "".join(f"{v:>9}" for v in values))
    for batch in batches:
        if (label, batch) in run.packed_best:
            print(f"  b{batch}: PackedDecodeTiles{tuple(run.packed_best[label, batch])}")
    return results


def time_side_by_side(run: SimpleNamespace, experts: tuple, label: str, batch: int, keys: list,
                      configure: Callable[[object], tuple[dict, dict]]) -> tuple[dict, float]:
    """The routed experts at one batch size on the same inputs, once per key after configure(key), which
    returns (the environment variables the key sets, None: unset; what its cell records besides its
    time), the variables restored after each key (decode_roofline's `environment`): ({key: cell}, weight
    bytes a call); prints one line (us, % of copy, speed-up over the first key, max rel diff vs the
    reference)."""
    from decode_roofline import environment

    from tierlm.kernels.fused_moe import naive
    from tierlm.kernels.fused_moe import triton as kernels

    w_gate_up, w_down, kw, per_expert = experts
    shape, device = run.shape, run.device
    x = [torch.randn(batch, shape["hidden"], generator=run.gen, device=device).to(torch.bfloat16)
         for _ in range(ROUTINGS)]
    routes = routings(batch, shape, device, run.gen)
    nbytes = sum(torch.unique(ids).numel() for _, ids in routes) / ROUTINGS * per_expert
    cells = {}
    for key in keys:
        env, recorded = configure(key)
        with environment(env):
            seconds = timed(lambda i: kernels.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw), ROUTINGS, device,
                            run.use_graph)
            diff = max(rel_diff(kernels.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw),
                                naive.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw)) for i in range(ROUTINGS))
        cells[key] = {"us": seconds * 1e6, "vs_copy": nbytes / seconds / run.copy, "max_rel_diff": diff, **recorded}
    first = cells[keys[0]]["us"]
    print(f"{label:>10}{batch:>6}{nbytes / 1e6:>9.2f}  " + "  ".join(
        f"{c['us']:>10.1f}{c['vs_copy']:>7.1%}{first / c['us']:>7.2f}x{c['max_rel_diff']:>9.1e}" for c in cells.values()))
    return cells, nbytes


def measure_packed_variants(run: SimpleNamespace, experts: tuple, label: str, batch: int, specs: list[str]) -> dict:
    """--packed-variants: one INT4 format at one batch size, the routed experts under each variant spec
    (NAME[:FIELD=VALUE,...], fields of the variant's PackedDecodeTiles, or early=0 / early=1: its weights
    loaded after its wait (TIERLM_NO_EARLY_EXPERT_WEIGHTS=1) / before it at any group size; without it, as
    `packed_decode` chooses by group) on the same inputs; prints one line, returns the row."""
    from tierlm.kernels.fused_moe import packed_decode
    from tierlm.kernels.fused_moe import triton as kernels

    saved = {"v1": kernels.DECODE_TILES[4], "v2": kernels.PACKED_V2_TILES}
    saved_min_group = packed_decode.PACKED_V2_EARLY_MIN_GROUP

    def configure(spec: str) -> tuple[dict, dict]:
        name, _, fields = spec.partition(":")
        fields = {field: int(value) for field, value in (item.split("=") for item in fields.split(",") if item)}
        early = fields.pop("early", None)  # (None: as the kernels choose by group; 1: at every group; 0: off)
        packed_decode.PACKED_V2_EARLY_MIN_GROUP = saved_min_group if early is None else 0
        tiles = saved[name]._replace(**fields)
        kernels.DECODE_TILES[4], kernels.PACKED_V2_TILES = saved["v1"], saved["v2"]
        if name == "v2":
            kernels.PACKED_V2_TILES = tiles
        else:
            kernels.DECODE_TILES[4] = tiles
        env = {"TIERLM_PACKED_MOE_VARIANT": name, "TIERLM_NO_EARLY_EXPERT_WEIGHTS": "1" if early == 0 else None}
        return env, {"tiles": tiles._asdict()}

    try:
        cells, nbytes = time_side_by_side(run, experts, label, batch, specs, configure)
    finally:
        kernels.DECODE_TILES[4], kernels.PACKED_V2_TILES = saved["v1"], saved["v2"]
        packed_decode.PACKED_V2_EARLY_MIN_GROUP = saved_min_group
    return {"format": label, "batch": batch, "weight_bytes_per_call": nbytes, "variants": cells}


def measure_early_tiles(run: SimpleNamespace, experts: tuple, label: str, batch: int, counts: list[int]) -> dict:
    """--early-down-tiles: the bf16 decode form at one batch size with down's first N tiles loaded before its
    wait (fused_moe.triton.EARLY_DOWN_TILES; 0: early weights off, TIERLM_NO_EARLY_EXPERT_WEIGHTS=1) for each
    N, on the same inputs; prints one line, returns the row."""
    from tierlm.kernels.fused_moe import triton as kernels

    saved = kernels.EARLY_DOWN_TILES

    def configure(count: int) -> tuple[dict, dict]:
        kernels.EARLY_DOWN_TILES = count
        return {"TIERLM_NO_EARLY_EXPERT_WEIGHTS": None if count else "1"}, {}

    try:
        cells, nbytes = time_side_by_side(run, experts, label, batch, counts, configure)
    finally:
        kernels.EARLY_DOWN_TILES = saved
    return {"format": label, "batch": batch, "weight_bytes_per_call": nbytes,
            "early_down_tiles": {str(count): cell for count, cell in cells.items()}}


def make_shared_expert(shape: dict, fmt: str, group: int | None, device: torch.device, gen: torch.Generator):
    """(the model's SwiGLU shared expert of width `shared` with random weights: bf16 beside bf16 experts,
    INT6 with the experts' group beside INT4 ones, as int4-mixed quantizes it; its weight bytes)."""
    from tierlm.kernels.quant_linear.packing import packed_width
    from tierlm.model.layers.moe import SwiGLU
    from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

    h, s = shape["hidden"], shape["shared"]
    swiglu = SwiGLU(h, s)
    if fmt != "bf16":
        for layer in (swiglu.gate_up, swiglu.down_proj):
            layer.set_format(PackQuantizedFormat(6, group))
    swiglu = swiglu.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in (swiglu.gate_up, swiglu.down_proj):
            n, k = layer.out_features, layer.in_features
            if fmt == "bf16":
                layer.weight.copy_(torch.randn(n, k, generator=gen, device=device) * k**-0.5)
            else:
                layer.weight_packed.copy_(torch.randint(-2**31, 2**31 - 1, (n, packed_width(k, 6)), generator=gen,
                                                        device=device, dtype=torch.int32))
                layer.weight_scale.copy_(torch.rand(n, k // group, generator=gen, device=device) * 0.01 / k**0.5)
    nbytes = sum(t.numel() * t.element_size() for t in swiglu.parameters())
    return swiglu, nbytes


def measure_shared(run: SimpleNamespace, experts: tuple, label: str, batch: int, swiglu, shared_bytes: int) -> dict:
    """--shared: the MoE block's experts + shared expert at one batch size, as the model ran them before
    (the routed kernel, then the shared SwiGLU through its layers: cuBLAS or the INT6 GEMV, SiLU, mul, the
    gate's product and the add) and fused (the shared expert one more expert in the routed launches);
    % of copy bandwidth on the distinct routed experts' bytes plus the shared expert's."""
    from tierlm.kernels.fused_moe import naive
    from tierlm.kernels.fused_moe import triton as kernels

    w_gate_up, w_down, kw, per_expert = experts
    shape, device = run.shape, run.device
    x = [torch.randn(batch, shape["hidden"], generator=run.gen, device=device).to(torch.bfloat16)
         for _ in range(ROUTINGS)]
    gates = [torch.sigmoid(torch.randn(batch, 1, generator=run.gen, device=device)).to(torch.bfloat16)
             for _ in range(ROUTINGS)]
    routes = routings(batch, shape, device, run.gen)
    nbytes = sum(torch.unique(ids).numel() for _, ids in routes) / ROUTINGS * per_expert + shared_bytes

    def apart(i: int) -> torch.Tensor:
        routed = kernels.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw)
        return routed + gates[i] * swiglu(x[i])

    def fused(i: int) -> torch.Tensor:
        return kernels.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw, shared=swiglu.as_fused_expert(gates[i]))

    saved_apart = kernels.PACKED_SHARED_APART_TOKENS
    kernels.PACKED_SHARED_APART_TOKENS = range(0)  # fused at every batch size (restored once timed)

    bits = 0 if not kw else int(kw["format"][3:])
    if run.packed_best is not None and (label, batch) in run.packed_best:  # the routed tiles --packed-sweep chose
        kernels.DECODE_TILES[bits] = run.packed_best[label, batch]._replace(
            **{name: getattr(kernels.DECODE_TILES[bits], name) for name in ("shared_gate_up_block_k",
                                                                            "shared_down_block_k")})
    if run.shared_sweep and batch == run.sweep_batch:
        best = None
        for gate_up_k, down_k in SHARED_SWEEP[bits]:
            kernels.DECODE_TILES[bits] = kernels.DECODE_TILES[bits]._replace(shared_gate_up_block_k=gate_up_k,
                                                                             shared_down_block_k=down_k)
            seconds = timed(fused, ROUTINGS, device, run.use_graph)
            print(f"{label:>10}{batch:>6}  shared K tiles {gate_up_k} / {down_k}: {seconds * 1e6:.1f} us, "
                  f"{nbytes / seconds / run.copy:.1%} of copy")
            if best is None or seconds < best[0]:
                best = (seconds, gate_up_k, down_k)
        kernels.DECODE_TILES[bits] = kernels.DECODE_TILES[bits]._replace(shared_gate_up_block_k=best[1],
                                                                         shared_down_block_k=best[2])
    tiles = kernels.DECODE_TILES[bits]
    apart_s = timed(apart, ROUTINGS, device, run.use_graph)
    fused_s = timed(fused, ROUTINGS, device, run.use_graph)
    kernels.PACKED_SHARED_APART_TOKENS = saved_apart
    fused_diff = apart_diff = 0.0
    for i in range(ROUTINGS):  # apart: the model's path before, for scale (its own bf16 roundings)
        ref = naive.fused_moe(x[i], w_gate_up, w_down, *routes[i], **kw, shared=swiglu.as_fused_expert(gates[i]))
        fused_diff = max(fused_diff, rel_diff(fused(i), ref))
        apart_diff = max(apart_diff, rel_diff(apart(i), ref))
    row = {"format": label, "batch": batch, "shared_bytes": shared_bytes, "weight_bytes_per_call": nbytes,
           "apart_us": apart_s * 1e6, "apart_vs_copy": nbytes / apart_s / run.copy, "fused_us": fused_s * 1e6,
           "fused_vs_copy": nbytes / fused_s / run.copy, "apart_over_fused": apart_s / fused_s,
           "fused_max_rel_diff": fused_diff, "apart_max_rel_diff": apart_diff, "tiles": tiles._asdict()}
    print(f"{label:>10}{batch:>6}{nbytes / 1e6:>9.2f}{apart_s * 1e6:>11.1f}{row['apart_vs_copy']:>8.1%}"
          f"{fused_s * 1e6:>11.1f}{row['fused_vs_copy']:>8.1%}{apart_s / fused_s:>9.2f}x"
          f"{fused_diff:>12.2e}{apart_diff:>12.2e}")
    return row


def measure(args, device: torch.device) -> dict:
    global ROUTINGS
    shape = SMALL if args.small else TARGET
    if device.type == "cpu":
        ROUTINGS = 2
    gen = torch.Generator(device=device).manual_seed(0)
    copy = copy_bandwidth(device, args.copy_bytes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    use_graph = device.type == "cuda" and not args.no_graph
    run = SimpleNamespace(shape=shape, device=device, gen=gen, copy=copy, use_graph=use_graph, sweep=args.sweep,
                          no_reference=args.no_reference, baseline=None, sweep_batch=args.batches[0],
                          packed_best={} if args.packed_sweep else None, bf16_share={},
                          shared_sweep=args.shared_sweep, copy_floor=args.copy_floor, phases=args.phases)
    if args.baseline is not None:
        from kernel_baseline import load_baseline

        run.baseline = load_baseline(args.baseline, "fused_moe")
    if args.packed_sweep and device.type == "cuda" and args.compile_workers > 1:
        precompile_packed(shape, args.compile_workers, device)
    print(f"device: {name}; copy bandwidth {copy / 1e9:.1f} GB/s (read + write)")
    print(f"shapes: {shape}; each call one of {ROUTINGS} routings; GB/s on the distinct experts' weight bytes")
    if not args.shared_only and not args.packed_variants and not args.early_down_tiles:
        print(f"{'format':>10}{'batch':>6}{'path':>8}{'experts':>8}{'MB/call':>9}{'kernel us':>11}{'GB/s':>8}"
              f"{'of copy':>8}{'before us':>11}{'of copy':>8}{'speed-up':>9}{'ref us':>10}{'ref/kern':>9}{'gathered us':>12}{'gath/kern':>10}{'max rel diff':>13}")
    rows, sweeps, shared_rows, variant_rows = [], [], [], []
    for fmt, group in (("bf16", None), *(("int4", g) for g in shape["groups"])):
        if args.formats and (fmt if group is None else f"{fmt}-g{group}") not in args.formats:
            continue
        w_gate_up, w_down, scales, per_expert = make_experts(shape, fmt, group, device, gen)
        kw = {} if scales is None else {"format": "int4", "scales": scales, "group_size": group}
        label = fmt if group is None else f"{fmt}-g{group}"
        if args.packed_sweep and fmt == "int4":
            sweeps += sweep_packed(run, (w_gate_up, w_down, kw, per_expert), label, args.batches)
        if args.packed_variants and fmt == "int4":
            print(f"{label}: the packed decode form's variants (us, % of copy, speed-up over {args.packed_variants[0]}, "
                  "max rel diff)")
            print(f"{'format':>10}{'batch':>6}{'MB/call':>9}  " + "  ".join(f"{spec:>33}" for spec in args.packed_variants))
            variant_rows += [measure_packed_variants(run, (w_gate_up, w_down, kw, per_expert), label, batch,
                                                     args.packed_variants) for batch in args.batches]
        if args.early_down_tiles and fmt == "bf16":
            print(f"{label}: down's first tiles loaded before its wait (us, % of copy, speed-up over "
                  f"{args.early_down_tiles[0]}, max rel diff)")
            print(f"{'format':>10}{'batch':>6}{'MB/call':>9}  " + "  ".join(
                f"{f'{count} tiles':>33}" for count in args.early_down_tiles))
            variant_rows += [measure_early_tiles(run, (w_gate_up, w_down, kw, per_expert), label, batch,
                                                 args.early_down_tiles) for batch in args.batches]
        if not args.shared_only and not args.packed_variants and not args.early_down_tiles:
            rows += [measure_batch(run, (w_gate_up, w_down, kw, per_expert), label, batch) for batch in args.batches]
        if fmt == "bf16":
            run.bf16_share = {row["batch"]: row["kernel_vs_copy"] for row in rows}
        if args.shared or args.shared_only:
            swiglu, shared_bytes = make_shared_expert(shape, fmt, group, device, gen)
            print(f"{label}: experts + shared expert ({'bf16' if fmt == 'bf16' else f'int6-g{group}'}, "
                  f"{shared_bytes / 1e6:.2f} MB) apart (before) and fused; "
                  "max rel diff vs the torch reference")
            print(f"{'format':>10}{'batch':>6}{'MB/call':>9}{'apart us':>11}{'of copy':>8}{'fused us':>11}"
                  f"{'of copy':>8}{'speed-up':>10}{'fused diff':>12}{'apart diff':>12}")
            shared_rows += [measure_shared(run, (w_gate_up, w_down, kw, per_expert), label, batch, swiglu,
                                           shared_bytes) for batch in args.batches]
            wins = [row["batch"] for row in shared_rows if row["format"] == label and row["apart_over_fused"] > 1]
            losses = [row["batch"] for row in shared_rows if row["format"] == label and row["apart_over_fused"] <= 1]
            print(f"{label}: fused beats apart at batches {wins or 'none'}, loses at {losses or 'none'} "
                  "(fused_moe.triton.PACKED_SHARED_APART_TOKENS)")
            swiglu = None
        w_gate_up = w_down = scales = kw = None  # free this format's experts before the next one's
    from tierlm.kernels.fused_moe import triton as kernels

    return {"device": name, "copy_bandwidth_GBps": copy / 1e9, "shapes": shape, "routings_per_timing": ROUTINGS,
            "cuda_graph": use_graph, "torch": torch.__version__, "decode_max_pairs": kernels.DECODE_MAX_PAIRS,
            "grouped_block_m": kernels.PREFILL_BLOCK_M, "rows": rows, "packed_sweep": sweeps,
            "shared_rows": shared_rows, "packed_variant_rows": variant_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes; on a CPU, through Triton's interpreter")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sweep", nargs="*", default=None, metavar="FORMAT",
                        help="also sweep the tile sizes (best one kept and reported), of these formats (none named: all)")
    parser.add_argument("--packed-sweep", action="store_true",
                        help="sweep the INT4 decode tiles phase by phase at every batch size; rows use the best")
    parser.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="--packed-sweep on CUDA: processes compiling the candidates first (1: none)")
    parser.add_argument("--shared", action="store_true",
                        help="also time the experts with the shared expert, apart (before) and fused, side by side")
    parser.add_argument("--shared-only", action="store_true", help="--shared without the routed-only rows")
    parser.add_argument("--shared-sweep", action="store_true",
                        help="with --shared: sweep the shared expert's K tiles (SHARED_SWEEP) at the first batch size")
    parser.add_argument("--packed-variants", nargs="+", default=None, metavar="SPEC",
                        help="time the INT4 decode form under each TIERLM_PACKED_MOE_VARIANT, NAME or "
                             "NAME:GATE_UP_CHUNKS,DOWN_CHUNKS, side by side (the first is the baseline)")
    parser.add_argument("--early-down-tiles", type=int, nargs="+", default=None, metavar="N",
                        help="time the bf16 decode form with down's first N tiles loaded before its wait, for each "
                             "N (0: early weights off), side by side (the first is the baseline)")
    parser.add_argument("--copy-floor", action="store_true",
                        help="also time the copy kernel moving each decode row's bytes, in one launch and in the "
                             "two launches' shares (what a small read reaches at all), beside the kernel")
    parser.add_argument("--phases", action="store_true",
                        help="also time each launch of a call alone (eager, PDL off, profiled; CUDA only)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip timing the torch reference (outputs are still checked against it)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                        help="also time ROOT's fused_moe kernels (another checkout: before/after in one run)")
    parser.add_argument("--formats", nargs="+", default=None, help="subset of bf16, int4-g32, int4-g128, ...")
    parser.add_argument("--no-graph", action="store_true", help="time eager launches, not a CUDA graph replay")
    parser.add_argument("--decode-max-pairs", type=int, default=None,
                        help="override fused_moe's DECODE_MAX_PAIRS (one-pair blocks up to this many pairs)")
    parser.add_argument("--grouped-block-m", type=int, default=None,
                        help="override fused_moe's PREFILL_BLOCK_M (rows per expert block, >= 16)")
    parser.add_argument("--copy-bytes", type=int, default=None, help="size of the copy-bandwidth tensor")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.small:
            parser.error("no CUDA device: run with --small (Triton's interpreter, tiny shapes)")
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module first imports triton
        torch.set_num_threads(1)
    from tierlm.kernels.fused_moe import triton as kernels

    if args.decode_max_pairs is not None:
        kernels.DECODE_MAX_PAIRS = args.decode_max_pairs
    if args.grouped_block_m is not None:
        kernels.PREFILL_BLOCK_M = args.grouped_block_m
    if args.copy_bytes is None:
        args.copy_bytes = 2 << 30 if device.type == "cuda" else 64 << 20
    result = measure(args, device)
    slug = re.sub(r"[^a-z0-9]+", "_", result["device"].lower()).strip("_")
    out = args.out or Path(__file__).parent / "results" / f"moe_decode_kernel_{slug}{'_small' if args.small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
