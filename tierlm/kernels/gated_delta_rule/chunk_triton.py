"""The chunked gated delta rule as one Triton kernel over a whole prefill batch (varlen, pooled states).

Same signature and math as `chunk.chunk_gated_delta_rule_varlen` (the torch reference): packed
sequences [N, ...] split by cu_seqlens, each starting from its pool slot's state and leaving its final
state there. The decomposition is flash-linear-attention's chunk algorithm, fused into one pass:
one program per (value-column block, value head, sequence) keeps its fp32 state columns S [Dk, BV] in
registers and walks the sequence's chunks of C = 64 tokens in order. Per chunk, with G the cumulative
log decay and A_ts = beta_t e^(G_t - G_s) k_t.k_s (s < t):
  T  = (I + A)^-1                       forward substitution, row by row (the UT transform)
  W  = T (beta e^G K),  U = T (beta V) - W S     the WY form: each token's update, given S
  O  = (Q e^G) S + (tril(Q K^T) e^(G_t - G_s)) U
  S <- e^(G_last) S + (K e^(G_last - G))^T U
Tokens past a sequence's end load as zeros with g = 0 and beta = 0, which leaves U, S and G_last
exactly as if the chunk were short. Every product is fp32 (`input_precision="ieee"`: TF32 would cost
the state ~1e-3 relative per chunk). Value head h reads key head h // (Hv / Hk): keys are not repeated.
The WY work of a chunk is recomputed by each column block (Dv / BV of them); in exchange there is no
scratch memory and one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_SIZE = 64
COLUMN_BLOCK = 32  # value columns per program: 48 heads x 128 / 32 = 192 programs per sequence


@triton.jit
def _chunk_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, state_ptr, indices_ptr, out_ptr,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr):
    column_block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(indices_ptr + seq).to(tl.int64)
    key_head = head // GROUP
    dk = tl.arange(0, BK)
    dv = column_block * BV + tl.arange(0, BV)
    k_inside, v_inside = dk < DK, dv < DV
    rows = tl.arange(0, BC)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    identity = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    state_at = state_ptr + (slot * HV + head) * DK * DV + dk[:, None] * DV + dv[None, :]
    state_mask = k_inside[:, None] & v_inside[None, :]
    state = tl.load(state_at, mask=state_mask, other=0.0)
    for start in range(bos, eos, BC):
        t = start + rows
        inside = t < eos
        key_at = (t[:, None] * (HV // GROUP) + key_head) * DK + dk[None, :]
        key_mask = inside[:, None] & k_inside[None, :]
        q = tl.load(q_ptr + key_at, mask=key_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + key_at, mask=key_mask, other=0.0).to(tl.float32)
        value_at = (t[:, None] * HV + head) * DV + dv[None, :]
        value_mask = inside[:, None] & v_inside[None, :]
        v = tl.load(v_ptr + value_at, mask=value_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * HV + head, mask=inside, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * HV + head, mask=inside, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, 0)  # G_t; padding adds 0, so the last row holds the chunk's total
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        a = tl.where(strict, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision="ieee"), 0.0)
        inverse = identity  # row i of (I + A)^-1 = e_i - sum_{s<i} A_is row s
        for i in range(1, BC):
            a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
            new_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, 0)
            inverse = tl.where(rows[:, None] == i, new_row[None, :], inverse)
        growth = tl.exp(cum)
        w = tl.dot(inverse, k * (beta * growth)[:, None], input_precision="ieee")
        u = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
        u = u - tl.dot(w, state, input_precision="ieee")
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        out = tl.dot(q * growth[:, None], state, input_precision="ieee") + tl.dot(scores, u, input_precision="ieee")
        tl.store(out_ptr + value_at, out, mask=value_mask)
        last = tl.sum(tl.where(rows == BC - 1, cum, 0.0), 0)
        carried = k * tl.exp(last - cum)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(carried), u, input_precision="ieee")
    tl.store(state_at, state, mask=state_mask)


def triton_chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """As `chunk.chunk_gated_delta_rule_varlen` (shapes there), in one launch; state_pool updated in place.

    The slots of state_indices must be distinct (each program owns its sequence's state columns).
    """
    n, num_key_heads, dk = k.shape
    num_value_heads, dv = v.shape[1:]
    if state_pool.dtype != torch.float32:
        raise ValueError(f"the state pool must be fp32, got {state_pool.dtype}")
    if num_value_heads % num_key_heads:
        raise ValueError(f"value heads ({num_value_heads}) must be a multiple of key heads ({num_key_heads})")
    if state_pool.shape[1:] != (num_value_heads, dk, dv) or not state_pool.is_contiguous():
        raise ValueError(f"state pool {tuple(state_pool.shape)} is not a contiguous [P, {num_value_heads}, {dk}, {dv}]")
    out = torch.empty(n, num_value_heads, dv, dtype=torch.float32, device=v.device)
    num_seqs = state_indices.shape[0]
    if n == 0 or num_seqs == 0:
        return out
    block_v = max(16, min(COLUMN_BLOCK, triton.next_power_of_2(dv)))
    grid = (triton.cdiv(dv, block_v), num_value_heads, num_seqs)
    _chunk_rule_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), cu_seqlens.contiguous(),
        state_pool, state_indices.contiguous(), out,
        HV=num_value_heads, GROUP=num_value_heads // num_key_heads, DK=dk, DV=dv,
        BK=max(16, triton.next_power_of_2(dk)), BV=block_v, BC=CHUNK_SIZE, num_warps=4, num_stages=1,
    )
    return out
