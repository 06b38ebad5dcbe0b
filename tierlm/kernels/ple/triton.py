"""PLE's decode step as three small Triton launches (same signatures as `naive`); CUDA graphs capture them.

`decode_embeddings`: a program per (request, head) reads the request's context ids through its slot,
applies the EOS rule, hashes its n-gram order (int64 products and XOR, wrapping as the reference's) and
copies its table row to the embeddings; an fp8 table is read as bytes and decoded exactly on the bits
(e4m3fn), times the scale in fp32.

`decode_residual`: a program per (request, stream, BLOCK_C channels). It issues its channels' loads
(value, streams, the history, the conv taps) first, then sums over its stream's whole row of H (in
BLOCK_STATS steps, unrolled; read from L2 by each of the stream's programs) key^2, query^2, the product
of the normed key and query, and value^2: the two RMS norms, the dot, the gate and norm_conv's rms
(gate^2 * mean(value^2)) follow from those four sums without a second pass. Then, on its own channels:
gv, norm_conv, the K dilated taps of the history and the new value, the history moved on by one (a
barrier between its reads and its writes), silu, and streams + (gv + silu(conv)), rounded to the
streams' dtype at the reference's rounding points where a value is stored or meets another (the norms'
and the dot's sums are fp32 here: bf16 results are closer to the fp32 truth than the reference's own).

`advance_context`: a program per request moves its context row by one and appends the token.

Speculative verification (T rows per request, the state after each row kept in `state_slots[i, t]`, as
the references take it): `decode_embeddings` runs a program per (row, head), the ids before a row taken
from the request's rows before it, then from its context; `decode_residual`'s program walks its
channels through the request's rows in order, row t reading the history row t-1 wrote (a barrier
between); `advance_context` writes the context after each row. Each row computes what a one-token step
after the rows before it computes, bit for bit.

All three launch with programmatic dependent launch (`kernels/dependent_launch`). Before they wait for
the kernel before them, `decode_embeddings`' programs load the hash constants (multipliers, their head's
size and offset) and an fp8 table's scale (the table row itself depends on the ids: after the wait), and
`decode_residual`'s the conv taps and norm_conv weight of their channels (norm_key and norm_query are read
in the sums' loop, after it); `advance_context` has no weights and waits first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.ple.naive import check_advance_args, check_embedding_args, check_residual_args
from tierlm.kernels.quant_linear.triton import dot_precision, round_to

BLOCK_C = 128  # channels per residual program: 80 programs at the real widths, batch 1
BLOCK_STATS = 1024  # the stats loop's step over a stream's row
RESIDUAL_WARPS = 4
GATHER_WARPS = 2


@triton.jit
def _fp8_e4m3_to_float(byte):
    """float8 e4m3fn bits (uint8) -> fp32, exact (NaN's one pattern is never stored in a table)."""
    bits = byte.to(tl.uint32)
    sign, exponent, mantissa = bits >> 7, (bits >> 3) & 15, bits & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))  # m * 2^-9
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _embeddings_kernel(context_ptr, slots_ptr, tokens_ptr, table_ptr, scale_ptr, multipliers_ptr, sizes_ptr,
                       offsets_ptr, out_ptr, CONTEXT: tl.constexpr, HEADS_PER_NGRAM: tl.constexpr, DIM: tl.constexpr,
                       EOS: tl.constexpr, FP8: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                       ROWS: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    row, head = tl.program_id(0), tl.program_id(1)  # row t = row % ROWS of request row // ROWS
    num_heads = tl.num_programs(1)
    t = row % ROWS
    # the constants (before the wait): multiplier of each shift, this head's size and offset, the fp8 scale
    multipliers = ()
    for shift in tl.static_range(CONTEXT + 1):
        multipliers += (tl.load(multipliers_ptr + shift),)
    size = tl.load(sizes_ptr + head)
    offset = tl.load(offsets_ptr + head)
    if FP8:
        scale = tl.load(scale_ptr)
    wait_for_inputs(PDL)
    slot = tl.load(slots_ptr + row // ROWS).to(tl.int64)
    order = head // HEADS_PER_NGRAM + 2  # this head hashes t_0 .. t_{order-1}
    mixed = tl.load(tokens_ptr + row).to(tl.int64) * multipliers[0]
    seen_eos = False
    for shift in tl.static_range(1, CONTEXT + 1):
        # the id `shift` before this row's: one of the request's rows before it, else from its context
        in_rows = shift <= t
        previous = tl.where(
            in_rows, tl.load(tokens_ptr + row - shift, mask=in_rows, other=0).to(tl.int64),
            tl.load(context_ptr + slot * CONTEXT + (CONTEXT - shift + t), mask=shift > t, other=0).to(tl.int64))
        seen_eos = seen_eos | (previous == EOS)
        term = tl.where(seen_eos, EOS, previous) * multipliers[shift]
        mixed = tl.where(order > shift, mixed ^ term, mixed)
    entry = mixed % size  # C's remainder; out-of-vocabulary ids may wrap mixed below 0: the floor mod is then + size
    entry = tl.where(entry < 0, entry + size, entry) + offset
    d = tl.arange(0, BLOCK_D)
    stored = tl.load(table_ptr + entry * DIM + d, mask=d < DIM, other=0)
    if FP8:
        values = _fp8_e4m3_to_float(stored) * scale
    else:
        values = stored.to(tl.float32)
    out = out_ptr + (row.to(tl.int64) * num_heads + head) * DIM + d
    tl.store(out, round_to(values, out_ptr.dtype.element_ty, PRECISION), mask=d < DIM)


def decode_embeddings(
    context: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None,
    multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, heads_per_ngram: int, eos: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    check_embedding_args(context, slots, tokens, table, multipliers, sizes, offsets, heads_per_ngram)
    rows, heads, dim = tokens.shape[0], sizes.numel(), table.shape[1]
    out = torch.empty(rows, heads * dim, dtype=dtype, device=table.device)
    if rows == 0:
        return out
    fp8 = scale is not None
    _embeddings_kernel[(rows, heads)](
        context.contiguous(), slots, tokens.contiguous(), table.view(torch.uint8) if fp8 else table.contiguous(),
        scale if fp8 else table, multipliers, sizes, offsets, out, CONTEXT=context.shape[1],
        HEADS_PER_NGRAM=heads_per_ngram, DIM=dim, EOS=eos, FP8=fp8, BLOCK_D=triton.next_power_of_2(dim),
        PRECISION=dot_precision(out), ROWS=rows // slots.shape[0], num_warps=GATHER_WARPS,
        **launch_options(table.device),
    )
    return out


@triton.jit
def _residual_kernel(streams_ptr, key_ptr, value_ptr, norm_key_ptr, norm_query_ptr, norm_conv_ptr, conv_weight_ptr,
                     state_ptr, slots_ptr, state_slots_ptr, out_ptr, stride_streams, stride_key, stride_value,
                     stride_state, eps, inv_sqrt_hidden, HIDDEN: tl.constexpr, HC: tl.constexpr, KERNEL: tl.constexpr,
                     DILATION: tl.constexpr, HISTORY: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_STATS: tl.constexpr,
                     BLOCK_HISTORY: tl.constexpr, PRECISION: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    request, stream, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DTYPE = out_ptr.dtype.element_ty
    # this program's channels, and the weights they read that every row shares (before the wait)
    j = block * BLOCK_C + tl.arange(0, BLOCK_C)
    inside = j < HIDDEN
    channels = stream * HIDDEN + j
    conv_scale = 1.0 + tl.load(norm_conv_ptr + channels, mask=inside, other=0.0).to(tl.float32)
    past = tl.arange(0, BLOCK_HISTORY)
    in_history = inside[:, None] & (past < HISTORY)[None, :]
    is_tap = in_history & (past % DILATION == 0)[None, :]
    tap_weight = tl.load(conv_weight_ptr + channels[:, None] * KERNEL + (past // DILATION)[None, :], mask=is_tap,
                         other=0.0).to(tl.float32)
    newest_weight = tl.load(conv_weight_ptr + channels * KERNEL + KERNEL - 1, mask=inside, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    # the request's rows in order: row t reads the history row t-1 left (the slot's for row 0) and writes its
    # own into state_slots[request, t] (the slot itself for a decode row)
    source = tl.load(slots_ptr + request).to(tl.int64)
    for t in tl.static_range(ROWS):
        row64 = request.to(tl.int64) * ROWS + t
        target = tl.load(state_slots_ptr + row64).to(tl.int64)
        streams_row = streams_ptr + row64 * stride_streams + stream * HIDDEN
        key_row = key_ptr + row64 * stride_key + stream * HIDDEN
        value_row = value_ptr + row64 * stride_value
        # this row's channels: everything they read, first (in flight while the sums below are made)
        value = tl.load(value_row + j, mask=inside, other=0.0).to(tl.float32)
        residual = tl.load(streams_row + j, mask=inside, other=0.0).to(tl.float32)
        history = state_ptr + source * stride_state + channels[:, None] * HISTORY + past[None, :]
        old = tl.load(history, mask=in_history, other=0.0).to(tl.float32)
        moved = tl.load(history + 1, mask=inside[:, None] & (past < HISTORY - 1)[None, :], other=0.0)
        # the stream's four sums over its whole row (unrolled: every step's loads in flight at once)
        key_sq = tl.zeros((BLOCK_STATS,), dtype=tl.float32)
        query_sq = tl.zeros((BLOCK_STATS,), dtype=tl.float32)
        key_query = tl.zeros((BLOCK_STATS,), dtype=tl.float32)
        value_sq = tl.zeros((BLOCK_STATS,), dtype=tl.float32)
        for start in tl.static_range(0, HIDDEN, BLOCK_STATS):
            k = start + tl.arange(0, BLOCK_STATS)
            k_inside = k < HIDDEN
            key = tl.load(key_row + k, mask=k_inside, other=0.0).to(tl.float32)
            query = tl.load(streams_row + k, mask=k_inside, other=0.0).to(tl.float32)
            row_value = tl.load(value_row + k, mask=k_inside, other=0.0).to(tl.float32)
            key_scale = 1.0 + tl.load(norm_key_ptr + stream * HIDDEN + k, mask=k_inside, other=0.0).to(tl.float32)
            query_scale = 1.0 + tl.load(norm_query_ptr + stream * HIDDEN + k, mask=k_inside, other=0.0).to(tl.float32)
            key_sq += key * key
            query_sq += query * query
            key_query += (key * key_scale) * (query * query_scale)
            value_sq += row_value * row_value
        key_rms = tl.rsqrt(tl.sum(key_sq) / HIDDEN + eps)
        query_rms = tl.rsqrt(tl.sum(query_sq) / HIDDEN + eps)
        dot = key_rms * query_rms * tl.sum(key_query) * inv_sqrt_hidden
        sign = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
        gate = tl.sigmoid(sign * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6)))
        gate = round_to(gate, DTYPE, PRECISION).to(tl.float32)
        conv_rms = tl.rsqrt(gate * gate * tl.sum(value_sq) / HIDDEN + eps)
        # gv, norm_conv, the conv over the history and the new value, the history moved on, the residual
        gated = round_to(gate * value, DTYPE, PRECISION).to(tl.float32)
        conv_in = round_to(gated * conv_rms * conv_scale, DTYPE, PRECISION).to(tl.float32)
        conv = tl.sum(old * tap_weight, axis=1) + conv_in * newest_weight
        moved = tl.where((past == HISTORY - 1)[None, :], conv_in.to(moved.dtype)[:, None], moved)
        tl.debug_barrier()  # every read of the history is done before any of it is overwritten
        tl.store(state_ptr + target * stride_state + channels[:, None] * HISTORY + past[None, :], moved,
                 mask=in_history)
        conv = round_to(conv, DTYPE, PRECISION).to(tl.float32)
        activated = round_to(conv * tl.sigmoid(conv), DTYPE, PRECISION).to(tl.float32)
        ple = round_to(gated + activated, DTYPE, PRECISION).to(tl.float32)
        tl.store(out_ptr + row64 * HC * HIDDEN + channels, round_to(residual + ple, DTYPE, PRECISION), mask=inside)
        if t + 1 < ROWS:
            tl.debug_barrier()  # the history just written is what the next row reads
            source = target


def decode_residual(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, conv_weight: torch.Tensor,
    conv_state: torch.Tensor, slots: torch.Tensor, eps: float, dilation: int, state_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    hidden, hc = check_residual_args(streams, key, value, conv_weight, conv_state, slots, dilation, state_slots)
    for name, tensor in (("streams", streams), ("key", key), ("value", value)):
        if tensor.stride(1) != 1:
            raise ValueError(f"PLE residual kernel: {name} must have contiguous rows")
    if not conv_state.is_contiguous():
        raise ValueError("PLE residual kernel: the conv state must be contiguous (it is updated in place)")
    state_slots = (slots[:, None] if state_slots is None else state_slots).contiguous()
    requests, rows = state_slots.shape
    out = torch.empty(streams.shape[0], hc * hidden, dtype=streams.dtype, device=streams.device)
    if requests == 0:
        return out
    kernel = conv_weight.shape[1]
    _residual_kernel[(requests, hc, triton.cdiv(hidden, BLOCK_C))](
        streams, key, value, norm_key_weight, norm_query_weight, norm_conv_weight, conv_weight.contiguous(),
        conv_state, slots, state_slots, out, streams.stride(0), key.stride(0), value.stride(0), conv_state.stride(0),
        eps, hidden**-0.5, HIDDEN=hidden, HC=hc, KERNEL=kernel, DILATION=dilation, HISTORY=(kernel - 1) * dilation,
        BLOCK_C=BLOCK_C,
        BLOCK_STATS=min(BLOCK_STATS, triton.next_power_of_2(hidden)),
        BLOCK_HISTORY=triton.next_power_of_2((kernel - 1) * dilation), PRECISION=dot_precision(streams),
        ROWS=rows, num_warps=RESIDUAL_WARPS, **launch_options(streams.device),
    )
    return out


@triton.jit
def _advance_context_kernel(context_ptr, slots_ptr, tokens_ptr, state_slots_ptr, CONTEXT: tl.constexpr,
                            BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    allow_dependents(PDL)
    wait_for_inputs(PDL)
    request = tl.program_id(0)
    row = context_ptr + tl.load(slots_ptr + request).to(tl.int64) * CONTEXT
    tokens = tokens_ptr + request * ROWS
    i = tl.arange(0, BLOCK)
    for t in tl.static_range(ROWS):  # the context after row t: entries t+1.. of the slot's context, then tokens
        at = t + 1 + i
        newer = tl.load(row + at, mask=(i < CONTEXT) & (at < CONTEXT), other=0)
        newer = tl.where(at < CONTEXT, newer,
                         tl.load(tokens + at - CONTEXT, mask=(i < CONTEXT) & (at >= CONTEXT), other=0).to(newer.dtype))
        target = context_ptr + tl.load(state_slots_ptr + request * ROWS + t).to(tl.int64) * CONTEXT
        tl.debug_barrier()  # every read of the row is done before any of it is overwritten
        tl.store(target + i, newer, mask=i < CONTEXT)


def advance_context(
    context: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, state_slots: torch.Tensor | None = None,
) -> None:
    state_slots = check_advance_args(context, slots, tokens, state_slots).contiguous()
    if not context.is_contiguous():
        raise ValueError("PLE context kernel: the context must be contiguous (it is updated in place)")
    if slots.shape[0] and context.shape[1]:
        _advance_context_kernel[(slots.shape[0],)](context, slots, tokens, state_slots, CONTEXT=context.shape[1],
                                                  BLOCK=triton.next_power_of_2(context.shape[1]),
                                                  ROWS=state_slots.shape[1], num_warps=1,
                                                  **launch_options(context.device))
