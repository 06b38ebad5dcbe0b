"""Zeroed int32 arrival counters for kernels whose last program to finish does a final step.

A kernel that splits a small reduction over many programs (to read its weights at full bandwidth) and
then needs the whole result (a top-k over all experts, a norm over all streams) can finish in the same
launch: each program stores its partial result, then atomically counts itself in; the program that
arrives last sees every partial and does the final step, then sets the counter back to zero. So the
counters must start at zero and each kernel leaves them at zero: one small tensor per (device, owner),
made once, outside any CUDA graph capture (static decode warms up eagerly before it captures), and
reused by every launch and every replay. Launches on one stream run one after another, so one set of
counters per owner suffices.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 counters on `device`, the same tensor on every call for `owner`."""
    key = (owner, torch.device(device))
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if _capturing(device):
            raise RuntimeError(f"{owner}: its arrival counters must be made before a CUDA graph capture (run the "
                               "forward once eagerly first)")
        counters = torch.zeros(max(count, 8), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def _capturing(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
