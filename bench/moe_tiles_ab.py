"""decode_roofline.py with the bf16 MoE decode tiles as one more variable of its `--variants`.

MOE_TILES=GN:GK:GW:DN:DK:DR:DW in a variant replaces `kernels/fused_moe.triton.DECODE_TILES[0]` (the bf16
experts' decode tiles: gate_up columns, K tile, warps; down columns, K tile, ranks a program, warps) while
that variant's graphs are captured and timed, so candidate tiles are measured in the real-width stack,
interleaved with the current ones in one process (an isolated kernel sweep, `moe_decode_kernel.py
--sweep`, times each candidate once, outside the step). Every other argument is decode_roofline.py's.

    cd bench && python moe_tiles_ab.py --contexts 8192 512 --batches 1 4 16 --rounds 3 --steps 100 \
        --variants base MOE_TILES=4:512:4:16:128:1:2 MOE_TILES=8:512:4:8:128:1:2
"""

from __future__ import annotations

import contextlib

import decode_roofline

import tierlm.kernels.fused_moe.triton as fused_moe

plain_environment = decode_roofline.environment
FIELDS = ("gate_up_block_n", "gate_up_block_k", "gate_up_warps", "down_block_n", "down_block_k", "down_ranks",
          "down_warps")


@contextlib.contextmanager
def environment(values: dict[str, str | None]):
    """decode_roofline's environment, with MOE_TILES applied to the bf16 decode tiles inside the block."""
    saved = fused_moe.DECODE_TILES[0]
    spec = values.get("MOE_TILES")
    if spec:
        numbers = spec.split(":")
        if len(numbers) != len(FIELDS) or not all(n.isdigit() for n in numbers):
            raise SystemExit(f"MOE_TILES={spec}: {len(FIELDS)} integers joined by ':' ({':'.join(FIELDS)})")
        fused_moe.DECODE_TILES[0] = saved._replace(**dict(zip(FIELDS, map(int, numbers))))
    try:
        with plain_environment(values):
            yield
    finally:
        fused_moe.DECODE_TILES[0] = saved


if __name__ == "__main__":
    decode_roofline.environment = environment
    decode_roofline.main()
