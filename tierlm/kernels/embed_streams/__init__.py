"""The token embeddings copied into the hyper-connection residual streams: one gather that writes each
row's table row into all of its hc streams.

Signature (every form): embed_streams(table [V, H], ids [N] int64, hc_count) -> streams [N, hc_count * H] in
the table's dtype, streams[n, s*H:(s+1)*H] = table[ids[n]] for every stream s (a copy: exact in any dtype).
  naive.py   F.embedding then repeat (the reference; what the CPU runs): two kernels on a GPU
  triton.py  one launch: a program per (row, BLOCK_H columns) loads its slice of the row once and stores
             it hc_count times
"""

from tierlm.kernels.embed_streams.naive import embed_streams

__all__ = ["embed_streams"]
