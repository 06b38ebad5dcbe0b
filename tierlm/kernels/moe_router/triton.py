"""The MoE router as two Triton launches (same signature as `naive.route_and_gate`), for decode batches.

1. Split-K GEMV: the router weight ([E + 1, H]: 2.6 MB at E = 512, H = 2560) is read once for up to BLOCK_N
   tokens, one [BLOCK_E, BLOCK_K] tile per program (165 programs at the real widths; no loop, so every
   program's loads are in flight at once: a decode GEMV this small is bound by load latency, not by
   arithmetic); each program stores its fp32 partial logits. No atomics, no counters.
2. A program per token, one warp (ROUTE_WARPS): the sum of its K slices' partials, the logits rounded to
   x's dtype (what F.linear returns), the softmax (fp32), the top-k (k passes of a row max; an exact tie
   goes to the lower expert id, the set CUDA's torch.topk takes), the renormalisation and the shared gate's
   sigmoid. One warp holds a token's 512 probabilities in registers, so each of the k maxima is a warp
   shuffle, not a round trip through shared memory between warps, and the tokens of a batch run in
   parallel (the one-launch form before did this for a block of 16 tokens in one 8-warp program, behind
   two levels of arrival counters: ~16 us per call on an H200 at batch 1).
No host sync and fixed shapes, so a CUDA graph captures both. Up to MAX_TOKENS tokens (a weight read per
BLOCK_N of them): prefill chunks take the reference's GEMM. Both launch with programmatic dependent launch
(`kernels/dependent_launch`): the GEMV's programs load their weight tile before they wait for x, so the
weight streams in while the kernel before them finishes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.moe_router.naive import check_router_args
from tierlm.kernels.quant_linear.triton import dot_precision, round_to
from tierlm.kernels.split_reduce import dot_acc

MAX_TOKENS = 64
BLOCK_N = 16  # tokens per GEMV program: tl.dot's least M
BLOCK_E = 16  # weight rows per GEMV program
BLOCK_K = 512  # input columns per GEMV program: 33 row blocks x 5 slices at the real widths
GEMV_WARPS = 4  # H200 (bench/decode_fusions.py --sweep-router): 6.4 us at batch 1 vs 7.4 with 8 warps
ROUTE_WARPS = 1


@triton.jit
def _partial_logits_kernel(x_ptr, w_ptr, partial_ptr, n_tokens, stride_x, HIDDEN: tl.constexpr, ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, K slice, token block): partial[token, slice, rows] of one weight tile, the tile
    loaded before `wait_for_inputs` (PDL)."""
    allow_dependents(PDL)
    row_block, k_slice, token_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_slices = tl.num_programs(1)
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    rows = row_block * BLOCK_E + tl.arange(0, BLOCK_E)
    r_mask = rows < ROWS
    columns = k_slice * BLOCK_K + tl.arange(0, BLOCK_K)
    c_mask = columns < HIDDEN
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * HIDDEN + columns[None, :],
                mask=r_mask[:, None] & c_mask[None, :], other=0.0)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + columns[None, :],
                mask=t_mask[:, None] & c_mask[None, :], other=0.0)
    acc = dot_acc(tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32), x, w, PRECISION)
    tl.store(partial_ptr + (tokens.to(tl.int64)[:, None] * num_slices + k_slice) * ROWS + rows[None, :], acc,
             mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _route_kernel(partial_ptr, weights_ptr, ids_ptr, gate_ptr, SLICES: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                  PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program per token: its logits from the slices' partials, then softmax, top-k, renormalisation, gate.
    No weights: it waits first (PDL)."""
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    DTYPE = weights_ptr.dtype.element_ty  # x's
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_ALL)
    e_mask = experts < NUM_EXPERTS
    logits = tl.zeros((BLOCK_ALL,), dtype=tl.float32)
    one = tl.arange(0, 1)
    gate = tl.zeros((1,), dtype=tl.float32)
    for s in tl.static_range(SLICES):  # unrolled: every slice's loads in flight at once
        row = partial_ptr + (token * SLICES + s) * (NUM_EXPERTS + 1)
        logits += tl.load(row + experts, mask=e_mask, other=0.0)
        gate += tl.load(row + NUM_EXPERTS + one)
    logits = tl.where(e_mask, round_to(logits, DTYPE, PRECISION).to(tl.float32), float("-inf"))
    shifted = tl.exp(logits - tl.max(logits, axis=0))
    probs = shifted / tl.sum(shifted, axis=0)
    probs = tl.where(e_mask, probs, -1.0)  # below every probability: never chosen
    slots = tl.arange(0, BLOCK_TOPK)
    chosen = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best, best_id = tl.max(probs, axis=0, return_indices=True, return_indices_tie_break_left=True)
        chosen = tl.where(slots == j, best, chosen)
        chosen_ids = tl.where(slots == j, best_id, chosen_ids)
        probs = tl.where(experts == best_id, -2.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)  # the unused slots hold 0
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, round_to(chosen, DTYPE, PRECISION), mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen_ids.to(tl.int64), mask=slots < TOP_K)
    gate = tl.sigmoid(round_to(gate, DTYPE, PRECISION).to(tl.float32))
    tl.store(gate_ptr + token + one, round_to(gate, DTYPE, PRECISION))


def route_and_gate(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `naive.route_and_gate`, for up to MAX_TOKENS tokens, in two launches."""
    check_router_args(x, weight, top_k)
    n, hidden = x.shape
    rows = weight.shape[0]
    if n > MAX_TOKENS:
        raise ValueError(f"router kernel: {n} tokens, at most {MAX_TOKENS} (larger batches take the reference)")
    weights, ids = x.new_empty(n, top_k), torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    gate = x.new_empty(n, 1)
    if n == 0:
        return weights, ids, gate
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    slices = triton.cdiv(hidden, BLOCK_K)
    partial = torch.empty(n, slices, rows, dtype=torch.float32, device=x.device)
    precision = dot_precision(x)
    _partial_logits_kernel[(triton.cdiv(rows, BLOCK_E), slices, triton.cdiv(n, BLOCK_N))](
        x, weight, partial, n, x.stride(0), HIDDEN=hidden, ROWS=rows, BLOCK_N=BLOCK_N, BLOCK_E=BLOCK_E,
        BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=GEMV_WARPS, **launch_options(x.device),
    )
    _route_kernel[(n,)](
        partial, weights, ids, gate, SLICES=slices, NUM_EXPERTS=rows - 1, TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_ALL=triton.next_power_of_2(rows - 1), BLOCK_TOPK=triton.next_power_of_2(top_k), PRECISION=precision,
        num_warps=ROUTE_WARPS, **launch_options(x.device),
    )
    return weights, ids, gate
