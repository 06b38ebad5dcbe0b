"""Torch reference of QSA prefill attention: gather the selected rows, then masked SDPA (the torch path)."""

from __future__ import annotations

import torch

from tierlm.kernels.qsa_row_cache.naive import attend_rows


def sparse_attention(
    q: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See the package docstring for shapes. Copies K and V of every (query, row) pair."""
    return attend_rows(q, key_rows[rows], value_rows[rows], valid, scale)


def sparse_attention_lse(
    q: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention` computed and returned in fp32, with each (query, head)'s log-sum-exp of its scaled
    scores [M, nh]; a query with no valid entry gets zeros and -inf (one part of a split row set)."""
    num_kv_heads = key_rows.shape[1]
    qg = q.float().unflatten(1, (num_kv_heads, -1))  # [M, nkv, g, hd]
    keys, values = key_rows[rows].float(), value_rows[rows].float()  # [M, S, nkv, hd]
    scores = torch.einsum("mkgd,mskd->mkgs", qg, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [M, nkv, g]
    weights = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    out = torch.einsum("mkgs,mskd->mkgd", weights, values)
    return out.flatten(1, 2), lse.flatten(1)


def merge_parts(outs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of disjoint row sets from each set's fp32 output [M, nh, hd] and
    log-sum-exp [M, nh]: the outputs weighted by exp(lse - logsumexp(lses)), in fp32, -> dtype."""
    stacked = torch.stack(lses)  # [P, M, nh]
    weights = torch.exp(stacked - torch.logsumexp(stacked, dim=0))  # every query has a valid row somewhere
    merged = sum(w[..., None] * o for w, o in zip(weights, outs))
    return merged.to(dtype)
