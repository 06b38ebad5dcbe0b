"""Counter-based sampling noise: Exp(1) variates that are a pure function of (a row's 64-bit key, a
candidate's index), so a batch's draw needs no generator state and no launch per row.

A draw is an exponential race (the candidate with the largest p / E wins, E ~ Exp(1)); the sampler gives
each row a key (`row_keys`): a seeded request's from its seed and the output position being drawn (the
same tokens whatever else shares the batch, and again after a preemption), an unseeded one's from the
sampler's own host generator, fresh each step. Candidate j's variate is -log(u) with
u = (2 * (the top 23 bits of splitmix64(key + j * GOLDEN)) + 1) / 2^24, so 0 < u < 1 and E > 0: a
candidate of probability 0 never wins (0 / E is 0, never NaN).

Two forms of the same hash: numpy on the host (`exponential_noise_np`: the few ranked candidates of a
top-k draw, sent up with the step's parameters) and torch on the logits' device (`exponential_noise`:
one variate per vocabulary id, for a draw over the whole vocabulary, computed in place in two int64
buffers and the float32 result); their hash bits are identical, the final float32 logarithm is each
library's own.
"""

from __future__ import annotations

import numpy as np
import torch

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer multipliers


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch multiplies by (wrapping, as uint64 arithmetic does)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_np(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    return z ^ (z >> np.uint64(31))


def _shift_right(z: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic), written into `out`."""
    return torch.bitwise_right_shift(z, bits, out=out).bitwise_and_((1 << (64 - bits)) - 1)


def _mix_torch_(z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`_mix_np` on int64 bit patterns, in place (scratch: a buffer of z's shape for the shifted bits)."""
    z ^= _shift_right(z, 30, scratch)
    z *= _signed(_MIX1)
    z ^= _shift_right(z, 27, scratch)
    z *= _signed(_MIX2)
    z ^= _shift_right(z, 31, scratch)
    return z


def seeded_keys(seeds: list[int], positions: list[int]) -> np.ndarray:
    """uint64 keys of seeded rows: splitmix64(splitmix64(seed) + (position + 1) * GOLDEN)."""
    with np.errstate(over="ignore"):
        seed = np.array([s % (1 << 64) for s in seeds], dtype=np.uint64)
        position = np.array(positions, dtype=np.uint64) + np.uint64(1)
        return _mix_np(_mix_np(seed) + position * np.uint64(GOLDEN))


def exponential_noise_np(keys: np.ndarray, count: int) -> np.ndarray:
    """float32 [rows, count]: candidate j's variate for each uint64 key (host form)."""
    with np.errstate(over="ignore"):
        z = _mix_np(keys[:, None] + np.arange(count, dtype=np.uint64)[None, :] * np.uint64(GOLDEN))
    top = (z >> np.uint64(41)).astype(np.float32)  # 23 bits: 2 * top + 1 < 2^24 is exact in float32
    return -np.log((top * np.float32(2) + np.float32(1)) * np.float32(2.0**-24))


def exponential_noise(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 [rows, len(index)]: candidate index[j]'s variate for each key (int64 bit patterns of the
    uint64 keys), on their device (torch form of `exponential_noise_np`)."""
    z = keys[:, None] + index[None, :] * _signed(GOLDEN)
    scratch = torch.empty_like(z)  # with z and the result, the pass's only buffers of the noise's shape
    top = _shift_right(_mix_torch_(z, scratch), 41, scratch).float()
    return top.mul_(2).add_(1).mul_(2.0**-24).log_().neg_()
