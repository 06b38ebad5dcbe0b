"""QSA decode selection at the target model's shapes, torch vs fused, side by side (GPU).

The indexer's part of a static decode step after its projection: block scores of each request's visible
compressed keys (8 heads x 128, ratio 4), then its top budget / R = 512 blocks and their K/V rows (2,051
entries). Per context (the batch's block-table width follows it, as `static_decode` sizes it) and batch:
  - torch: the scores kernel, then `kernels/qsa_selection.naive` (ranking keys, torch.topk, a sort of the
    512 chosen into block order, positions, rows): what TIERLM_NO_FUSED_QSA_SELECT=1 runs;
  - fused: the scores kernel (requests that see <= 512 blocks skipped; no launch at all where the table
    holds <= 512 blocks), then the rows kernel's radix select (`kernels/qsa_selection.triton`), at every
    context (the layer takes it up to the kernel module's MAX_GROUPS blocks: set it where torch wins);
each replayed from a CUDA graph; checks the two give the same rows bit for bit; prints microseconds per
step, the ratio and kernels per step, and saves them to bench/results/qsa_decode_select_<device>.txt.
`--sweep` times the rows kernel alone for each candidate (BLOCK_G, SELECT_WARPS) at the long contexts
and prints the fastest per context (each checked; saved to ..._sweep_<device>.txt). `--baseline ROOT` also
times the fused path with ROOT's rows kernel (another checkout, or a copy of its
tierlm/kernels/qsa_selection/triton.py, e.g. from `git show`): before and after in one run, each checked.

    python bench/qsa_decode_select.py
    python bench/qsa_decode_select.py --sweep
    python bench/qsa_decode_select.py --baseline ../main
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from device_timing import device_label, kernels_per_call, timed

import tierlm.kernels.qsa_selection.triton as kernels
from tierlm.kernels.qsa_block_scores.triton import triton_block_scores
from tierlm.kernels.qsa_selection import selection_rows

HEADS, DIM, RATIO, TOP, BLOCK_SIZE = 8, 128, 4, 512, 16


def workload(context: int, batch: int, device) -> tuple:
    """Requests at positions up to `context` (the longest exactly there), each over its own shuffled
    blocks; the table width the next power of two of blocks, as static decode doubles it."""
    gen = torch.Generator().manual_seed(context + batch)
    width = 1 << (context // BLOCK_SIZE).bit_length()  # >= the blocks the longest request holds
    positions = torch.randint(context // 2, context, (batch,), generator=gen)
    positions[0] = context - 1
    blocks = batch * width + 1
    tables = torch.randperm(blocks - 1, generator=gen)[: batch * width].view(batch, width)
    keys = torch.randn(blocks, BLOCK_SIZE // RATIO, DIM, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(torch.bfloat16)
    return tuple(t.to(device) for t in (q, keys, tables, positions)) + (blocks - 1,)


def torch_path(q, keys, tables, positions, scratch):
    scores = triton_block_scores(q, keys, tables, positions, RATIO)
    return selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)


def fused_path(q, keys, tables, positions, scratch, rows_kernel=kernels):
    scores = None
    if tables.shape[1] * (BLOCK_SIZE // RATIO) > TOP:
        scores = triton_block_scores(q, keys, tables, positions, RATIO, skip_up_to=TOP)
    return rows_kernel.triton_selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)


def measure(work: tuple, device, baseline=None) -> tuple[float, float, float | None, str]:
    """(torch seconds, fused seconds, fused seconds with the baseline's rows kernel or None, 'kernels
    torch->fused') of one step on `work`, each checked equal to the torch path."""
    expected = torch_path(*work)
    for rows_kernel in (kernels, baseline) if baseline is not None else (kernels,):
        got = fused_path(*work, rows_kernel=rows_kernel)
        if not (torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])):
            raise SystemExit(f"the fused rows ({rows_kernel.__name__}) differ from the torch path's")
    slow = timed(lambda i: torch_path(*work), 20, device)
    fast = timed(lambda i: fused_path(*work), 20, device)
    before = None if baseline is None else timed(lambda i: fused_path(*work, rows_kernel=baseline), 20, device)
    return slow, fast, before, (f"{kernels_per_call(lambda: torch_path(*work))}->"
                                f"{kernels_per_call(lambda: fused_path(*work))}")


def compare(contexts, batches, device, baseline=None) -> list[str]:
    lines = [f"{'ctx':>7} {'batch':>5} {'torch us':>9} {'fused us':>9} {'speedup':>8} {'kernels':>9}"
             + ("" if baseline is None else f" {'before us':>10} {'after/before':>13}")]
    print(lines[0])
    for context, batch in itertools.product(contexts, batches):
        slow, fast, before, counts = measure(workload(context, batch, device), device, baseline)
        lines.append(f"{context:>7} {batch:>5} {1e6 * slow:>9.1f} {1e6 * fast:>9.1f} {slow / fast:>7.2f}x {counts:>9}"
                     + ("" if before is None else f" {1e6 * before:>10.1f} {before / fast:>12.2f}x"))
        print(lines[-1])
    return lines


def sweep(contexts, batches, device) -> list[str]:
    defaults = kernels.BLOCK_G, kernels.SELECT_WARPS
    lines = []
    for context, batch in itertools.product(contexts, batches):
        q, keys, tables, positions, scratch = workload(context, batch, device)
        scores = triton_block_scores(q, keys, tables, positions, RATIO)
        expected = selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)
        results = []
        for block_g, warps in itertools.product((512, 1024, 2048, 4096), (4, 8, 16)):
            kernels.BLOCK_G, kernels.SELECT_WARPS = block_g, warps
            args = (scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)
            got = kernels.triton_selection_rows(*args)
            if not (torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])):
                raise SystemExit(f"BLOCK_G {block_g} warps {warps}: rows differ")
            results.append((timed(lambda i, args=args: kernels.triton_selection_rows(*args), 20, device), block_g, warps))
        best = min(results)
        default = next(r for r in results if r[1:] == defaults)
        lines.append(f"ctx {context:>7} batch {batch:>2}: best BLOCK_G {best[1]} warps {best[2]} {1e6 * best[0]:.1f} us "
                     f"(default {1e6 * default[0]:.1f} us)")
        print(lines[-1])
    kernels.BLOCK_G, kernels.SELECT_WARPS = defaults
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768, 131072, 262144])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sweep", action="store_true", help="the rows kernel's tile and warps (see above)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                        help="also time ROOT's rows kernel (a checkout, or a copy of its qsa_selection/triton.py)")
    args = parser.parse_args()
    if args.sweep and args.baseline is not None:
        parser.error("--baseline times the fused path: give it without --sweep")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    head = (f"{torch.cuda.get_device_name(device)}: indexer {HEADS} x {DIM}, ratio {RATIO}, top {TOP} blocks, "
            f"us per step replayed from CUDA graphs; rows kernel tiles BLOCK_G {kernels.BLOCK_G}, "
            f"{kernels.SELECT_WARPS} warps")
    print(head)
    if args.sweep:
        lines, name = sweep([c for c in args.contexts if c // RATIO > TOP], args.batches, device), "_sweep"
    else:
        baseline = None
        if args.baseline is not None:
            from kernel_baseline import load_baseline_module

            baseline = load_baseline_module(args.baseline, "tierlm/kernels/qsa_selection/triton.py")
        lines, name = compare(args.contexts, args.batches, device, baseline), ""
    path = Path(__file__).parent / "results" / f"qsa_decode_select{name}_{device_label(device)}.txt"
    path.write_text("\n".join([head, *lines]) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
