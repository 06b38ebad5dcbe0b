"""The PLE n-gram row hash: which table rows a token at a given position reads.

Owns the hash constants (splitmix64-derived odd multipliers per PLE layer, per-head prime table sizes and
offsets) and the torch computation of row ids from token ids, bit-identical to the reference:
  context t_s = ids[p-s] unless p-s < 0 or an EOS lies in ids[p-s .. p-1], then EOS;
  X_n = XOR_{i<n} (t_i * m[i]) with int64 wrap-around; row[h] = floor_mod(X_{n(h)}, size[h]) + offset[h].
The table lookup and the layer math live in `layers/ple.py`; a numpy twin for host-side prefetch can be
built on `NgramHashSpec` without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_LAYER_SEED_STRIDE = 10007


def splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers below (2^63-1)//vocab_size, so t*m cannot overflow for in-vocabulary ids."""
    bound = ((1 << 63) - 1) // max(vocab_size, 1)
    half = max(1, bound // 2)
    base = seed + _LAYER_SEED_STRIDE * ple_index
    return [2 * (splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@cache
def primes_above(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes strictly greater than `start`."""
    found, candidate = [], start
    while len(found) < count:
        candidate += 1
        if _is_prime(candidate):
            found.append(candidate)
    return tuple(found)


@dataclass(frozen=True)
class NgramHashSpec:
    """Everything needed to turn token ids into table rows for one PLE layer."""

    ple_index: int
    ngram_size: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    table_rows: int
    eos_token_id: int

    @classmethod
    def from_config(cls, config, ple_index: int) -> NgramHashSpec:
        heads = config.num_ngram_heads
        primes = primes_above(config.ngram_vocab_size_base - 1, (ple_index + 1) * heads)[ple_index * heads :]
        offsets = [sum(primes[:h]) for h in range(heads)]
        divisor = config.make_ngram_vocab_size_divisible_by
        rows = math.ceil(sum(primes) / divisor) * divisor
        mults = layer_multipliers(config.vocab_size, config.ngram_size, ple_index, config.seed)
        return cls(
            ple_index, config.ngram_size, config.heads_per_ngram, tuple(mults), tuple(primes), tuple(offsets),
            rows, config.eos_token_id,
        )

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1


def ngram_context(history: torch.Tensor, eos: int, ngram_size: int) -> torch.Tensor:
    """Shifted token streams for the hash.

    history: [..., P + T] int64, each request's previous `P = ngram_size-1` ids (EOS-padded at the request
    start) followed by its T new ids. Returns [ngram_size, ..., T]: row s holds t_s for each new token,
    with tokens at or before the most recent EOS strictly before the current position read as EOS.
    """
    prefix = ngram_size - 1
    positions = torch.arange(history.shape[-1], device=history.device)
    eos_pos = torch.where(history == eos, positions, -1)
    last_eos_inclusive = torch.cummax(eos_pos, dim=-1).values
    # most recent EOS strictly before each position
    last_eos_before = torch.cat([torch.full_like(last_eos_inclusive[..., :1], -1), last_eos_inclusive[..., :-1]], -1)
    current = positions[prefix:]
    streams = []
    for shift in range(ngram_size):
        source = current - shift
        valid = source > last_eos_before[..., prefix:]
        streams.append(torch.where(valid, history[..., source], eos))
    return torch.stack(streams)


class NgramHasher:
    """`NgramHashSpec` as device tensors, made once per device so a forward copies nothing from the host."""

    def __init__(self, spec: NgramHashSpec) -> None:
        self.spec = spec
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(multipliers [ngram_size], head sizes [heads], head offsets [heads]) as int64 tensors on device."""
        if device not in self._tensors:
            as_long = {"dtype": torch.int64, "device": device}
            self._tensors[device] = (
                torch.tensor(self.spec.multipliers, **as_long),
                torch.tensor(self.spec.head_sizes, **as_long),
                torch.tensor(self.spec.head_offsets, **as_long),
            )
        return self._tensors[device]

    def rows(self, context: torch.Tensor) -> torch.Tensor:
        """Row ids [..., T, num_heads] for shifted streams `context` [ngram_size, ..., T] (int64)."""
        mults, sizes, offsets = self.constants(context.device)
        mixed = context[0] * mults[0]
        per_order = []
        for n in range(2, self.spec.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, context[n - 1] * mults[n - 1])
            per_order.append(mixed.unsqueeze(-1).expand(*mixed.shape, self.spec.heads_per_ngram))
        return torch.remainder(torch.cat(per_order, dim=-1), sizes) + offsets

