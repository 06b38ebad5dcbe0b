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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.mtp_input.naive import check_args
from tierlm.kernels.quant_linear.triton import dot_precision, round_to

BLOCK_N = 32  # output columns per program: 16 programs a row at hidden 512
BLOCK_K = 64  # input columns per step of the K loops


@triton.jit
def _mtp_input_kernel(emb_ptr, hidden_ptr, emb_norm_ptr, hidden_norm_ptr, fc_emb_ptr, fc_hidden_ptr, out_ptr,
                      emb_stride, hidden_stride, fc_emb_stride, fc_hidden_stride, eps, H: tl.constexpr,
                      HC: tl.constexpr, HC_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, PDL: tl.constexpr):
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

    squares_e = tl.zeros([BLOCK_K], tl.float32)
    squares_h = tl.zeros([HC_P2, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        columns = k0 + tl.arange(0, BLOCK_K)
        inside = columns < H
        e = tl.load(emb_row + columns, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(hidden_row + columns[None, :], mask=streams_inside[:, None] & inside[None, :], other=0.0)
        h = h.to(tl.float32)
        squares_e += e * e
        squares_h += h * h
    inverse_e = tl.rsqrt(tl.sum(squares_e, axis=0) / H + eps)
    inverse_h = tl.rsqrt(tl.sum(tl.sum(squares_h, axis=1), axis=0) / (HC * H) + eps)

    total_e = tl.zeros([BLOCK_N], tl.float32)
    total_h = tl.zeros([HC_P2, BLOCK_N], tl.float32)
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
        total_e += tl.sum(w_e.to(tl.float32) * e[None, :], axis=1)
        total_h += tl.sum(w_h.to(tl.float32)[None, :, :] * h[:, None, :], axis=2)
    e_out = round_to(total_e, dtype, PRECISION).to(tl.float32)
    u = round_to(total_h, dtype, PRECISION).to(tl.float32)
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
        _mtp_input_kernel[(n, triton.cdiv(h, BLOCK_N))](
            embeddings, hidden_streams, embedding_norm, hidden_norm, fc_embedding, fc_hidden, out,
            embeddings.stride(0), hidden_streams.stride(0), fc_embedding.stride(0), fc_hidden.stride(0), eps,
            H=h, HC=hc, HC_P2=triton.next_power_of_2(hc), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION=dot_precision(out), num_warps=4, **launch_options(embeddings.device))
    return out
