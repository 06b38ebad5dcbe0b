"""QSA decode selection at the target model's shapes, torch vs fused, side by side (GPU).

The indexer's part of a static decode step after its projection: block scores of each request's visible
compressed keys (8 heads x 128, ratio 4), then its top budget / R = 512 blocks and their K/V rows (2,051
entries). Per context (the batch's block-table width follows it, as `static_decode` sizes it) and batch:
  - torch: the scores kernel, then `kernels/qsa_selection.naive` (ranking keys, torch.topk, a sort of the
    512 chosen into block order, positions, rows): what TIERLM_NO_FUSED_QSA_SELECT=1 runs;
  - fused: the scores kernel (requests that see <= 512 blocks skipped; no launch at all where the table
    holds <= 512 blocks), then the rows kernels' radix select (`kernels/qsa_selection.triton`) in each
    form: "one" (one program a query), "split" (`split_triton`: each query's select over many programs, a
    few launches) and "auto" (the form the layer takes: split for tables wider than SPLIT_FROM_GROUPS
    blocks; set it where the one/split ratio crosses 1);
each replayed from a CUDA graph; checks they all give the torch path's rows bit for bit; prints
microseconds per step, the ratios and kernels per step, and saves them to
bench/results/qsa_decode_select_<device>.txt. `--sweep` times the one-program form alone for each
candidate (BLOCK_G, SELECT_WARPS) at the long contexts, `--sweep-split` the split form for each (CHUNK,
DIGIT_BITS, SPLIT_WARPS), and print the fastest per context (each checked; saved to
..._sweep[_split]_<device>.txt). `--baseline ROOT` also times what ROOT's layer ran (another checkout,
or a folder holding copies of its tierlm/kernels/qsa_block_scores/triton.py and qsa_selection/triton.py,
e.g. from `git show`): its scores kernel, then its rows kernel, or the torch selection past its
MAX_GROUPS blocks where it had one; before and after in one run, each checked.

    python bench/qsa_decode_select.py
    python bench/qsa_decode_select.py --sweep --sweep-split
    python bench/qsa_decode_select.py --baseline ../main
"""

from __future__ import annotations

import argparse
import itertools
from contextlib import contextmanager
from pathlib import Path

import torch
from device_timing import device_label, kernels_per_call, timed

import tierlm.kernels.qsa_selection.split_triton as split
import tierlm.kernels.qsa_selection.triton as kernels
from tierlm.kernels.qsa_block_scores.triton import triton_block_scores
from tierlm.kernels.qsa_selection import selection_rows

HEADS, DIM, RATIO, TOP, BLOCK_SIZE = 8, 128, 4, 512, 16
FORMS = ("one", "split", "auto")


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


def fused_path(q, keys, tables, positions, scratch):
    scores = None
    if tables.shape[1] * (BLOCK_SIZE // RATIO) > TOP:
        scores = triton_block_scores(q, keys, tables, positions, RATIO, skip_up_to=TOP)
    return kernels.triton_selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)


def before_path(baseline, q, keys, tables, positions, scratch):
    """What the baseline's layer ran: its scores kernel, then its rows kernel, or the torch selection
    past its rows kernel's MAX_GROUPS blocks (where it had one)."""
    scores_kernel, rows_kernel = baseline
    groups = tables.shape[1] * (BLOCK_SIZE // RATIO)
    if groups > getattr(rows_kernel, "MAX_GROUPS", groups):
        scores = scores_kernel.triton_block_scores(q, keys, tables, positions, RATIO)
        return selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)
    scores = None
    if groups > TOP:
        scores = scores_kernel.triton_block_scores(q, keys, tables, positions, RATIO, skip_up_to=TOP)
    return rows_kernel.triton_selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)


@contextmanager
def select_form(form: str):
    """The rows kernel's form for every width: "one" (a program a query), "split" (`split_triton`), or
    "auto" (the module's SPLIT_FROM_GROUPS)."""
    saved = kernels.SPLIT_FROM_GROUPS
    kernels.SPLIT_FROM_GROUPS = {"one": 1 << 40, "split": 0, "auto": saved}[form]
    try:
        yield
    finally:
        kernels.SPLIT_FROM_GROUPS = saved


def same_rows(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def measure(work: tuple, device, baseline=None) -> tuple[dict, str]:
    """Seconds per step of each path on `work` (torch, one, split, auto, and before: the baseline's layer,
    `before_path`), each checked equal to the torch path, and 'kernels torch->auto'."""
    expected = torch_path(*work)
    times = {"torch": timed(lambda i: torch_path(*work), 20, device)}
    for form in FORMS:
        with select_form(form):
            if not same_rows(expected, fused_path(*work)):
                raise SystemExit(f"the {form} rows differ from the torch path's")
            times[form] = timed(lambda i: fused_path(*work), 20, device)
    if baseline is not None:
        if not same_rows(expected, before_path(baseline, *work)):
            raise SystemExit("the baseline's rows differ from the torch path's")
        times["before"] = timed(lambda i: before_path(baseline, *work), 20, device)
    return times, f"{kernels_per_call(lambda: torch_path(*work))}->{kernels_per_call(lambda: fused_path(*work))}"


def compare(contexts, batches, device, baseline=None) -> list[str]:
    lines = [f"{'ctx':>7} {'batch':>5} {'torch us':>9} {'one us':>8} {'split us':>9} {'auto us':>8} {'torch/auto':>11} "
             f"{'one/split':>10} {'kernels':>9}" + ("" if baseline is None else f" {'before us':>10} {'before/auto':>12}")]
    print(lines[0])
    for context, batch in itertools.product(contexts, batches):
        t, counts = measure(workload(context, batch, device), device, baseline)
        us = {name: 1e6 * value for name, value in t.items()}
        lines.append(f"{context:>7} {batch:>5} {us['torch']:>9.1f} {us['one']:>8.1f} {us['split']:>9.1f} "
                     f"{us['auto']:>8.1f} {t['torch'] / t['auto']:>10.2f}x {t['one'] / t['split']:>9.2f}x {counts:>9}"
                     + ("" if baseline is None else f" {us['before']:>10.1f} {t['before'] / t['auto']:>11.2f}x"))
        print(lines[-1])
    return lines


def sweep(contexts, batches, device) -> list[str]:
    """The one-program form's (BLOCK_G, SELECT_WARPS)."""
    return _sweep(contexts, batches, device, "one", kernels, ("BLOCK_G", "SELECT_WARPS"),
                  itertools.product((512, 1024, 2048, 4096), (4, 8, 16)))


def sweep_split(contexts, batches, device) -> list[str]:
    """The split form's (CHUNK, DIGIT_BITS, SPLIT_WARPS)."""
    return _sweep(contexts, batches, device, "split", split, ("CHUNK", "DIGIT_BITS", "SPLIT_WARPS"),
                  itertools.product((512, 1024, 2048, 4096), (8, 11), (4, 8)))


def _sweep(contexts, batches, device, form: str, module, names: tuple[str, ...], candidates) -> list[str]:
    candidates = list(candidates)
    defaults = tuple(getattr(module, name) for name in names)
    lines = []
    for context, batch in itertools.product(contexts, batches):
        q, keys, tables, positions, scratch = workload(context, batch, device)
        scores = triton_block_scores(q, keys, tables, positions, RATIO)
        args = (scores, positions, tables, RATIO, BLOCK_SIZE, scratch, TOP)
        expected = selection_rows(*args)
        results = []
        try:
            with select_form(form):
                for values in candidates:
                    for name, value in zip(names, values):
                        setattr(module, name, value)
                    if not same_rows(kernels.triton_selection_rows(*args), expected):
                        raise SystemExit(f"{dict(zip(names, values))}: rows differ")
                    results.append((timed(lambda i, args=args: kernels.triton_selection_rows(*args), 20, device), values))
        finally:
            for name, value in zip(names, defaults):
                setattr(module, name, value)
        best = min(results)
        default = next(r for r in results if r[1] == defaults)
        lines.append(f"{form} ctx {context:>7} batch {batch:>2}: best {dict(zip(names, best[1]))} "
                     f"{1e6 * best[0]:.1f} us (default {1e6 * default[0]:.1f} us)")
        print(lines[-1])
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768, 131072, 262144])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sweep", action="store_true", help="the one-program form's tile and warps (see above)")
    parser.add_argument("--sweep-split", action="store_true", help="the split form's chunk, digit and warps")
    parser.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                        help="also time ROOT's layer: its scores and rows kernels (see above)")
    args = parser.parse_args()
    if (args.sweep or args.sweep_split) and args.baseline is not None:
        parser.error("--baseline times the fused path: give it without a sweep")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    head = (f"{torch.cuda.get_device_name(device)}: indexer {HEADS} x {DIM}, ratio {RATIO}, top {TOP} blocks, "
            f"us per step replayed from CUDA graphs; one-program tiles BLOCK_G {kernels.BLOCK_G}, "
            f"{kernels.SELECT_WARPS} warps; split: CHUNK {split.CHUNK}, DIGIT_BITS {split.DIGIT_BITS}, "
            f"{split.SPLIT_WARPS} warps, from {kernels.SPLIT_FROM_GROUPS} blocks")
    print(head)
    long_contexts = [c for c in args.contexts if c // RATIO > TOP]
    if args.sweep or args.sweep_split:
        lines, name = [], "_sweep" + ("_split" if not args.sweep else "")
        if args.sweep:
            lines += sweep(long_contexts, args.batches, device)
        if args.sweep_split:
            lines += sweep_split(long_contexts, args.batches, device)
    else:
        baseline = None
        if args.baseline is not None:
            from kernel_baseline import load_baseline_module

            baseline = tuple(load_baseline_module(args.baseline, f"tierlm/kernels/{op}/triton.py")
                             for op in ("qsa_block_scores", "qsa_selection"))
        lines, name = compare(args.contexts, args.batches, device, baseline), ""
    path = Path(__file__).parent / "results" / f"qsa_decode_select{name}_{device_label(device)}.txt"
    path.write_text("\n".join([head, *lines]) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
