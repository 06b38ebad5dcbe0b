"""quant_linear's kernels (kernels/quant_linear/triton.py) compiled for sm_90 without a GPU.

For each weight format and shape (N x K) and row count, the launch `quant_linear` makes (`launch_config`:
the GEMV up to GEMV_MAX_ROWS rows, else the tl.dot GEMM), compiled as a real launch is specialised
(16-byte aligned pointers and strides): tiles, programs, registers a thread, stack bytes (spills) and
global loads in the PTX. What decides how many programs an SM holds before any GPU time is spent, and a
check that a kernel compiles at all (Triton's CPU interpreter accepts Python its compiler refuses).

    python bench/quant_linear_registers.py                          # INT6 g32 at the shared expert's shapes
    python bench/quant_linear_registers.py --bits 4 --group 128 --shapes 10240x2560 --rows 1 4 32
    python bench/quant_linear_registers.py --bits 0 --shapes 16480x2560 2560x6144 12800x2560 --rows 1  # bf16
"""

from __future__ import annotations

import argparse
import re

import triton
from sm90_compile import compile_sm90, resources

from tierlm.kernels.quant_linear import triton as kernels

POINTER_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": "*bf16", "partial_ptr": "*fp32",
                 "counter_ptr": "*i32"}


def shape(text: str) -> tuple[int, int]:
    n, _, k = text.partition("x")
    return int(n), int(k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=6, choices=[0, 4, 6, 8], help="0: unquantized bf16")
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--shapes", type=shape, nargs="+", default=[(1280, 2560), (2560, 640)], metavar="NxK")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    args = parser.parse_args()
    print(f"{'N x K':>12}{'rows':>6}{'kernel':>7}{'tiles (m, n, k)':>18}{'splits':>7}{'programs':>9}{'warps':>6}"
          f"{'up front':>9}{'regs':>6}{'stack':>6}{'loads':>7}")
    for n, k in args.shapes:
        for m in args.rows:
            bits = args.bits or None
            cfg = kernels.launch_config(m, n, k, bits)
            constants = {"BITS": args.bits, "GROUP_SIZE": args.group, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                         "BLOCK_K": cfg.block_k, "EVEN_K": k % cfg.block_k == 0, "PRECISION": "tf32", "PDL": 3}
            if cfg.use_dot:
                kernel, programs = kernels._gemm_kernel, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
            else:
                kernel, constants["SPLIT"] = kernels._gemv_kernel, cfg.splits > 1
                constants["UP_FRONT_TILES"] = cfg.up_front_tiles
                programs = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * cfg.splits
            pointers = dict(POINTER_TYPES, w_ptr="*bf16") if bits is None else POINTER_TYPES
            compiled = compile_sm90(kernel, constants, cfg.num_warps, pointers)
            registers, stack = resources(compiled.asm["cubin"])
            loads = len(re.findall(r"ld\.global", compiled.asm["ptx"]))
            tiles = f"{cfg.block_m}, {cfg.block_n}, {cfg.block_k}"
            print(f"{n:>6}x{k:<5}{m:>6}{'gemm' if cfg.use_dot else 'gemv':>7}{tiles:>18}{cfg.splits:>7}{programs:>9}"
                  f"{cfg.num_warps:>6}{constants.get('UP_FRONT_TILES', '-'):>9}{registers:>6}{stack:>6}{loads:>7}",
                  flush=True)


if __name__ == "__main__":
    main()
