"""QSA selection: from a query's block scores to the physical K/V rows it attends to: the R tokens of each
of its K = min(top, G) chosen blocks, in block order, then its open tail [nb*R, p] (R - 1 entries, valid
up to p), each token's row found through the block table.

The chosen blocks are the K with the highest `qsa_block_scores.naive.ranking_keys` (higher score first,
ties to the lower block index; unseen blocks rank below every seen one and are invalid entries), so a
query that sees nb <= K blocks chooses blocks 0..K-1, valid below nb, whatever they score.

Shapes (shared by both forms): scores [M, G] fp32 (-inf for unseen blocks; or None when G <= top: then
every seen block is chosen and no score is needed); positions [M] int64; tables [M, W] int64 physical
block ids, G = W * block_size / R (-1 past the end read the scratch block; a row may be a stride-0 view of
one request's table); -> rows [M, S = K*R + R - 1] int64 (invalid entries point at the scratch block's
first row, so every read stays in bounds) and valid [M, S] bool.

`naive.selection_rows` is the torch path (`ranking_keys`, `top_keys`: torch.topk and a sort of the K
chosen into block order, `chosen_positions`, `physical_rows`), what the layer runs on CPU and with
TIERLM_NO_FUSED_QSA_SELECT=1; `triton.triton_selection_rows` is a radix select over the scores' bits (no
sort; bit-identical): one launch, a program a query, up to SPLIT_FROM_GROUPS blocks, past them each
query's select split over many programs (`split_triton`), run by static decode steps and prefill query
groups on CUDA (a prefill's scores may cover fewer blocks than its table holds).
"""

from tierlm.kernels.qsa_selection.naive import chosen_positions, physical_rows, selection_rows, top_keys

__all__ = ["chosen_positions", "physical_rows", "selection_rows", "top_keys"]
