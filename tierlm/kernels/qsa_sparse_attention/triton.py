"""QSA prefill attention as a Triton kernel that reads each query's selected rows straight from the pool.

Same signature as `naive.sparse_attention`. One program per (query, KV head) holds the nh / nkv query
heads that share the KV head (12 at the target model: one [16, hd] tile, padded) and walks the query's
S selected rows in blocks of ROW_BLOCK: it loads their physical row ids, then K and V of those rows
for its KV head from the pool, and keeps an online softmax (running max, sum and weighted V) in fp32.
Invalid entries are masked out before the softmax and their rows are not loaded. Nothing of size
[queries x rows x hd] is ever materialised; neighbouring queries select mostly the same blocks, so
their loads hit in L2. Products follow the inputs' dtype (`products`): fp32 inputs multiply in full fp32
("ieee", no TF32); bf16 inputs multiply bf16 x bf16 into fp32 for the scores (exact products) and the
fp32 softmax weights by V in TF32 (weights rounded to 10 mantissa bits, not bf16's 7: rounding them to
bf16, as flash attention does, doubled the error against an fp32 computation of the same inputs).

With `with_lse` it also returns each (query, head)'s log-sum-exp of its scaled scores, so attention over
a set of rows can be computed in parts and merged (`naive.merge_parts`): the offloaded prefill
(`model/qsa_offload.py`) stages a chunk's rows into the device arena a part at a time when they do not fit
at once. A query with no valid entry in a part gets zeros and a log-sum-exp of -inf.

It runs in prefill only, and is launched with programmatic dependent launch like the decode kernels
(`kernels/dependent_launch`), for uniformity: it has no constants to load early, so it waits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs

ROW_BLOCK = 32


@triton.jit
def _sparse_attention_kernel(q_ptr, key_ptr, value_ptr, rows_ptr, valid_ptr, out_ptr, lse_ptr, num_selected, scale,
                             NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, BG: tl.constexpr,
                             BD: tl.constexpr, BS: tl.constexpr, PRODUCTS: tl.constexpr, WITH_LSE: tl.constexpr,
                             PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    query, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    group = NH // NKV
    heads = tl.arange(0, BG)
    columns = tl.arange(0, BD)
    head_inside, column_inside = heads < group, columns < HD
    q_at = (query * NH + kv_head * group + heads[:, None]) * HD + columns[None, :]
    q_mask = head_inside[:, None] & column_inside[None, :]
    q = tl.load(q_ptr + q_at, mask=q_mask, other=0.0)
    running_max = tl.full((BG,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, BD), tl.float32)
    for first in range(0, num_selected, BS):
        entries = first + tl.arange(0, BS)
        in_range = entries < num_selected
        ok = tl.load(valid_ptr + query * num_selected + entries, mask=in_range, other=0) != 0
        row = tl.load(rows_ptr + query * num_selected + entries, mask=ok, other=0)
        row_at = (row[:, None] * NKV + kv_head) * HD + columns[None, :]
        row_mask = ok[:, None] & column_inside[None, :]
        keys = tl.load(key_ptr + row_at, mask=row_mask, other=0.0)
        values = tl.load(value_ptr + row_at, mask=row_mask, other=0.0)
        if PRODUCTS == "native":
            scores = tl.dot(q, tl.trans(keys))
        else:
            scores = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing valid yet: no NaN from -inf - -inf
        weights = tl.exp(scores - safe_max[:, None])
        rescale = tl.exp(running_max - safe_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        if PRODUCTS == "native":  # the weights keep TF32's 10 mantissa bits; bf16 values are exact in TF32
            acc = acc * rescale[:, None] + tl.dot(weights, values.to(tl.float32), input_precision="tf32")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights, values.to(tl.float32), input_precision="ieee")
        running_max = new_max
    if WITH_LSE:  # a part may hold no valid entry of this query: zeros, and -inf
        seen = running_sum > 0
        out = acc / tl.where(seen, running_sum, 1.0)[:, None]
        lse = tl.where(seen, running_max + tl.log(tl.where(seen, running_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + query * NH + kv_head * group + heads, lse, mask=head_inside)
    else:
        out = acc / running_sum[:, None]
    tl.store(out_ptr + q_at, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def products(q: torch.Tensor) -> str:
    """How the kernel multiplies: "ieee" (fp32 inputs, full fp32), "native" (a GPU with bf16 / fp16 inputs:
    scores from the 16-bit operands, weights x V in TF32) or "interpreter" (the CPU, whose tl.dot
    multiplies bf16 operands' raw bits in triton 3.9: operands widened to fp32 first, the same exact score
    products; weights x V in full fp32, the interpreter having no TF32)."""
    if q.dtype == torch.float32:
        return "ieee"
    return "interpreter" if q.device.type == "cpu" else "native"


def triton_sparse_attention(
    q: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As `naive.sparse_attention` (shapes there), reading the rows in place; one launch. with_lse: also
    each (query, head)'s log-sum-exp [M, nh], and the output in fp32 (see the module docstring)."""
    m, num_heads, head_dim = q.shape
    num_kv_heads = key_rows.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if rows.shape != valid.shape or rows.shape[0] != m:
        raise ValueError(f"rows {tuple(rows.shape)} and valid {tuple(valid.shape)} must both be [{m}, S]")
    if key_rows.dtype != q.dtype or value_rows.dtype != q.dtype:
        raise ValueError(f"q, keys and values must share a dtype, got {q.dtype}, {key_rows.dtype}, {value_rows.dtype}")
    if not (key_rows.is_contiguous() and value_rows.is_contiguous()):
        raise ValueError("key_rows and value_rows must be contiguous [R, nkv, hd] views of the pools")
    mode = products(q)
    # the interpreter truncates fp32 -> bf16 stores; there the kernel writes fp32 and torch rounds (to nearest)
    fp32_out = mode == "interpreter" or with_lse
    out = torch.empty(q.shape, dtype=torch.float32 if fp32_out else q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if with_lse else out
    if m > 0:
        _sparse_attention_kernel[(m, num_kv_heads)](
            q.contiguous(), key_rows, value_rows, rows.contiguous(), valid.contiguous().view(torch.uint8), out,
            lse, rows.shape[1], scale, NH=num_heads, NKV=num_kv_heads, HD=head_dim,
            BG=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
            BD=max(16, triton.next_power_of_2(head_dim)), BS=ROW_BLOCK, PRODUCTS=mode, WITH_LSE=with_lse,
            num_warps=4, num_stages=2, **launch_options(q.device),
        )
    return (out, lse) if with_lse else out.to(q.dtype)
