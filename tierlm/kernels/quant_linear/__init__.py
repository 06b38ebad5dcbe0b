"""Linear layers over low-bit packed weights: y = x W^T with W unquantized or packed INT4 / INT6 / INT8 with
group scales (compressed-tensors `pack-quantized`; the format, its packing and dequantization: `packing`).

Signature (every form): quant_linear(x [..., K], weight_or_packed, *, scales=None, bits=None,
group_size=None) -> [..., N] in x's dtype; weight_or_packed is W [N, K] in x's dtype, or the packed
int32 [N, ceil(K * bits / 32)] with scales [N, K / group_size] (or [N, 1]: per channel).
  naive.py   dequantize the whole weight, then F.linear (the reference)
  triton.py  one kernel, the format a compile-time variant: a GEMV form for decode rows (dequantized in
             registers, fp32 accumulation, split over K) and a tl.dot GEMM for prefill chunks
"""

from tierlm.kernels.quant_linear.naive import quant_linear
from tierlm.kernels.quant_linear.packing import dequantize, pack, packed_width, quantize, unpack

__all__ = ["dequantize", "pack", "packed_width", "quant_linear", "quantize", "unpack"]
