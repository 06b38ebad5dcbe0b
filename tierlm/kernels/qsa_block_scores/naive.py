"""QSA block scores in plain torch (decode and prefill), and the ranking keys top-k takes them by: the reference (see
the package docstring for shapes)."""

from __future__ import annotations

import math

import torch


def block_scores(
    q: torch.Tensor, index_keys: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Scores [B, G] of each query q [B, ih, id] against every compressed key of its block table; groups
    j >= (p+1)//R (not complete yet, or past the table's end) score -inf."""
    keys = index_keys[block_tables.clamp_min(0)].flatten(1, 2)  # [B, G, id]; -1 entries read block 0, masked
    return _visible_sums(torch.einsum("mhd,mgd->mhg", q.float(), keys.float()), q.shape[-1], positions, ratio)


def request_scores(q: torch.Tensor, block_keys: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Scores [M, G] of M queries q [M, ih, id] of one request (a prefill's query group) against its
    gathered block keys [G, id]; groups a query cannot see yet (j >= (p+1)//R) score -inf."""
    return _visible_sums(torch.matmul(q.float(), block_keys.float().T), q.shape[-1], positions, ratio)


def _visible_sums(products: torch.Tensor, head_dim: int, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Both forms' scores from their fp32 products [M, ih, G]: sum_h relu / sqrt(id), -inf where
    j >= (p+1)//R."""
    scores = torch.relu(products).sum(dim=1) / math.sqrt(head_dim)
    groups = torch.arange(scores.shape[1], device=products.device)
    return scores.masked_fill(groups >= ((positions + 1) // ratio)[:, None], float("-inf"))


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys [B, G] that order blocks as top-k should take them: higher score first, ties to
    the lower block index, whatever the row's width (torch.topk alone breaks ties differently for
    different widths). A score's bits (scores are sums of relus, >= 0, with the sign of -0.0 cleared, so
    it ties with 0.0; or -inf for an unseen block: bits -1, below every seen one) above the complement of
    its block index. A key is >= 0 exactly when its block is seen; `block_of_key` undoes the index."""
    index = torch.arange(scores.shape[-1], device=scores.device)
    bits = scores.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    bits = torch.where(scores == float("-inf"), -1, bits)
    return (bits << 32) | (0xFFFFFFFF - index)


def block_of_key(keys: torch.Tensor) -> torch.Tensor:
    """The block index a ranking key was made for."""
    return 0xFFFFFFFF - (keys & 0xFFFFFFFF)
