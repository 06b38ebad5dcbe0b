"""The chunked gated delta rule as Triton kernels over a whole prefill batch (varlen, pooled states).

Same signature and math as `chunk.chunk_gated_delta_rule_varlen` (the torch reference): packed
sequences [N, ...] split by cu_seqlens, each starting from its pool slot's state and leaving its final
state there. The decomposition is flash-linear-attention's chunk algorithm, in two launches. With
G the cumulative log decay over a chunk of C = 64 tokens and A_ts = beta_t e^(G_t - G_s) k_t.k_s (s < t):
  T  = (I + A)^-1       first launch, one program per (chunk, value head) of the whole batch: forward
                        substitution row by row (the UT transform); chunks do not depend on each other
Then one program per (value-column block, value head, sequence) keeps its fp32 state columns S [Dk, BV]
in registers and walks the sequence's chunks in order:
  W  = T (beta e^G K),  U = T (beta V) - W S     the WY form: each token's update, given S
  O  = (Q e^G) S + (tril(Q K^T) e^(G_t - G_s)) U
  S <- e^(G_last) S + (K e^(G_last - G))^T U
Tokens past a sequence's end load as zeros with g = 0 and beta = 0, which leaves U, S and G_last
exactly as if the chunk were short. Products are fp32-accurate: on a GPU "tf32x3" (each fp32 operand
split into two TF32 parts, three tensor-core products: ~fp32 error; plain TF32 keeps 10 mantissa bits,
and the state would carry that rounding from chunk to chunk), in the interpreter "ieee". Full-fp32 FMA
dots ("ieee") over Dk = 128 do not fit the registers on sm_90: ptxas (triton 3.9, compiled here for
sm_90a without a GPU) fell back to 32 registers and a 7-15 KB stack per thread; with tf32x3 the
inverse kernel has no spills and the state kernel 255 registers + 3.2 KB of stack at 4 warps (the
output's Q K^T and Q S are most of it: splitting them into a third, parallel kernel is the next step). Value head h reads key head h // (Hv / Hk): keys are not repeated.
T goes through memory (C*C fp32 per chunk and value head: 16 KiB, 200 MB for an 8k-token chunk at 48
heads); W is recomputed by each column block (Dv / BV of them).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

CHUNK_SIZE = 64
COLUMN_BLOCK = 32  # value columns per program: 48 heads x 128 / 32 = 192 programs per sequence


@triton.jit
def _chunk_decay(g_ptr, t, inside, head, HV: tl.constexpr):
    """G_t, the cumulative log decay over a chunk's rows (padding adds 0: the last row holds the total)."""
    g = tl.load(g_ptr + t * HV + head, mask=inside, other=0.0).to(tl.float32)
    return tl.cumsum(g, 0)


@triton.jit
def _chunk_inverse_kernel(k_ptr, g_ptr, beta_ptr, chunk_starts_ptr, chunk_ends_ptr, inverse_ptr,
                          HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
                          BC: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (chunk, value head): T = (I + A)^-1 into inverse [chunks, HV, BC, BC] fp32.

    Forward substitution, row by row: row i of T is e_i - sum_{s<i} A_is (row s of T). Chunks are
    independent, so this sequential part runs in parallel over the whole batch, off the state's path."""
    chunk, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = tl.load(chunk_starts_ptr + chunk).to(tl.int64)
    end = tl.load(chunk_ends_ptr + chunk).to(tl.int64)
    rows = tl.arange(0, BC)
    dk = tl.arange(0, BK)
    t = start + rows
    inside = t < end
    k = tl.load(k_ptr + (t[:, None] * (HV // GROUP) + head // GROUP) * DK + dk[None, :],
                mask=inside[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * HV + head, mask=inside, other=0.0).to(tl.float32)
    cum = _chunk_decay(g_ptr, t, inside, head, HV)
    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, cum[:, None] - cum[None, :], float("-inf")))
    a = tl.where(strict, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision=PRECISION), 0.0)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, tl.minimum(end - start, BC)):  # padding rows stay rows of I
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
        new_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, 0)
        inverse = tl.where(rows[:, None] == i, new_row[None, :], inverse)
    tl.store(inverse_ptr + ((chunk * HV + head) * BC + rows[:, None]) * BC + rows[None, :], inverse)


@triton.jit
def _chunk_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, first_chunk_ptr, inverse_ptr, state_ptr,
                       indices_ptr, out_ptr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                       PRECISION: tl.constexpr):
    """One program per (value-column block, value head, sequence): the sequence's chunks in order, the
    state's columns in registers."""
    column_block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    chunk = tl.load(first_chunk_ptr + seq).to(tl.int64)
    slot = tl.load(indices_ptr + seq).to(tl.int64)
    key_head = head // GROUP
    dk = tl.arange(0, BK)
    dv = column_block * BV + tl.arange(0, BV)
    k_inside, v_inside = dk < DK, dv < DV
    rows = tl.arange(0, BC)
    causal = rows[:, None] >= rows[None, :]
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
        beta = tl.load(beta_ptr + t * HV + head, mask=inside, other=0.0).to(tl.float32)
        cum = _chunk_decay(g_ptr, t, inside, head, HV)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        inverse = tl.load(inverse_ptr + ((chunk * HV + head) * BC + rows[:, None]) * BC + rows[None, :])
        growth = tl.exp(cum)
        w = tl.dot(inverse, k * (beta * growth)[:, None], input_precision=PRECISION)
        u = tl.dot(inverse, v * beta[:, None], input_precision=PRECISION)
        u = u - tl.dot(w, state, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        out = tl.dot(q * growth[:, None], state, input_precision=PRECISION) + tl.dot(scores, u, input_precision=PRECISION)
        tl.store(out_ptr + value_at, out, mask=value_mask)
        last = tl.sum(tl.where(rows == BC - 1, cum, 0.0), 0)
        carried = k * tl.exp(last - cum)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(carried), u, input_precision=PRECISION)
        chunk += 1
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
    # the chunks of every sequence, in order (one host read of cu_seqlens)
    bounds = cu_seqlens.tolist()
    starts, ends, first_chunk = [], [], []
    for bos, eos in itertools.pairwise(bounds):
        if eos <= bos:
            raise ValueError(f"cu_seqlens {bounds} has an empty or decreasing sequence")
        first_chunk.append(len(starts))
        starts.extend(range(bos, eos, CHUNK_SIZE))
        ends.extend([eos] * len(range(bos, eos, CHUNK_SIZE)))
    as_long = {"dtype": torch.int64, "device": v.device}
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    heads = {"HV": num_value_heads, "GROUP": num_value_heads // num_key_heads, "DK": dk,
             "BK": max(16, triton.next_power_of_2(dk)), "BC": CHUNK_SIZE,
             "PRECISION": "ieee" if v.device.type == "cpu" else "tf32x3"}
    inverse = torch.empty(len(starts), num_value_heads, CHUNK_SIZE, CHUNK_SIZE, dtype=torch.float32, device=v.device)
    _chunk_inverse_kernel[(len(starts), num_value_heads)](
        k, g, beta, torch.tensor(starts, **as_long), torch.tensor(ends, **as_long), inverse, **heads, num_warps=4,
    )
    block_v = max(16, min(COLUMN_BLOCK, triton.next_power_of_2(dv)))
    _chunk_rule_kernel[(triton.cdiv(dv, block_v), num_value_heads, num_seqs)](
        q, k, v, g, beta, cu_seqlens.contiguous(), torch.tensor(first_chunk, **as_long), inverse, state_pool,
        state_indices.contiguous(), out, DV=dv, BV=block_v, **heads, num_warps=4, num_stages=1,
    )
    return out
