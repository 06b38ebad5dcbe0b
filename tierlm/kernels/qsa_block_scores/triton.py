"""QSA block scores as Triton kernels: decode (same signature as `naive.block_scores`) and prefill (as
`naive.request_scores`).

Decode, one program per (request, tile of BLOCK_G compressed keys): it loads the request's block ids for the
tile, the keys they hold (only those the query sees: masked loads read nothing past nb = (p+1)//R), and
the request's ih query heads, and writes sum_h relu(q_h . K_j) / sqrt(id), or -inf. The products are one
tl.dot of the [BLOCK_G, id] keys by the heads padded to 16 (tensor cores; fp32 accumulation, IEEE for
fp32 inputs): the broadcast multiply and sum over id it replaced was bound by its instructions, not its
bytes. Nothing is gathered into a [B, G, id] copy, and a short request in a batch with a long one costs
its own length in memory traffic. With skip_up_to (the selection's block budget), a request that sees at
most that many blocks (it chooses them all, whatever they score) reads and writes nothing. Equal to the
reference up to fp32 summation order (tested under TRITON_INTERPRET=1 on CPU).
Launched with programmatic dependent launch (`kernels/dependent_launch`); it has no weights to load early
(queries, the keys pool, block tables and positions: the step writes or stages them), so it waits first.

Prefill, one program per (tile of a request's queries, tile of its gathered keys): each head's products
one tl.dot of the queries' [BLOCK_Q, id] rows by the [BLOCK_K, id] keys, relu and the heads' sum in
registers, so only the [M, G] scores are written (the torch form writes and reads the products of every
head, [M, ih, G] fp32). A tile whose keys no query of its tile sees is written -inf without a load.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.quant_linear.triton import dot_precision
from tierlm.kernels.split_reduce import dot_acc

# tiles: on an H200 (a scratch sweep of 32-256 keys x 4 and 8 warps at 8k-262k contexts, batches 1-16, against the
# multiply-and-sum form: 1.47-3.25x, bench/results/qsa_block_scores_ab_nvidia-h200.txt), 128 x 4 the fastest in 5 of
# the 9 cells (8k batch 16, 65k batches 1 and 16, 262k batches 4 and 16), 64 x 4 or 32 x 4 in the others
BLOCK_G = 128  # compressed keys per program
SCORE_WARPS = 4
DOT_MIN = 16  # tl.dot's least size of each dimension on a GPU
# the prefill form's tiles (queries x keys a program) and warps: chosen, not swept (long_prefill.py times the whole)
REQUEST_BLOCK_Q = 32
REQUEST_BLOCK_K = 128
REQUEST_WARPS = 4


@triton.jit
def _block_scores_kernel(q_ptr, keys_ptr, tables_ptr, positions_ptr, out_ptr, table_stride, num_groups, sqrt_dim,
                         skip_up_to, RATIO: tl.constexpr, PER_BLOCK: tl.constexpr, N_HEADS: tl.constexpr,
                         HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)  # (before the early return too: see `kernels/dependent_launch`)
    request = tl.program_id(0).to(tl.int64)
    visible = (tl.load(positions_ptr + request) + 1) // RATIO
    if tl.minimum(visible, num_groups) <= skip_up_to:
        return
    groups = tl.program_id(1).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    inside = groups < num_groups
    seen = inside & (groups < visible)
    columns = tl.arange(0, BLOCK_D)
    in_dim = columns < HEAD_DIM
    block = tl.load(tables_ptr + request * table_stride + groups // PER_BLOCK, mask=seen, other=0)
    rows = block * PER_BLOCK + groups % PER_BLOCK
    keys = tl.load(keys_ptr + rows[:, None] * HEAD_DIM + columns[None, :], mask=seen[:, None] & in_dim[None, :],
                   other=0.0)
    heads = tl.arange(0, HEADS_PAD)
    q = tl.load(q_ptr + (request * N_HEADS + heads[:, None]) * HEAD_DIM + columns[None, :],
                mask=(heads < N_HEADS)[:, None] & in_dim[None, :], other=0.0).to(keys.dtype)
    products = dot_acc(tl.zeros([BLOCK_G, HEADS_PAD], dtype=tl.float32), keys, q, PRECISION)  # padded heads: 0
    total = tl.sum(tl.maximum(products, 0.0), axis=1)
    tl.store(out_ptr + request * num_groups + groups, tl.where(seen, total / sqrt_dim, float("-inf")), mask=inside)


def triton_block_scores(
    q: torch.Tensor, index_keys: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, ratio: int,
    skip_up_to: int = -1,
) -> torch.Tensor:
    """As `naive.block_scores`, in one launch and without a host sync (a captured decode step can run it);
    the rows of requests that see at most skip_up_to blocks are left unwritten."""
    batch, heads, dim = q.shape
    per_block = index_keys.shape[1]
    num_groups = block_tables.shape[1] * per_block
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    out = torch.empty(batch, num_groups, dtype=torch.float32, device=q.device)
    grid = (batch, triton.cdiv(num_groups, BLOCK_G))
    _block_scores_kernel[grid](
        q.contiguous(), index_keys.contiguous(), block_tables, positions.contiguous(), out, block_tables.stride(0),
        num_groups, math.sqrt(dim), skip_up_to, RATIO=ratio, PER_BLOCK=per_block, N_HEADS=heads,
        HEADS_PAD=max(triton.next_power_of_2(heads), DOT_MIN), HEAD_DIM=dim,
        BLOCK_D=max(triton.next_power_of_2(dim), DOT_MIN), BLOCK_G=BLOCK_G, PRECISION=dot_precision(index_keys),
        num_warps=SCORE_WARPS, **launch_options(q.device),
    )
    return out


@triton.jit
def _request_scores_kernel(q_ptr, keys_ptr, positions_ptr, out_ptr, num_queries, num_groups, sqrt_dim,
                           RATIO: tl.constexpr, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    queries = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    groups = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_queries = queries < num_queries
    visible = (tl.load(positions_ptr + queries, mask=in_queries, other=0) + 1) // RATIO
    seen = (groups[None, :] < visible[:, None]) & (groups < num_groups)[None, :]
    if tl.program_id(1) * BLOCK_K < tl.max(visible, axis=0):  # else no query of the tile sees a key of it
        columns = tl.arange(0, BLOCK_D)
        in_dim = columns < HEAD_DIM
        keys = tl.load(keys_ptr + groups[:, None] * HEAD_DIM + columns[None, :],
                       mask=(groups < num_groups)[:, None] & in_dim[None, :], other=0.0)
        total = tl.zeros([BLOCK_Q, BLOCK_K], dtype=tl.float32)
        for head in tl.static_range(N_HEADS):
            q = tl.load(q_ptr + (queries[:, None] * N_HEADS + head) * HEAD_DIM + columns[None, :],
                        mask=in_queries[:, None] & in_dim[None, :], other=0.0).to(keys.dtype)
            total += tl.maximum(dot_acc(tl.zeros([BLOCK_Q, BLOCK_K], dtype=tl.float32), q, keys, PRECISION), 0.0)
        scores = tl.where(seen, total / sqrt_dim, float("-inf"))
    else:
        scores = tl.full([BLOCK_Q, BLOCK_K], float("-inf"), dtype=tl.float32)
    tl.store(out_ptr + queries[:, None].to(tl.int64) * num_groups + groups[None, :], scores,
             mask=in_queries[:, None] & (groups < num_groups)[None, :])


def triton_request_scores(q: torch.Tensor, block_keys: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """As `naive.request_scores`, in one launch: programs over (tile of BLOCK_Q queries, tile of BLOCK_K
    keys); a tile no query of which sees any key of is written -inf without a load."""
    m, heads, dim = q.shape
    groups = block_keys.shape[0]
    out = torch.empty(m, groups, dtype=torch.float32, device=q.device)
    if m and groups:
        grid = (triton.cdiv(m, REQUEST_BLOCK_Q), triton.cdiv(groups, REQUEST_BLOCK_K))
        _request_scores_kernel[grid](
            q.contiguous(), block_keys.contiguous(), positions.contiguous(), out, m, groups, math.sqrt(dim),
            RATIO=ratio, N_HEADS=heads, HEAD_DIM=dim, BLOCK_D=max(triton.next_power_of_2(dim), DOT_MIN),
            BLOCK_Q=REQUEST_BLOCK_Q, BLOCK_K=REQUEST_BLOCK_K, PRECISION=dot_precision(block_keys),
            num_warps=REQUEST_WARPS,
        )
    return out
