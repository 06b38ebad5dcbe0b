"""The INT4 packed decode kernel (kernels/fused_moe/packed_decode.py) compiled for sm_90 without a GPU.

For each variant (TIERLM_PACKED_MOE_VARIANT: v1 with fused_moe.triton.DECODE_TILES[4], v2 with
PACKED_V2_TILES, fields replaceable as in moe_decode_kernel.py --packed-variants, early=0 too), group and batch at the
target's widths (hidden 2560, intermediate 640, top-10; with the INT6 shared expert of width 640 unless
--no-shared), each phase's programs, warps, registers a thread, stack bytes (spills), and global loads in
the PTX (16-byte vector loads among them): what decides how many programs an SM holds, and so how many
weight bytes are in flight, before any GPU time is spent. The launch is specialised as a real one is
(16-byte aligned pointers, strides multiples of 16), or the loads come out scalar.

    python bench/packed_decode_registers.py                     # v1 and v2, g32 and g128, b1 and b4
    python bench/packed_decode_registers.py --variants v2:gate_up_block_n=128,gate_up_warps=4 --no-shared
    python bench/packed_decode_registers.py --variants v1 --groups 32 --batches 1 --opcodes

--opcodes: also each phase's SASS instructions (static: every path of the program, the shared expert's
and the finishing program's too), the most frequent opcodes, and those a thread issues after its wait
on the path through the first program-end (`EXIT`) after the wait: for an INT4 tile about two a weight
value (a LOP3 that masks the field, an FFMA that adds it), beside the addressing, loads and sums.
"""

from __future__ import annotations

import argparse
import collections
import re

from sm90_compile import compile_sm90, resources, sass_opcodes

from tierlm.kernels.fused_moe import packed_decode
from tierlm.kernels.fused_moe import triton as kernels
from tierlm.kernels.fused_moe.decode_parts import SharedShape

HIDDEN, INTERMEDIATE, TOP_K, SHARED_WIDTH = 2560, 640, 10, 640
POINTER_TYPES = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "x_bias_ptr": "*fp32", "gu_w_ptr": "*i32", "gu_s_ptr": "*bf16",
                 "ids_ptr": "*i64", "act_ptr": "*fp32", "act_bias_ptr": "*fp32", "gu_shared_w_ptr": "*i32",
                 "gu_shared_s_ptr": "*bf16", "shared_act_ptr": "*bf16", "gu_partial_ptr": "*fp32",
                 "gu_counter_ptr": "*i32", "dn_w_ptr": "*i32", "dn_s_ptr": "*bf16", "routing_ptr": "*bf16",
                 "dn_shared_w_ptr": "*i32", "dn_shared_s_ptr": "*bf16", "shared_gate_ptr": "*bf16", "out_ptr": "*bf16",
                 "dn_partial_ptr": "*fp32", "dn_counter_ptr": "*i32"}
FLOAT_ARGS = {"product_scale", "bias_scale"}


def variant_tiles(spec: str) -> tuple[str, packed_decode.PackedDecodeTiles, bool]:
    """NAME[:FIELD=VALUE,...] -> (variant, its tiles with those fields replaced, whether its weights load
    early: early=0 says not, `packed_decode.early_weights`)."""
    name, _, fields = spec.partition(":")
    tiles = kernels.PACKED_V2_TILES if name == "v2" else kernels.DECODE_TILES[4]
    fields = {field: int(value) for field, value in (item.split("=") for item in fields.split(",") if item)}
    early = bool(fields.pop("early", 1))
    return name, tiles._replace(**fields), early


def compile_phase(launch: packed_decode.PackedLaunch, phase: str, warps: int):
    """One phase of `_packed_decode_kernel` compiled for sm_90 as `packed_decode` launches it (PDL on)."""
    return compile_sm90(packed_decode._packed_decode_kernel, {**launch.constants, "PHASE": phase, "PDL": 3}, warps,
                        POINTER_TYPES, FLOAT_ARGS, divisible={"S"})


def opcodes(cubin: bytes) -> tuple[collections.Counter, collections.Counter]:
    """(every SASS instruction's opcode, counted; those from the first PDL wait (ACQBULK) to the next EXIT)."""
    names = sass_opcodes(cubin)
    after = []
    if "ACQBULK" in names:
        for name in names[names.index("ACQBULK"):]:
            after.append(name)
            if name == "EXIT":
                break
    return collections.Counter(names), collections.Counter(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["v1", "v2"], metavar="SPEC")
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--no-shared", action="store_true", help="the routed experts alone")
    parser.add_argument("--opcodes", action="store_true", help="also the SASS opcodes (see above)")
    args = parser.parse_args()
    print(f"{'variant':<40}{'group':>6}{'batch':>6}{'phase':>9}{'programs':>10}{'warps':>6}{'regs':>6}{'stack':>6}"
          f"{'loads':>7}{'16 B':>6}")
    for spec in args.variants:
        variant, tiles, early = variant_tiles(spec)
        for group in args.groups:
            shared = (SharedShape(0, 0, 0, 0, 0) if args.no_shared else
                      SharedShape(1, 6, SHARED_WIDTH, group, group))
            for batch in args.batches:
                launch = packed_decode._packed_launch(batch, HIDDEN, INTERMEDIATE, TOP_K, 4, group, tiles, 16, shared,
                                                      "bf16", "ieee", variant, early)
                for phase, (programs, warps) in (("gate_up", launch.gate_up), ("down", launch.down)):
                    compiled = compile_phase(launch, phase, warps)
                    registers, stack = resources(compiled.asm["cubin"])
                    ptx = compiled.asm["ptx"]
                    loads, vectors = len(re.findall(r"ld\.global", ptx)), len(re.findall(r"ld\.global[.a-z0-9]*\.v4", ptx))
                    print(f"{spec:<40}{group:>6}{batch:>6}{phase:>9}{programs:>10}{warps:>6}{registers:>6}{stack:>6}"
                          f"{loads:>7}{vectors:>6}", flush=True)
                    if args.opcodes:
                        every, after = opcodes(compiled.asm["cubin"])
                        for what, counts in (("SASS", every), ("after the wait, to the first EXIT,", after)):
                            print(f"    {what} {sum(counts.values())}: "
                                  + ", ".join(f"{k} {v}" for k, v in counts.most_common(8)))


if __name__ == "__main__":
    main()
