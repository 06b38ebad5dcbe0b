"""decode_roofline.py with the decode kernels' tiles as more variables of its `--variants`.

While a variant's graphs are captured and timed, so candidate tiles are measured in the real-width stack,
interleaved with the current ones in one process (an isolated kernel sweep, `moe_decode_kernel.py
--sweep` or `decode_fusions.py --sweep-hc`, times each candidate once, outside the step):
  - MOE_TILES=GN:GK:GW:DN:DK:DR:DW replaces `kernels/fused_moe.triton.DECODE_TILES[0]` (the bf16 experts'
    decode tiles: gate_up columns, K tile, warps; down columns, K tile, ranks a program, warps);
  - PACKED_TILES=GN:GW:GR:DN:DW:DR replaces the packed INT4 decode form's v1 tiles
    (`kernels/fused_moe.triton.DECODE_TILES[4]`, INT4 g32's K loop: gate_up columns, words a program, warps;
    down rows, words a program, warps): with --quantize int4-mixed (INT8 experts keep DECODE_TILES[8]);
  - MOE_SHARED_K=GK:DK replaces the shared expert's K tiles (gate_up, down) of the packed INT4 decode form's
    tiles, both K loops (DECODE_TILES[4] for v1, PACKED_V2_TILES for v2): with --quantize int4-mixed;
  - HC_TILES=N:J:K:DW:H:UW:F replaces the hyper-connection mix's tiles for N tokens (the entry of
    `kernels/hyper_connection.triton.MIX_TILES` that a batch of N tokens takes) with MixTiles(N, J, K, DW,
    H, UW, F): tokens, down rows, down columns, down warps, up columns, up warps, up_finish (0 or 1);
  - DENSE_GEMV_MAX_ROWS=N replaces `model/quantization/base.DENSE_GEMV_MAX_ROWS` (up to N decode rows, the
    dense bf16 projections take quant_linear's Triton GEMV, in the PDL chain, not cuBLAS; at most
    GEMV_MAX_ROWS).
Every other argument is decode_roofline.py's.

    cd bench && python tiles_ab.py --contexts 8192 512 --batches 1 4 16 --rounds 3 --steps 100 \
        --variants base MOE_TILES=4:512:4:16:128:1:2 MOE_TILES=8:512:4:8:128:1:2
    cd bench && python tiles_ab.py --quantize int4-mixed --contexts 512 --batches 1 --rounds 3 --steps 100 \
        --variants base MOE_SHARED_K=32:16
    cd bench && python tiles_ab.py --quantize int4-mixed --contexts 512 --batches 1 4 --rounds 3 --steps 100 \
        --variants base PACKED_TILES=16:64:4:128:16:4
    cd bench && python tiles_ab.py --contexts 512 --batches 1 --rounds 5 --steps 50 \
        --variants base HC_TILES=1:8:512:4:8:4:0 HC_TILES=1:4:4096:8:8:4:1
    cd bench && python tiles_ab.py --contexts 512 --batches 2 --rounds 5 --steps 50 \
        --variants base DENSE_GEMV_MAX_ROWS=2
"""

from __future__ import annotations

import contextlib

import decode_roofline

import tierlm.kernels.fused_moe.triton as fused_moe
import tierlm.kernels.hyper_connection.triton as hyper_connection
import tierlm.kernels.quant_linear.triton as quant_linear
import tierlm.model.quantization.base as quantization

plain_environment = decode_roofline.environment
FIELDS = ("gate_up_block_n", "gate_up_block_k", "gate_up_warps", "down_block_n", "down_block_k", "down_ranks",
          "down_warps")
SHARED_FIELDS = ("shared_gate_up_block_k", "shared_down_block_k")
PACKED_FIELDS = ("gate_up_block_n", "gate_up_block_w", "gate_up_warps", "down_block_n", "down_block_w", "down_warps")
HC_FIELDS = hyper_connection.MixTiles._fields


def numbers(name: str, spec: str, fields: tuple[str, ...]) -> dict[str, int]:
    """NAME=spec's integers by field, or a clear exit."""
    values = spec.split(":")
    if len(values) != len(fields) or not all(v.isdigit() for v in values):
        raise SystemExit(f"{name}={spec}: {len(fields)} integers joined by ':' ({':'.join(fields)})")
    return dict(zip(fields, map(int, values)))


def mix_tiles_with(spec: str) -> tuple:
    """MIX_TILES with the entry a batch of HC_TILES' token count takes replaced by its tiles (checked)."""
    fields = numbers("HC_TILES", spec, HC_FIELDS)
    tiles = hyper_connection.MixTiles(**{**fields, "up_finish": bool(fields["up_finish"])})
    try:
        hyper_connection.check_tiles(tiles, int8=False)
    except ValueError as error:
        raise SystemExit(f"HC_TILES={spec}: {error}") from None
    entries = list(hyper_connection.MIX_TILES)
    index = next((i for i, (bound, _) in enumerate(entries) if tiles.block_n <= bound), None)
    if index is None:
        raise SystemExit(f"HC_TILES={spec}: at most {hyper_connection.MAX_TOKENS} tokens")
    entries[index] = (entries[index][0], tiles)
    return tuple(entries)


def dense_gemv_rows(spec: str) -> int:
    """DENSE_GEMV_MAX_ROWS' rows (checked)."""
    rows = numbers("DENSE_GEMV_MAX_ROWS", spec, ("rows",))["rows"]
    if rows > quant_linear.GEMV_MAX_ROWS:
        raise SystemExit(f"DENSE_GEMV_MAX_ROWS={spec}: at most {quant_linear.GEMV_MAX_ROWS} (the GEMV's rows)")
    return rows


@contextlib.contextmanager
def environment(values: dict[str, str | None]):
    """decode_roofline's environment, with MOE_TILES / PACKED_TILES / MOE_SHARED_K / HC_TILES /
    DENSE_GEMV_MAX_ROWS applied inside the block."""
    saved = fused_moe.DECODE_TILES[0], fused_moe.DECODE_TILES[4], fused_moe.PACKED_V2_TILES
    saved_mix, saved_rows = hyper_connection.MIX_TILES, quantization.DENSE_GEMV_MAX_ROWS
    if values.get("MOE_TILES"):
        fused_moe.DECODE_TILES[0] = saved[0]._replace(**numbers("MOE_TILES", values["MOE_TILES"], FIELDS))
    if values.get("PACKED_TILES"):
        fused_moe.DECODE_TILES[4] = saved[1]._replace(**numbers("PACKED_TILES", values["PACKED_TILES"], PACKED_FIELDS))
    if values.get("MOE_SHARED_K"):
        shared = numbers("MOE_SHARED_K", values["MOE_SHARED_K"], SHARED_FIELDS)
        fused_moe.DECODE_TILES[4] = fused_moe.DECODE_TILES[4]._replace(**shared)
        fused_moe.PACKED_V2_TILES = saved[2]._replace(**shared)
    if values.get("HC_TILES"):
        hyper_connection.MIX_TILES = mix_tiles_with(values["HC_TILES"])
    if values.get("DENSE_GEMV_MAX_ROWS"):
        quantization.DENSE_GEMV_MAX_ROWS = dense_gemv_rows(values["DENSE_GEMV_MAX_ROWS"])
    try:
        with plain_environment(values):
            yield
    finally:
        fused_moe.DECODE_TILES[0], fused_moe.DECODE_TILES[4], fused_moe.PACKED_V2_TILES = saved
        hyper_connection.MIX_TILES, quantization.DENSE_GEMV_MAX_ROWS = saved_mix, saved_rows


if __name__ == "__main__":
    decode_roofline.environment = environment
    decode_roofline.main()
