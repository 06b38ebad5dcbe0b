"""The QSA indexer's key selection against a per-query statement of the rule."""

from __future__ import annotations

import math

import torch

from tierlm.model.layers.qsa_attention import QSAIndexer


class _Config:
    indexer_n_heads, indexer_head_dim, indexer_compress_ratio, indexer_budget = 3, 8, 4, 12
    hidden_size, rms_norm_eps = 16, 1e-6


def test_selection_is_top_blocks_plus_open_tail():
    torch.manual_seed(0)
    indexer = QSAIndexer(_Config())
    r, topk = 4, 3
    context, chunk = 30, 21
    kv_len = context + chunk
    positions = torch.arange(context, kv_len)
    q = torch.randn(chunk, 3, 8)
    q[::3] = -q[::3].abs()  # every score of these queries is relu(negative) = 0: a full tie
    block_keys = torch.randn(kv_len // r, 8).abs()
    mask = indexer.select(q, block_keys, positions, kv_len)
    for i, p in enumerate(positions.tolist()):
        nb = (p + 1) // r
        scores = torch.relu(q[i] @ block_keys[:nb].T).sum(0) / math.sqrt(8)
        # top scores, ties to the lower block index
        chosen = set(sorted(range(nb), key=lambda j: (-float(scores[j]), j))[: min(topk, nb)])
        expected = {j for j in range(p + 1) if j // r in chosen or j >= nb * r}
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == expected
        # late queries really are sparse: the budget drops blocks
        if nb > topk:
            assert len(expected) < p + 1
