"""QSA indexer rings of a speculative verification batch (T rows per request): the ring after each row (its
open group's raw keys: from the request's ring before the batch, then from its rows) into the row's slot,
and where each row's block key goes (its block's key row when the row closes the block, else the scratch
block's).

Shapes (shared by both forms): ring [S, R, id] (R = the compress ratio) updated in place; slots [B];
raw_keys [B*T, id] (row stride free); positions [B*T]; context_lens [B] (each request's first row's
position); state_slots [B, T]; block_tables [B, W]; -> (rings [B*T, R, id]: the ring after each row, what
the block key is pooled from; key_rows [B*T] int64: rows of the keys pool viewed [-1, id],
`qsa_block_keys`' `group_key_rows`). Entries of a ring past its row's position
are never read (their values are unspecified: the reference clamps them to the request's last row).

`naive.ring_after_rows` is the layer's torch path; `triton.triton_ring_after_rows` is one launch of the
same copies and integer arithmetic (bit-identical), run on CUDA by verification batches (decode batches
store their keys through `kernels/qsa_block_keys`).
"""

from tierlm.kernels.qsa_ring.naive import ring_after_rows

__all__ = ["ring_after_rows"]
