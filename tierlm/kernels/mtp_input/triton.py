"""`mtp_layer_input` in one Triton launch (same signature as `naive`); CUDA graphs capture it.

A program per (row, BLOCK_N output columns): a first pass over the row's embedding and hidden streams sums
their squares (the two norms' statistics; each program of the row recomputes them: H + hc*H values, cheap
next to the weight tiles), a second pass norms each K tile in fp32, rounds it to the dtype, and
accumulates both products in fp32 (the embedding row against fc_embedding's tile, the hc stream rows
against fc_hidden's, which is loaded once for all of them); each product is rounded, summed in fp32 and
rounded once more, as torch's ops round. Every row reads the weights again (from L2 after the first), so
the model runs it on decode-sized batches only (`model/mtp.py`). Launched with programmatic dependent
launch (`kernels/dependent_launch`): it waits first (its K loop interleaves weight and input loads), and
lets the kernel after it start early.
Its time is the chain of dependent loads a program walks, not its bytes (26 MB of weights at the real
width, ~6 us at an H200's copy bandwidth): both passes take wide tiles (`tiles`: the statistics 1,024
values of each stream a step, the products 8 columns x 256 values, their sums kept per lane and reduced
after the loop), so a program walks 3 + 10 steps at hidden 2560. The first form (32 x 64 tiles, two
passes of 40 steps, a cross-warp sum each step) took 148.6 us at two rows, this one 29.8 (H200,
`bench/mtp_input_kernel.py --baseline`, session 15).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.mtp_input.naive import check_args
from tierlm.kernels.quant_linear.triton import dot_precision, round_to

BLOCK_N = 8  # output columns per program (at most)
BLOCK_K = 256  # input columns per step of the products' K loop (at most)
STATS_BLOCK = 1024  # values of each stream per step of the statistics' loop (at most)


@triton.jit
def _mtp_input_kernel(emb_ptr, hidden_ptr, emb_norm_ptr, hidden_norm_ptr, fc_emb_ptr, fc_hidden_ptr, out_ptr,
                      emb_stride, hidden_stride, fc_emb_stride, fc_hidden_stride, eps, H: tl.constexpr,
                      HC: tl.constexpr, HC_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STATS_BLOCK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    outputs = part * BLOCK_N + tl.arange(0, BLOCK_N)
    outputs_inside = outputs < H
    streams = tl.arange(0, HC_P2)
    streams_inside = streams < HC
    emb_row = emb_ptr + row * emb_stride
    hidden_row = hidden_ptr + row * hidden_stride + streams[:, None] * H  # [HC_P2, 1]

    squares_e = tl.zeros([STATS_BLOCK], tl.float32)
    squares_h = tl.zeros([HC_P2, STATS_BLOCK], tl.float32)
    for k0 in range(0, H, STATS_BLOCK):
        columns = k0 + tl.arange(0, STATS_BLOCK)
        inside = columns < H
        e = tl.load(emb_row + columns, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(hidden_row + columns[None, :], mask=streams_inside[:, None] & inside[None, :], other=0.0)
        h = h.to(tl.float32)
        squares_e += e * e
        squares_h += h * h
    inverse_e = tl.rsqrt(tl.sum(squares_e, axis=0) / H + eps)
    inverse_h = tl.rsqrt(tl.sum(tl.sum(squares_h, axis=1), axis=0) / (HC * H) + eps)

    # products summed over K per lane, the lanes reduced once after the loop (not a cross-warp sum a step)
    total_e = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    total_h = tl.zeros([HC_P2, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        columns = k0 + tl.arange(0, BLOCK_K)
        inside = columns < H
        both = streams_inside[:, None] & inside[None, :]
        e = tl.load(emb_row + columns, mask=inside, other=0.0).to(tl.float32)
        scale_e = 1.0 + tl.load(emb_norm_ptr + columns, mask=inside, other=0.0).to(tl.float32)
        e = round_to(e * inverse_e * scale_e, dtype, PRECISION).to(tl.float32)
        h = tl.load(hidden_row + columns[None, :], mask=both, other=0.0).to(tl.float32)
        scale_h = 1.0 + tl.load(hidden_norm_ptr + streams[:, None] * H + columns[None, :], mask=both,
                                other=0.0).to(tl.float32)
        h = round_to(h * inverse_h * scale_h, dtype, PRECISION).to(tl.float32)
        tile = outputs_inside[:, None] & inside[None, :]
        w_e = tl.load(fc_emb_ptr + outputs[:, None] * fc_emb_stride + columns[None, :], mask=tile, other=0.0)
        w_h = tl.load(fc_hidden_ptr + outputs[:, None] * fc_hidden_stride + columns[None, :], mask=tile, other=0.0)
        total_e += w_e.to(tl.float32) * e[None, :]
        total_h += w_h.to(tl.float32)[None, :, :] * h[:, None, :]
    e_out = round_to(tl.sum(total_e, axis=1), dtype, PRECISION).to(tl.float32)
    u = round_to(tl.sum(total_h, axis=2), dtype, PRECISION).to(tl.float32)
    result = round_to(u + e_out[None, :], dtype, PRECISION)
    out_row = out_ptr + row * (HC * H) + streams[:, None] * H
    tl.store(out_row + outputs[None, :], result, mask=streams_inside[:, None] & outputs_inside[None, :])


def mtp_layer_input(embeddings: torch.Tensor, hidden_streams: torch.Tensor, embedding_norm: torch.Tensor,
                    hidden_norm: torch.Tensor, eps: float, fc_embedding: torch.Tensor,
                    fc_hidden: torch.Tensor) -> torch.Tensor:
    hc = check_args(embeddings, hidden_streams, embedding_norm, hidden_norm, fc_embedding, fc_hidden)
    n, h = embeddings.shape
    if any(t.stride(-1) != 1 for t in (embeddings, hidden_streams, fc_embedding, fc_hidden)) or not (
            embedding_norm.is_contiguous() and hidden_norm.is_contiguous()):
        raise ValueError("mtp_layer_input kernel: rows of the inputs and weights must be contiguous")
    out = torch.empty(n, hc * h, dtype=embeddings.dtype, device=embeddings.device)
    if n:
        block_n, block_k, stats_block, warps = tiles(h, hc)
        _mtp_input_kernel[(n, triton.cdiv(h, block_n))](
            embeddings, hidden_streams, embedding_norm, hidden_norm, fc_embedding, fc_hidden, out,
            embeddings.stride(0), hidden_streams.stride(0), fc_embedding.stride(0), fc_hidden.stride(0), eps,
            H=h, HC=hc, HC_P2=triton.next_power_of_2(hc), BLOCK_N=block_n, BLOCK_K=block_k,
            STATS_BLOCK=stats_block, PRECISION=dot_precision(out), num_warps=warps,
            **launch_options(embeddings.device))
    return out


def tiles(h: int, hc: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, STATS_BLOCK, warps) for hidden h: each capped by the row (narrow models take
    the whole row in one step); 8 warps where the products' [hc, BLOCK_N, BLOCK_K] fp32 sums would hold
    more than 64 values a thread at 4."""
    width = triton.next_power_of_2(h)
    block_n, block_k, stats_block = min(BLOCK_N, width), min(BLOCK_K, width), min(STATS_BLOCK, width)
    warps = 8 if triton.next_power_of_2(hc) * block_n * block_k > 64 * 128 else 4
    return block_n, block_k, stats_block, warps
