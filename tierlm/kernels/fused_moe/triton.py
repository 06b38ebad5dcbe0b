"""`fused_moe` as Triton kernels (same signature as `naive`), the experts' weight format a compile-time
variant (unquantized, or packed INT4 / INT6 / INT8 with group scales: `quant_linear.packing`).

Three launches for all tokens of a batch, each reading the selected experts' weights in place (no copy
of an expert's weights is ever made):
  1. gate_up: each program takes a block of (token, expert) pairs that share one expert and a block of
     the expert's I columns, and computes silu(x W_gate^T) * (x W_up^T) for them (both products in fp32,
     the weight tiles dequantized in registers), stored in x's dtype as `naive` rounds it;
  2. down: the same over the intermediate, times the pair's routing weight, stored per pair in fp32;
  3. sum: each token's k pair rows added in fp32 in ascending expert id (the reference's order), rounded
     once to x's dtype.
Pairs are grouped by expert in one of two ways (no host sync in either, so a decode step can be captured):
  - decode (up to DECODE_MAX_PAIRS pairs): every pair is its own block of one row; the products are
    broadcast multiplies (no tl.dot padding M to 16). Two pairs on one expert read its weights twice,
    which at 10 of 512 experts per token is rare.
  - prefill: `align_pairs_to_blocks` (vLLM's moe_align_block_size, in torch) sorts the pairs by expert
    into blocks of BLOCK_M rows, each expert's run padded to a whole block; the kernels are then a
    grouped GEMM over those blocks (tl.dot), one expert's weights per block, blocks past the end idle.
Routing order: each token's (expert, weight) slots are first sorted by expert id, so pair p = t * k + s
is token t's s-th smallest expert, and step 3 sums in the reference's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.fused_moe.naive import check_moe_args
from tierlm.kernels.quant_linear.triton import accumulate_tile, column_mask, dot_precision, round_to

# Tile sizes (module constants so a benchmark can sweep them; not tuned on a GPU yet)
DECODE_MAX_PAIRS = 64  # up to this many (token, expert) pairs, one-row blocks and broadcast products
DECODE_BLOCK_N, DECODE_BLOCK_K, DECODE_NUM_WARPS = 32, 128, 4
PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, PREFILL_NUM_WARPS = 32, 64, 64, 4
SUM_BLOCK = 256


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, H, I,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_op,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: the pairs of block pid(0) (all on one expert; ids >= num_pairs are padding), columns
    [pid(1) * BLOCK_N, +BLOCK_N) of I. out[pair, n] = silu(gate) * up, gate = x W[e, n], up = x W[e, I + n]."""
    block, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        tokens = (pairs // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        gate_w, gate_s = w_ptr + expert * stride_we, s_ptr + expert * stride_se
        up_w, up_s = gate_w + I * stride_wn, gate_s + I * stride_sn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                        mask=valid[:, None] & column_mask(offs_k, H, EVEN_K)[None, :], other=0.0)
            gate = accumulate_tile(gate, a, gate_w, gate_s, k0, offs_n, n_mask, stride_wn, stride_sn, H, BITS,
                                   GROUP_SIZE, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION)
            up = accumulate_tile(up, a, up_w, up_s, k0, offs_n, n_mask, stride_wn, stride_sn, H, BITS,
                                 GROUP_SIZE, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION)
        act = gate / (1.0 + tl.exp(-gate)) * up
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_op + offs_n[None, :]
        tl.store(out_ptrs, round_to(act, out_ptr.dtype.element_ty, PRECISION), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, routing_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, H, I,
    stride_ap, stride_we, stride_wn, stride_se, stride_sn, stride_op,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program: the pairs of block pid(0), columns [pid(1) * BLOCK_N, +BLOCK_N) of H.
    out[pair, h] = routing[pair] * (act[pair] W_down[e, h]), in fp32."""
    block, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = pairs.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        w_e, s_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + rows[:, None] * stride_ap + offs_k[None, :],
                        mask=valid[:, None] & column_mask(offs_k, I, EVEN_K)[None, :], other=0.0)
            acc = accumulate_tile(acc, a, w_e, s_e, k0, offs_n, n_mask, stride_wn, stride_sn, I, BITS, GROUP_SIZE,
                                  BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION)
        routing = tl.load(routing_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + rows[:, None] * stride_op + offs_n[None, :]
        tl.store(out_ptrs, acc * routing[:, None], mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _sum_pairs_kernel(pair_out_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      PRECISION: tl.constexpr):
    """out[t, h] = sum over s < TOP_K, in order, of pair_out[t * TOP_K + s, h] (fp32), rounded once."""
    token, pid_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = pid_h * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in range(TOP_K):
        acc += tl.load(pair_out_ptr + (token * TOP_K + slot) * H + offs, mask=mask, other=0.0)
    tl.store(out_ptr + token * H + offs, round_to(acc, out_ptr.dtype.element_ty, PRECISION), mask=mask)


def align_pairs_to_blocks(expert_of_pair: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the pairs by expert into blocks of block_m rows (vLLM's moe_align_block_size), in torch
    without a host sync. expert_of_pair [P] -> (pair_ids [B * block_m]: pair indices, each expert's run
    padded to whole blocks with P; block_expert [B]: the expert of each block, -1 past the last run).
    B is the bound P + min(E, P) * (block_m - 1) rows in blocks, so no count comes back to the host.
    Within an expert, pairs keep their order (token order)."""
    num_pairs = expert_of_pair.numel()
    device = expert_of_pair.device
    experts = expert_of_pair.to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    run_ends = padded.cumsum(0)
    order = torch.sort(experts, stable=True).indices  # pairs grouped by expert
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[(run_ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(run_ends, block_starts, right=True)  # the run holding the block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, format: str = "unquantized", scales=None, group_size: int | None = None
              ) -> torch.Tensor:
    """As `naive.fused_moe` (see there for shapes and formats). topk_ids must lie in [0, E): they are not
    checked here (that would cost a host sync)."""
    bits, inter, group = check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids, format, scales, group_size)
    t, h = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    gate_up_scales, down_scales = (w_gate_up, w_down) if bits is None else (s.contiguous() for s in scales)
    topk_ids, order = topk_ids.sort(dim=1)  # each token's experts in ascending id: the sum's order
    routing = topk_weights.gather(1, order).flatten()

    expert_of_pair = topk_ids.flatten()
    if num_pairs <= DECODE_MAX_PAIRS:
        block_m, block_n, block_k, use_dot, warps = 1, DECODE_BLOCK_N, DECODE_BLOCK_K, False, DECODE_NUM_WARPS
        pair_ids = torch.arange(num_pairs, dtype=torch.int32, device=x.device)
        block_expert = expert_of_pair.to(torch.int32)
    else:
        block_m, block_n, block_k, use_dot = PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_BLOCK_K, True
        warps = PREFILL_NUM_WARPS
        pair_ids, block_expert = align_pairs_to_blocks(expert_of_pair, w_gate_up.shape[0], block_m)
    num_blocks = block_expert.numel()
    gate_up_k, down_k = (min(block_k, max(16, triton.next_power_of_2(k))) for k in (h, inter))
    common = {"BITS": bits or 0, "GROUP_SIZE": group, "BLOCK_M": block_m, "BLOCK_N": block_n, "USE_DOT": use_dot,
              "PRECISION": dot_precision(x), "num_warps": warps}

    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, gate_up_scales, act, pair_ids, block_expert, num_pairs, h, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), gate_up_scales.stride(0), gate_up_scales.stride(1),
        act.stride(0), TOP_K=top_k, BLOCK_K=gate_up_k, EVEN_K=h % gate_up_k == 0, **common,
    )
    pair_out = torch.empty((num_pairs, h), dtype=torch.float32, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(h, block_n))](
        act, w_down, down_scales, routing, pair_out, pair_ids, block_expert, num_pairs, h, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), down_scales.stride(0), down_scales.stride(1),
        pair_out.stride(0), BLOCK_K=down_k, EVEN_K=inter % down_k == 0, **common,
    )
    out = torch.empty_like(x)
    _sum_pairs_kernel[(t, triton.cdiv(h, SUM_BLOCK))](pair_out, out, h, TOP_K=top_k, BLOCK=SUM_BLOCK,
                                                      PRECISION=dot_precision(x))
    return out
