"""decode_roofline.py with the MoE decode tiles as more variables of its `--variants`.

While a variant's graphs are captured and timed, so candidate tiles are measured in the real-width stack,
interleaved with the current ones in one process (an isolated kernel sweep, `moe_decode_kernel.py
--sweep`, times each candidate once, outside the step):
  - MOE_TILES=GN:GK:GW:DN:DK:DR:DW replaces `kernels/fused_moe.triton.DECODE_TILES[0]` (the bf16 experts'
    decode tiles: gate_up columns, K tile, warps; down columns, K tile, ranks a program, warps);
  - MOE_SHARED_K=GK:DK replaces the shared expert's K tiles (gate_up, down) of the packed INT4 decode form's
    tiles, both K loops (DECODE_TILES[4] for v1, PACKED_V2_TILES for v2): with --quantize int4-mixed.
Every other argument is decode_roofline.py's.

    cd bench && python moe_tiles_ab.py --contexts 8192 512 --batches 1 4 16 --rounds 3 --steps 100 \
        --variants base MOE_TILES=4:512:4:16:128:1:2 MOE_TILES=8:512:4:8:128:1:2
    cd bench && python moe_tiles_ab.py --quantize int4-mixed --contexts 512 --batches 1 --rounds 3 --steps 100 \
        --variants base MOE_SHARED_K=32:16
"""

from __future__ import annotations

import contextlib

import decode_roofline

import tierlm.kernels.fused_moe.triton as fused_moe

plain_environment = decode_roofline.environment
FIELDS = ("gate_up_block_n", "gate_up_block_k", "gate_up_warps", "down_block_n", "down_block_k", "down_ranks",
          "down_warps")


SHARED_FIELDS = ("shared_gate_up_block_k", "shared_down_block_k")


def numbers(name: str, spec: str, fields: tuple[str, ...]) -> dict[str, int]:
    """NAME=spec's integers by field, or a clear exit."""
    values = spec.split(":")
    if len(values) != len(fields) or not all(v.isdigit() for v in values):
        raise SystemExit(f"{name}={spec}: {len(fields)} integers joined by ':' ({':'.join(fields)})")
    return dict(zip(fields, map(int, values)))


@contextlib.contextmanager
def environment(values: dict[str, str | None]):
    """decode_roofline's environment, with MOE_TILES / MOE_SHARED_K applied to the tiles inside the block."""
    saved = fused_moe.DECODE_TILES[0], fused_moe.DECODE_TILES[4], fused_moe.PACKED_V2_TILES
    if values.get("MOE_TILES"):
        fused_moe.DECODE_TILES[0] = saved[0]._replace(**numbers("MOE_TILES", values["MOE_TILES"], FIELDS))
    if values.get("MOE_SHARED_K"):
        shared = numbers("MOE_SHARED_K", values["MOE_SHARED_K"], SHARED_FIELDS)
        fused_moe.DECODE_TILES[4], fused_moe.PACKED_V2_TILES = saved[1]._replace(**shared), saved[2]._replace(**shared)
    try:
        with plain_environment(values):
            yield
    finally:
        fused_moe.DECODE_TILES[0], fused_moe.DECODE_TILES[4], fused_moe.PACKED_V2_TILES = saved


if __name__ == "__main__":
    decode_roofline.environment = environment
    decode_roofline.main()
