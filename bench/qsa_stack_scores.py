"""What the QSA selection sees in the real-width decode stack (decode_roofline.py's model and caches), GPU.

One eager decode step at --context with the rows kernel's inputs recorded: the indexer's score row (seen
scores, distinct values, zeros, the K-th value and its ties), the radix passes the kernel takes on it (it
stops once no tie is left to break), and the rows kernel timed on that row and on qsa_decode_select.py's
random row of the same context, side by side (CUDA graphs). Written when the stack's selection listed 25.8 us
at ctx 8192 against 13.3 us in its own bench; an earlier probe of this kind found the stack's caches all zero
(every score 0.0: all ties).

    cd bench && python qsa_stack_scores.py --context 8192
"""

from __future__ import annotations

import argparse

import torch
from decode_roofline import DecodeSetup, build_model, real_width_config
from device_timing import timed
from qsa_decode_select import BLOCK_SIZE, RATIO, TOP, workload

import tierlm.kernels.qsa_selection.triton as selection
from tierlm.config import ModelConfig
from tierlm.kernels.qsa_block_scores.triton import triton_block_scores


def radix_passes(row: torch.Tensor, top: int) -> int:
    """How many 4-bit passes the rows kernel's select takes on these scores (its early stop included)."""
    bits = (row.view(torch.int32) & 0x7FFFFFFF).long()
    threshold = 0
    for count, shift in enumerate(range(28, -1, -4), start=1):
        at_or_above = torch.stack([((bits >> shift) >= (threshold >> shift) + d).sum() for d in range(16)])
        digit = int((at_or_above >= top).sum()) - 1
        threshold += digit << shift
        if int(at_or_above[digit]) == top:
            break
    return count


def describe(name: str, scores: torch.Tensor, positions: torch.Tensor, top: int) -> None:
    seen = min(int(positions[0] + 1) // RATIO, scores.shape[1])
    row = scores[0, :seen].float().cpu()
    kth = row.sort(descending=True).values[top - 1]
    print(f"{name}: row of {scores.shape[1]}, {seen} seen, {row.unique().numel()} distinct, "
          f"{int((row == 0).sum())} zero, range {float(row.min()):.3g}..{float(row.max()):.3g}, K-th {float(kth):.3g} "
          f"({int((row == kth).sum())} at it), {radix_passes(row, top)} radix passes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = ModelConfig.from_dict(real_width_config(4, False))
    setup = DecodeSetup(build_model(config, dtype, device), config, dtype, device, 1, args.context, 10)
    runner = setup.capture("eager")
    calls, plain = [], selection.triton_selection_rows

    def recording(*call):
        calls.append([a.clone() if isinstance(a, torch.Tensor) else a for a in call])
        return plain(*call)

    selection.triton_selection_rows = recording
    try:
        runner.run_decode(*setup.inputs_at(0))
        torch.cuda.synchronize()
    finally:
        selection.triton_selection_rows = plain
    recorded = [call for call in calls if call[0] is not None]
    if not recorded:
        raise SystemExit(f"ctx {args.context}: the step selected every block (no scores): take a longer context")
    scores, positions, tables, ratio, block_size, scratch, top = recorded[0]
    describe("stack", scores, positions, top)
    stack_s = timed(lambda i: plain(scores, positions, tables, ratio, block_size, scratch, top), 20, device)
    q, keys, bench_tables, bench_positions, bench_scratch = workload(args.context, 1, device)
    bench_scores = triton_block_scores(q, keys, bench_tables, bench_positions, RATIO, skip_up_to=TOP)
    describe("bench", bench_scores, bench_positions, TOP)
    bench_s = timed(lambda i: plain(bench_scores, bench_positions, bench_tables, RATIO, BLOCK_SIZE, bench_scratch, TOP),
                    20, device)
    print(f"rows kernel on the stack's row {1e6 * stack_s:.1f} us, on the bench's {1e6 * bench_s:.1f} us "
          f"({stack_s / bench_s:.2f}x)")


if __name__ == "__main__":
    main()
