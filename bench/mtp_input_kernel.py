"""The MTP draft head's layer input (`kernels/mtp_input`) at the real width, torch vs the kernel, side by side (GPU).

Hidden 2560, 4 streams, bf16, 1 to 16 rows (a speculative step's draft pass: 1 + K rows per request): the
two pre-fc norms, fc_embedding and fc_hidden (26 MB of weights) and the sum, as the torch reference
(`naive`, ~20 launches) and as the one-launch kernel, each replayed from a CUDA graph; both checked against
the reference; microseconds per call, the kernel's share of the device copy bandwidth on the weights' bytes,
and the ratios. `--baseline ROOT` also times ROOT's kernel (another checkout, or a copy of its
tierlm/kernels/mtp_input/triton.py, e.g. from `git show`): before and after in one run. Saved to
bench/results/mtp_input_kernel_<device>.txt.

    python bench/mtp_input_kernel.py
    python bench/mtp_input_kernel.py --baseline OLD_TRITON_PY
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from device_timing import copy_bandwidth, device_label, timed

import tierlm.kernels.mtp_input.triton as kernels
from tierlm.kernels.mtp_input import naive

HIDDEN, STREAMS = 2560, 4


def inputs(rows: int, device) -> tuple:
    gen = torch.Generator().manual_seed(rows)
    h = HIDDEN

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    return (draw(rows, h), draw(rows, STREAMS * h), draw(h, scale=0.1), draw(STREAMS * h, scale=0.1), 1e-6,
            draw(h, h, scale=h**-0.5), draw(h, h, scale=h**-0.5))


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within a unit of bf16's last place of the value and of its row's largest (tests/test_mtp_input_kernel)."""
    got, expected = got.float(), expected.float()
    return bool(((got - expected).abs() <= 2.0**-7 * (expected.abs() + expected.abs().amax(1, keepdim=True))).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--baseline", type=Path, default=None, metavar="ROOT",
                        help="also time ROOT's kernel (a checkout, or a copy of its mtp_input/triton.py)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device("cuda")
    forms = {"torch": naive.mtp_layer_input, "kernel": kernels.mtp_layer_input}
    if args.baseline is not None:
        from kernel_baseline import load_baseline_module

        forms["before"] = load_baseline_module(args.baseline, "tierlm/kernels/mtp_input/triton.py").mtp_layer_input
    bandwidth = copy_bandwidth(device, 1 << 30)
    weight_bytes = 2 * HIDDEN * HIDDEN * 2
    lines = [(f"{torch.cuda.get_device_name(device)}: hidden {HIDDEN}, {STREAMS} streams, bf16; copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s; us per call replayed from CUDA graphs; % of copy on the weights' "
              f"{weight_bytes / 1e6:.1f} MB"),
             f"{'rows':>5} " + " ".join(f"{name + ' us':>10}" for name in forms) + f" {'kernel %':>9} "
             f"{'torch/kernel':>13}" + ("" if "before" not in forms else f" {'before/kernel':>14}")]
    print(lines[0])
    print(lines[1])
    for rows in args.rows:
        work = inputs(rows, device)
        expected = naive.mtp_layer_input(*work)
        for name, fn in forms.items():
            if not close(fn(*work), expected):
                raise SystemExit(f"{name} is off the reference at {rows} rows")
        us = {name: 1e6 * timed(lambda i, fn=fn, work=work: fn(*work), 20, device) for name, fn in forms.items()}
        line = (f"{rows:5d} " + " ".join(f"{t:10.1f}" for t in us.values())
                + f" {100 * weight_bytes / (us['kernel'] * 1e-6) / bandwidth:8.1f}% {us['torch'] / us['kernel']:12.2f}x"
                + ("" if "before" not in us else f" {us['before'] / us['kernel']:13.2f}x"))
        lines.append(line)
        print(line)
    out = Path(__file__).parent / "results" / f"mtp_input_kernel_{device_label(device)}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
