"""Shared by the decode kernels that split a small batch's reduction over many programs (kernels/moe_router,
kernels/hyper_connection, kernels/fused_moe, kernels/quant_linear, kernels/gated_delta_rule): arrival counters, and `dot_acc`.

Arrival counters. A kernel that splits a small reduction over many programs (to read its weights at
full bandwidth) and then needs the whole result (a top-k over all experts, a norm over all streams) can
finish in the same launch: each program stores its partial result, then atomically counts itself in; the program that
arrives last sees every partial and does the final step, then sets the counter back to zero. So the
counters must start at zero and each kernel leaves them at zero: one small tensor per (device, owner),
made once, outside any CUDA graph capture (static decode warms up eagerly before it captures), and
reused by every launch and every replay. Launches on one stream run one after another, so one set of
counters per owner suffices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}
MIN_COUNTERS = 1 << 14  # 64 KB per (owner, device): e.g. GDN decode's requests x key heads up to 1024 x 16


def arrival_counters(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 counters on `device`, the same tensor on every call for `owner` until
    a call needs more: then a larger one (doubling), the old one kept for the process's life, so a CUDA
    graph that captured it keeps a valid address."""
    kept = _COUNTERS.setdefault((owner, torch.device(device)), [])
    if not kept or kept[-1].numel() < count:
        if _capturing(device):
            raise RuntimeError(f"{owner}: {count} arrival counters are more than it has; they must be made before a "
                               "CUDA graph capture (run the forward once eagerly at this size first)")
        size = max(count, MIN_COUNTERS, 2 * kept[-1].numel() if kept else 0)
        kept.append(torch.zeros(size, dtype=torch.int32, device=device))
    return kept[-1]


def _capturing(device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


@triton.jit
def dot_acc(acc, a, b, PRECISION: tl.constexpr):
    """acc + a @ b^T in fp32 (PRECISION: `quant_linear.triton.dot_precision`). The interpreter's tl.dot
    multiplies bf16 operands' raw bits (triton 3.9): there the operands are widened first (exact: a
    product of two bf16 values fits fp32)."""
    if PRECISION == "interpreter":
        result = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        result = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return result
