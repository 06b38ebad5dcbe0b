"""The MoE router as one Triton launch (same signature as `naive.route_and_gate`), for decode batches.

The router weight ([E + 1, H]: 2.6 MB at E = 512, H = 2560) is read once for up to BLOCK_N tokens, one
[BLOCK_E, BLOCK_K] tile per program (165 programs at the real widths; no loop, so every program's loads
are in flight at once: a decode GEMV this small is bound by load latency, not by arithmetic). Two levels
of arrival (`split_reduce.arrival_counters`) finish it in the same launch:
  1. each program stores its fp32 partial logits; the last of a row block's K slices to arrive adds
     them into the block's logits;
  2. the last row block to arrive rounds the logits to x's dtype (what F.linear returns) and does the
     softmax (fp32), the top-k (k passes of a row max; an exact tie goes to the lower expert id, the set
     CUDA's torch.topk takes), the renormalisation and the shared gate's sigmoid.
No host sync, so a CUDA graph captures it. Up to MAX_TOKENS tokens (a weight read per BLOCK_N of them):
prefill chunks take the reference's GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.moe_router.naive import check_router_args
from tierlm.kernels.quant_linear.triton import dot_precision, round_to
from tierlm.kernels.split_reduce import arrival_counters, dot_acc

MAX_TOKENS = 64
BLOCK_N = 16  # tokens per program: tl.dot's least M
BLOCK_E = 16  # weight rows per program
BLOCK_K = 512  # input columns per program: 33 row blocks x 5 slices at the real widths
NUM_WARPS = 8


@triton.jit
def _route_token_block(logits_ptr, weights_ptr, ids_ptr, gate_ptr, tokens, t_mask, NUM_EXPERTS: tl.constexpr,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_ALL: tl.constexpr, BLOCK_TOPK: tl.constexpr, DTYPE: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Softmax, top-k, renormalisation and the gate of a token block's fp32 logits [token, E + 1] (read
    past L1, .cg: other programs wrote them)."""
    experts = tl.arange(0, BLOCK_ALL)
    e_mask = experts < NUM_EXPERTS
    rows = tokens.to(tl.int64) * (NUM_EXPERTS + 1)
    logits = tl.load(logits_ptr + rows[:, None] + experts[None, :], mask=t_mask[:, None] & e_mask[None, :],
                     other=0.0, cache_modifier=".cg")
    gate = tl.load(logits_ptr + rows + NUM_EXPERTS, mask=t_mask, other=0.0, cache_modifier=".cg")
    logits = tl.where(e_mask[None, :], round_to(logits, DTYPE, PRECISION).to(tl.float32), float("-inf"))
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = shifted / tl.sum(shifted, axis=1)[:, None]
    probs = tl.where(e_mask[None, :], probs, -1.0)  # below every probability: never chosen
    slots = tl.arange(0, BLOCK_TOPK)
    chosen = tl.zeros((BLOCK_N, BLOCK_TOPK), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_N, BLOCK_TOPK), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best, best_id = tl.max(probs, axis=1, return_indices=True, return_indices_tie_break_left=True)
        chosen = tl.where(slots[None, :] == j, best[:, None], chosen)
        chosen_ids = tl.where(slots[None, :] == j, best_id[:, None], chosen_ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -2.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]  # the unused slots hold 0
    out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = t_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, round_to(chosen, DTYPE, PRECISION), mask=out_mask)
    tl.store(ids_ptr + out, chosen_ids.to(tl.int64), mask=out_mask)
    gate = tl.sigmoid(round_to(gate, DTYPE, PRECISION).to(tl.float32))
    tl.store(gate_ptr + tokens, round_to(gate, DTYPE, PRECISION), mask=t_mask)


@triton.jit
def _router_kernel(x_ptr, w_ptr, partial_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, gate_ptr, n_tokens,
                   stride_x, HIDDEN: tl.constexpr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                   RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_ALL: tl.constexpr, BLOCK_TOPK: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row block, K slice, token block): the [BLOCK_N, BLOCK_E] partial logits of one weight
    tile. Counters per token block: one per row block (its slices), then one over the row blocks."""
    row_block, k_slice, token_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_row_blocks, num_slices = tl.num_programs(0), tl.num_programs(1)
    tokens = token_block * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < n_tokens
    rows = row_block * BLOCK_E + tl.arange(0, BLOCK_E)
    r_mask = rows < NUM_EXPERTS + 1
    columns = k_slice * BLOCK_K + tl.arange(0, BLOCK_K)
    c_mask = columns < HIDDEN
    x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_x + columns[None, :],
                mask=t_mask[:, None] & c_mask[None, :], other=0.0)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * HIDDEN + columns[None, :],
                mask=r_mask[:, None] & c_mask[None, :], other=0.0)
    acc = dot_acc(tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32), x, w, PRECISION)
    out_mask = t_mask[:, None] & r_mask[None, :]
    tl.store(partial_ptr + (tokens.to(tl.int64)[:, None] * num_slices + k_slice) * (NUM_EXPERTS + 1) + rows[None, :],
             acc, mask=out_mask)
    counters = counter_ptr + token_block * (num_row_blocks + 1)
    tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
    if tl.atomic_add(counters + row_block, 1, sem="acq_rel") == num_slices - 1:
        logits = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
        for s in range(num_slices):
            logits += tl.load(partial_ptr + (tokens.to(tl.int64)[:, None] * num_slices + s) * (NUM_EXPERTS + 1)
                              + rows[None, :], mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.store(logits_ptr + tokens.to(tl.int64)[:, None] * (NUM_EXPERTS + 1) + rows[None, :], logits, mask=out_mask)
        tl.atomic_xchg(counters + row_block, 0)  # ready for the next launch
        tl.debug_barrier()
        if tl.atomic_add(counters + num_row_blocks, 1, sem="acq_rel") == num_row_blocks - 1:
            _route_token_block(logits_ptr, weights_ptr, ids_ptr, gate_ptr, tokens, t_mask, NUM_EXPERTS, TOP_K,
                               RENORMALIZE, BLOCK_N, BLOCK_ALL, BLOCK_TOPK, x_ptr.dtype.element_ty, PRECISION)
            tl.atomic_xchg(counters + num_row_blocks, 0)


def route_and_gate(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `naive.route_and_gate`, for up to MAX_TOKENS tokens, in one launch."""
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
    row_blocks, slices = triton.cdiv(rows, BLOCK_E), triton.cdiv(hidden, BLOCK_K)
    partial = torch.empty(n, slices, rows, dtype=torch.float32, device=x.device)
    logits = torch.empty(n, rows, dtype=torch.float32, device=x.device)
    counters = arrival_counters("moe_router", x.device, triton.cdiv(MAX_TOKENS, BLOCK_N) * (row_blocks + 1))
    _router_kernel[(row_blocks, slices, triton.cdiv(n, BLOCK_N))](
        x, weight, partial, logits, counters, weights, ids, gate, n, x.stride(0), HIDDEN=hidden, NUM_EXPERTS=rows - 1,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_N=BLOCK_N, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K,
        BLOCK_ALL=triton.next_power_of_2(rows - 1), BLOCK_TOPK=triton.next_power_of_2(top_k),
        PRECISION=dot_precision(x), num_warps=NUM_WARPS,
    )
    return weights, ids, gate
