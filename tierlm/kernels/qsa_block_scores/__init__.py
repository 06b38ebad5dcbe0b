"""QSA decode block scores: each request's indexer query against the compressed keys its block table holds.

A decode query at position p sees nb = (p+1)//R compressed keys (one per complete group of R tokens);
block j scores sum_h relu(q_h . K_j) / sqrt(id) in fp32, and the groups it cannot see yet score -inf, so
top-k over a row of any width picks among the visible ones only.

Shapes (shared by every form): q [B, ih, id] (the roped, normed indexer queries); index_keys
[num_blocks, per_block = block_size / R, id] (the paged pool of compressed keys); block_tables [B, W]
int64 physical block ids (-1 past the end; last dim contiguous); positions [B] int64; result [B, G =
W * per_block] fp32.

`naive.block_scores` gathers every key of the table and masks the unseen ones (what a static decode
step on CPU runs); `triton.triton_block_scores` reads each request's visible keys in place through its
block table and skips the rest (varlen: a short request beside a long one reads its own few keys), with
no host sync, so a CUDA graph captures it; given skip_up_to (the selection's budget), it leaves the rows
of requests that see at most that many blocks unwritten (they choose every block they see, whatever it
scores). Equal up to fp32 summation order.

The prefill form, `request_scores`: a group of one request's queries q [M, ih, id] (positions [M])
against that request's block keys gathered into [G, id] -> [M, G]; `naive.request_scores` (torch: the
products of every head as one [M, ih, G] tensor) and `triton.triton_request_scores` (tiles of queries by
tiles of keys, each head's products one tl.dot, relu and the heads' sum in registers: only [M, G] is
written). Equal up to fp32 summation order.
"""

from tierlm.kernels.qsa_block_scores.naive import block_scores, request_scores

__all__ = ["block_scores", "request_scores"]
