"""The row cache's state and its plain torch step: the reference the kernels are tested against.

Every tensor here is on one device; the kernels read host rows over UVA instead. See the package
docstring for the shapes and the protocol of a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPOCH_SHIFT = 32  # a claim is epoch << 32 | row: rows below 2**32, epochs below 2**31 (a year at 60 steps/s)


class QSARowCache:
    """One QSA layer's cache: slots in an arena the caller owns, plus tags, hit marks and claims.

    keys, values: [C, nkv, hd] views of the arena (their content is unknown until rows are cached).
    hitmark [C]: the last epoch in which an entry hit the slot. claims [C]: the highest claim
    (epoch << 32 | row) a miss ever made on the slot; this step's winner finds its own claim there.
    Both only grow with the epoch, so they need no reset between steps. epoch, hits, misses: 0-d int64
    tensors on the cache's device, so that a step never waits for the host (and a captured graph
    advances them on replay).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        contiguous = keys.is_contiguous() and values.is_contiguous()
        if keys.shape != values.shape or keys.dim() != 3 or not contiguous:
            raise ValueError(f"keys and values must both be contiguous [C, nkv, hd], got {tuple(keys.shape)} "
                             f"and {tuple(values.shape)}")
        self.keys, self.values = keys, values
        self.num_slots = keys.shape[0]
        metadata = {"dtype": torch.int64, "device": keys.device}
        self.tags = torch.full((self.num_slots,), -1, **metadata)
        self.hitmark = torch.full((self.num_slots,), -1, **metadata)
        self.claims = torch.full((self.num_slots,), -1, **metadata)
        self.epoch = torch.zeros((), **metadata)
        self.hits = torch.zeros((), **metadata)
        self.misses = torch.zeros((), **metadata)

    def invalidate(self, rows_written: torch.Tensor) -> None:
        """Start a step: rows_written [N] (rewritten in the pool) leave their slots; the epoch advances."""
        rows = rows_written.flatten()
        slots = rows % self.num_slots
        held = self.tags[slots]
        # amin with -1 where a slot holds a written row: duplicates of a slot in rows_written agree
        self.tags.scatter_reduce_(0, slots, torch.where(held == rows, -1, held), reduce="amin")
        self.epoch += 1

    def drop_slots(self, count: int) -> None:
        """Forget slots [0, count): a staged prefill overwrote the arena's first `count` rows."""
        self.tags[:count].fill_(-1)

    def reset_counters(self) -> None:
        """Start counting hits and misses afresh (after the warm-up forwards of graph capture)."""
        self.hits.zero_()
        self.misses.zero_()

    def counters(self) -> tuple[int, int]:
        """(hits, misses) of valid entries since construction (waits for the device)."""
        return int(self.hits), int(self.misses)


def store_rows(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """New tokens' K, V [N, nkv, hd] into pool rows [N]; their slots forget them; the epoch advances."""
    at = rows.to(host_keys.device)
    host_keys[at] = keys.to(host_keys.device)
    host_values[at] = values.to(host_values.device)
    cache.invalidate(rows)


def plan_rows(cache: QSARowCache, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Which entries hit [B, S] bool; marks hit slots with the epoch and lets misses claim theirs."""
    slots = (rows % cache.num_slots).flatten()
    hit = valid & (cache.tags[slots].view_as(rows) == rows)
    miss = valid & ~hit
    cache.hitmark.scatter_reduce_(0, slots, torch.where(hit, cache.epoch, -1).flatten(), reduce="amax")
    claim = (cache.epoch << EPOCH_SHIFT) | rows
    cache.claims.scatter_reduce_(0, slots, torch.where(miss, claim, -1).flatten(), reduce="amax")
    cache.hits += hit.sum()
    cache.misses += miss.sum()
    return hit


def read_rows(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    rows: torch.Tensor,
    hit: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [B, S, nkv, hd] of the rows: hits from their slots, the rest from the pool.

    Misses whose claim won a slot nobody hit this step then cache their row. An invalid entry can
    match a winning claim only when a valid entry of the same row won it, so it writes the same bytes.
    """
    slots = rows % cache.num_slots
    from_pool_k, from_pool_v = host_keys[rows], host_values[rows]
    select = hit[..., None, None]
    keys = torch.where(select, cache.keys[slots], from_pool_k)
    values = torch.where(select, cache.values[slots], from_pool_v)
    won = cache.claims[slots] == ((cache.epoch << EPOCH_SHIFT) | rows)
    write = ~hit & won & (cache.hitmark[slots] != cache.epoch)
    # entries writing one slot all carry the same row (it is in the claim), so their order is moot
    target = slots[write]
    cache.keys[target] = from_pool_k[write]
    cache.values[target] = from_pool_v[write]
    cache.tags[target] = rows[write]
    return keys, values


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [M, nh, hd] over each query's own rows K, V [M, S, nkv, hd] where valid [M, S] -> [M, nh, hd]
    (grouped-query: head h reads KV head h // (nh / nkv)).

    The nh / nkv query heads that share a KV head go in as that head's "sequence" of queries, so K and
    V are never widened to nh heads (SDPA's enable_gqa would copy them nh / nkv times: 12x at the
    target model's shapes, where a prefill query's rows are 4 MB before the copy).
    """
    num_kv_heads = keys.shape[2]
    attn = F.scaled_dot_product_attention(
        q.unflatten(1, (num_kv_heads, -1)), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale,
    )  # [M, nkv, nh / nkv, hd]
    return attn.flatten(1, 2)


def decode_attention(
    cache: QSARowCache,
    host_keys: torch.Tensor,
    host_values: torch.Tensor,
    q: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    hit: torch.Tensor | None,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode query per request q [B, nh, hd] over its selected rows [B, S] -> [B, nh, hd], times
    sigmoid(gate [B, nh, hd]) when a gate is given.

    Hits read their slot, the rest the pool, and winning misses fill the cache (`read_rows`). With
    hit None (all False) and a cache never planned this step, nothing is cached: the plain, all-host path.
    """
    keys, values = read_rows(cache, host_keys, host_values, rows, torch.zeros_like(valid) if hit is None else hit)
    out = attend_rows(q, keys, values, valid, scale)
    return out if gate is None else out * torch.sigmoid(gate)
