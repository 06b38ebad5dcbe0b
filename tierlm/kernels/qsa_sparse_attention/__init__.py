"""QSA prefill attention: each query over the K/V rows its indexer selected, read by index from the pool.

Shapes (shared by both forms): q [M, nh, hd] (one row per prefill query), key_rows, value_rows
[R, nkv, hd] (the paged pool [num_blocks, block_size, nkv, hd] viewed as rows), rows [M, S] int64
physical rows (block table already applied: `qsa_attention.Selection`), valid [M, S] bool (an invalid
entry points anywhere in bounds and is ignored; every query has at least one valid row, its own) ->
[M, nh, hd] in q's dtype. Grouped-query: head h reads KV head h // (nh / nkv). The output gate is the
caller's.

naive.py gathers each query's rows ([M, S, nkv, hd] copies) and runs SDPA: the math of the torch
prefill path. triton.py reads the rows in place with an online softmax: no [queries x rows] copy.
"""

from tierlm.kernels.qsa_sparse_attention.naive import sparse_attention

__all__ = ["sparse_attention"]
