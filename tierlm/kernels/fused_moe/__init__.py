"""Top-k SwiGLU experts over stacked expert weights, unquantized or packed INT4 / INT6 / INT8 with group
scales (the format: `quant_linear.packing`), optionally with the MoE block's shared expert.

Signature (every form): fused_moe(x [T, H], w_gate_up, w_down, topk_weights [T, k], topk_ids [T, k], *,
format="unquantized" | "int4" | "int6" | "int8", scales=None | (gate_up_scales, down_scales),
group_size=None, shared=None | SharedExpert) -> [T, H] in x's dtype. Unquantized weights are laid out
as `model/layers/moe.Experts` holds them (w_gate_up [E, 2I, H]: gate rows then up rows; w_down
[E, H, I]); packed ones as int32 [E, N, ceil(K * bits / 32)] with scales [E, N, K / group_size].
`shared`: the shared expert as one more expert of every token, its gate its routing weight (its own
format and width).
  naive.py   a loop over the hit experts in ascending id (transformers' order), experts dequantized one
             at a time, then the gated shared expert added (the reference)
  triton.py  gate_up + SiLU-and-mul, down + routing weight, and the top-k sum, the weights read in
             place; decode: two GEMV launches, one pair per program row, the shared expert one more
             pair per token; prefill: pairs sorted by expert into padded blocks
             (align_pairs_to_blocks) for a grouped GEMM, the shared expert apart
  packed_decode.py  the decode form for experts packed in 4 or 8 bits: one tile per program, all its
             loads up front, K split over programs and summed in order by the last to arrive; x and the
             activations read in a split, pre-scaled layout, 2 instructions a value; the shared expert's
             tiles in its own format beside the experts' (at the token counts of
             PACKED_SHARED_APART_TOKENS `triton.fused_moe` runs it apart); INT4's K loop v1 (one tile
             a program) or v2 (tall tiles, several a program, double-buffered; `packed_variant` picks by group and tokens)
  decode_parts.py  what the two decode forms share (`SharedArgs`, `SharedShape`; for the
             unquantized / INT6 form the shared expert's columns in any format and the end of a down
             program whose token's experts are split over several programs)
Every Triton launch uses programmatic dependent launch where the device has it (`kernels/dependent_launch`);
its programs wait for the kernel before them first (which expert a program reads is the router's output).
"""

from tierlm.kernels.fused_moe.naive import SharedExpert, fused_moe

__all__ = ["SharedExpert", "fused_moe"]
