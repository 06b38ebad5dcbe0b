"""The token embeddings copied into the hyper-connection residual streams: one gather that writes each
row's table row into all of its hc streams.

Signature (every form): embed_streams(table, ids [N] int64, hc_count, scales=None) -> streams
[N, hc_count * H], streams[n, s*H:(s+1)*H] = E[ids[n]] for every stream s, where the table E [V, H] is
  - `table` itself (scales None; the streams in its dtype): a copy, exact in any dtype;
  - INT8 with one scale per row (int4-mixed checkpoints' `int8/channel` embedding), as compressed-tensors
    `pack-quantized` stores it (`kernels/quant_linear/packing`): `table` int32 words [V, H / 4], value k of
    a row at bits 8 (k % 4) of word k // 4, stored with a bias of 128, and `scales` [V, 1]:
    E[v, k] = (stored - 128) * scales[v], formed in fp32 and rounded once to the scales' dtype (the
    streams'), as the torch path of an INT8 `Embedding` dequantizes its gathered rows: the same bits.
  naive.py   F.embedding (INT8: the gathered rows' words and scales, dequantized) then repeat (the
             reference; what the CPU runs): two kernels on a GPU, about 26 for INT8
  triton.py  one launch: a program per (row, BLOCK_H columns) loads its slice of the row once (INT8: its
             words and the row's scale, split and scaled in registers) and stores it hc_count times
"""

from tierlm.kernels.embed_streams.naive import embed_streams

__all__ = ["embed_streams"]
