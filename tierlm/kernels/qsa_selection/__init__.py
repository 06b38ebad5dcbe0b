"""QSA selection: from a query's top blocks (as ranking keys, `qsa_block_scores.naive.ranking_keys`, highest
first) to the physical K/V rows it attends to: the R tokens of each chosen block, then its open tail
[nb*R, p] (R - 1 entries, valid up to p), each token's row found through the block table.

Shapes (shared by both forms): top_keys [M, K] int64 (a key < 0: no block, its entries invalid);
positions [M] int64; tables [M, W] int64 physical block ids (-1 past the end read the scratch block; a
row may be a stride-0 view of one request's table); -> rows [M, S = K*R + R - 1] int64 (invalid entries
point at the scratch block's first row, so every read stays in bounds) and valid [M, S] bool.

`naive.selection_rows` is what the layer's torch path computes (`chosen_positions`, then `physical_rows`);
`triton.triton_selection_rows` is one launch of the same integer arithmetic (bit-identical), run by
static decode steps on CUDA.
"""

from tierlm.kernels.qsa_selection.naive import chosen_positions, physical_rows, selection_rows

__all__ = ["chosen_positions", "physical_rows", "selection_rows"]
