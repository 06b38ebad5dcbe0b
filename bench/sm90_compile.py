"""A Triton kernel compiled for sm_90 without a GPU, as a launch specialises it, what the cubin needs and
its SASS opcodes (shared by packed_decode_registers.py and quant_linear_registers.py)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(kernel, constants: dict, warps: int, pointer_types: dict[str, str], float_args=frozenset(),
                 divisible=frozenset()):
    """`kernel` with these constexprs compiled for sm_90: its other arguments typed by pointer_types (then
    fp32 for float_args, else i32); pointers, strides and the `divisible` arguments marked 16-divisible, as a
    launch with 16-byte aligned tensors specialises them (else loads come out scalar)."""
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(index,)] = constants[name]
            continue
        signature[name] = pointer_types.get(name, "fp32" if name in float_args else "i32")
        if name in pointer_types or "stride" in name or name in divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def cuobjdump(cubin: bytes, flag: str) -> str:
    """What the cuobjdump triton ships prints for a cubin with `flag` (--dump-resource-usage, -sass)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack bytes) of a cubin."""
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(cubin, "--dump-resource-usage"))
    return int(found.group(1)), int(found.group(2))


def sass_opcodes(cubin: bytes) -> list[str]:
    """A cubin's SASS instructions' opcodes (without their modifiers), in address order."""
    return [m.group(1).split(".")[0] for m in
            re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", cuobjdump(cubin, "-sass"))]
