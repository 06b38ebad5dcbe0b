"""PLE n-gram row ids on the host, in numpy: which table rows a chunk of tokens will read.

The engine needs the rows of a request's tokens before the GPU runs them (to prefetch from the NVMe table,
to advise the page cache) and the cache simulator needs them for whole traces, both without torch. This is
the numpy twin of `tierlm.model.ngram_hash` (`ngram_context` + `NgramHasher.rows`) and equals it bit for bit:
  context t_s = ids[p-s], read as EOS when p-s lies at or before the most recent EOS strictly before p;
  X_n = XOR_{i<n} (t_i * m[i]) with int64 wrap-around; row[h] = floor_mod(X_{n(h)}, size[h]) + offset[h].
numpy's int64 array arithmetic wraps silently (only numpy *scalar* arithmetic checks for overflow, so every
operand here is an array), and the remainder is a floor-mod (non-negative for a positive divisor), like
`torch.remainder`.
It owns the hash of one token stream and the carried context; the hash constants stay in `ngram_hash`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tierlm.model.ngram_hash import NgramHashSpec


@dataclass(frozen=True, eq=False)
class NgramHashArrays:
    """`NgramHashSpec` as int64 arrays, made once per layer so that a decode step converts nothing."""

    ngram_size: int
    eos: int
    multipliers: np.ndarray  # [ngram_size]
    order_sizes: tuple[np.ndarray, ...]  # per order n = 2..ngram_size: the prime sizes of its heads
    order_offsets: tuple[np.ndarray, ...]  # per order: the heads' row offsets
    num_heads: int

    @classmethod
    def from_spec(cls, spec: NgramHashSpec) -> NgramHashArrays:
        if spec.eos_token_id is None:
            raise ValueError("the n-gram hash needs an eos_token_id")
        hp = spec.heads_per_ngram
        sizes = np.asarray(spec.head_sizes, dtype=np.int64)
        offsets = np.asarray(spec.head_offsets, dtype=np.int64)
        return cls(
            ngram_size=spec.ngram_size,
            eos=int(spec.eos_token_id),
            multipliers=np.asarray(spec.multipliers, dtype=np.int64),
            order_sizes=tuple(sizes[o * hp : (o + 1) * hp] for o in range(spec.ngram_size - 1)),
            order_offsets=tuple(offsets[o * hp : (o + 1) * hp] for o in range(spec.ngram_size - 1)),
            num_heads=spec.num_heads,
        )


@lru_cache(maxsize=64)
def _arrays_of(spec: NgramHashSpec) -> NgramHashArrays:
    return NgramHashArrays.from_spec(spec)


def initial_context(spec: NgramHashSpec) -> np.ndarray:
    """The carried context before a request's first token: ngram_size-1 EOS ids."""
    return np.full(spec.context_len, spec.eos_token_id, dtype=np.int64)


def carry_context(context: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """The context to carry after `chunk`: the last len(context) ids of context + chunk."""
    keep = len(context)
    if keep == 0:
        return np.asarray(context, dtype=np.int64)
    return np.concatenate([np.asarray(context, dtype=np.int64), np.asarray(chunk, dtype=np.int64)])[-keep:]


def ngram_rows_np(
    hashing: NgramHashSpec | NgramHashArrays, context: np.ndarray, chunk: np.ndarray
) -> np.ndarray:
    """Row ids [T, num_heads] int64 of the T tokens of `chunk`.

    context: the request's previous ngram_size-1 ids (`initial_context` at its start, then `carry_context`);
    chunk: the T new ids (any integer dtype; values outside the vocabulary wrap as int64, like torch).
    """
    h = _arrays_of(hashing) if isinstance(hashing, NgramHashSpec) else hashing
    prefix = h.ngram_size - 1
    if len(context) != prefix:
        raise ValueError(f"context has {len(context)} ids, the hash carries ngram_size-1 = {prefix}")
    history = np.concatenate([np.asarray(context, dtype=np.int64), np.asarray(chunk, dtype=np.int64).ravel()])
    total = len(history)
    # [num_heads, T]: each head's row is one contiguous pass with a scalar divisor (numpy's fast path)
    out = np.empty((h.num_heads, total - prefix), dtype=np.int64)
    # index of the most recent EOS strictly before each new position (-1: none)
    eos_at = np.where(history == h.eos, np.arange(total, dtype=np.int64), -1)
    last_eos_before = np.maximum.accumulate(eos_at)[prefix - 1 : total - 1]  # prefix >= 1 (ngram_size >= 2)
    current = np.arange(prefix, total, dtype=np.int64)
    mixed = history[prefix:] * h.multipliers[0]
    column = 0
    for shift in range(1, h.ngram_size):
        token = np.where(current - shift > last_eos_before, history[prefix - shift : total - shift], h.eos)
        mixed = mixed ^ (token * h.multipliers[shift])
        sizes, offsets = h.order_sizes[shift - 1], h.order_offsets[shift - 1]
        block = out[column : column + len(sizes)]
        # floor-mod as mixed - floor(mixed / size) * size: exact in wrap-around int64 (the true result lies in
        # [0, size)), and about 3x faster than np.remainder, which fixes up signs element by element
        np.floor_divide(mixed, sizes[:, None], out=block)
        block *= sizes[:, None]
        np.subtract(mixed, block, out=block)
        block += offsets[:, None]
        column += len(sizes)
    return np.ascontiguousarray(out.T)
