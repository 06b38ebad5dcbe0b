"""PLE's decode step in plain torch: the reference (see the package docstring). The same ops, in the same
dtypes, as the layer's torch path (`model/layers/ple.py`: `shifted_token_streams`, `NgramHasher.rows`, the
table's gather, `gated_values`, the short conv), for one new token per request; or for T rows per request
(speculative verification: tokens [B*T], row t of request i after its rows before it, the conv history
after each row kept in `state_slots[i, t]`), each row as the one-token step after the rows before it."""

from __future__ import annotations

import math

import torch


def decode_embeddings(
    context: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None,
    multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, heads_per_ngram: int, eos: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    check_embedding_args(context, slots, tokens, table, multipliers, sizes, offsets, heads_per_ngram)
    requests, ngram_size = slots.shape[0], context.shape[1] + 1
    history = torch.cat([context.index_select(0, slots), tokens.view(requests, -1)], dim=-1)  # [B, P+T]
    history = history.unfold(-1, ngram_size, 1).flatten(0, 1)  # [B*T, n]: each row's n-gram, oldest first
    current = history[:, -1]
    mixed, seen_eos, per_order = current * multipliers[0], torch.zeros_like(current, dtype=torch.bool), []
    for shift in range(1, ngram_size):
        previous = history[:, -1 - shift]
        seen_eos = seen_eos | (previous == eos)  # an EOS at or after this id, before the current token
        mixed = mixed ^ (torch.where(seen_eos, eos, previous) * multipliers[shift])
        per_order.append(mixed.unsqueeze(-1).expand(-1, heads_per_ngram))
    rows = torch.remainder(torch.cat(per_order, dim=-1), sizes) + offsets  # [B, heads]
    if scale is None:
        gathered = table[rows]
    else:  # fp8: gathered as bytes (indexing kernels do not cover float8 everywhere), scaled in fp32
        gathered = table.view(torch.uint8)[rows].view(table.dtype).float() * scale
    return gathered.flatten(1).to(dtype)


def advance_context(
    context: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, state_slots: torch.Tensor | None = None,
) -> None:
    """The context moved past each request's token (or, state_slots [B, T]: its T tokens [B*T], the context
    after row t into slot state_slots[i, t])."""
    state_slots = check_advance_args(context, slots, tokens, state_slots)
    requests, width = state_slots.shape
    keep = context.shape[1]
    if keep == 0:
        return
    history = torch.cat([context.index_select(0, slots), tokens.view(requests, width).to(context.dtype)], dim=-1)
    context.index_copy_(0, state_slots.flatten(), history.unfold(-1, keep, 1)[:, 1:].flatten(0, 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int) -> torch.Tensor:
    """Gemma RMS norm over groups of `group` (the layer's `RMSNorm(group_size=H)`)."""
    xf = x.float().unflatten(-1, (-1, group))
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def decode_residual(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, conv_weight: torch.Tensor,
    conv_state: torch.Tensor, slots: torch.Tensor, eps: float, dilation: int, state_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """state_slots [B, T]: T rows per request (streams [B*T, hc*H]), the history after row t into slot
    state_slots[i, t]; None: one row per request, the history moved on in its slot."""
    hidden, hc = check_residual_args(streams, key, value, conv_weight, conv_state, slots, dilation, state_slots)
    key = rms_norm(key, norm_key_weight, eps, hidden).unflatten(-1, (hc, hidden))
    query = rms_norm(streams, norm_query_weight, eps, hidden).unflatten(-1, (hc, hidden))
    dot = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = dot.abs().clamp_min(1e-6).sqrt() * dot.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    conv_in = rms_norm(gated, norm_conv_weight, eps, hidden)
    state_slots = slots[:, None] if state_slots is None else state_slots
    requests, width = state_slots.shape
    history = conv_state.shape[-1]
    window = torch.cat([conv_state.index_select(0, slots), conv_in.view(requests, width, -1).transpose(1, 2)],
                       dim=-1)  # [B, C, P + T]
    convs = []
    for t in range(width):
        taps = window[..., t : t + history + 1 : dilation]  # the K taps of row t's output
        convs.append((taps * conv_weight.float()).sum(-1).to(window.dtype))
        conv_state.index_copy_(0, state_slots[:, t], window[..., t + 1 : t + 1 + history])
    conv = torch.stack(convs, dim=1).flatten(0, 1)  # [B*T, C]
    return streams + (gated + torch.nn.functional.silu(conv))


def check_context_args(context, slots, tokens, rows_per_request: bool = False) -> None:
    """rows_per_request: tokens may hold T rows per request ([B*T])."""
    shaped = tokens.dim() == 1 and (tokens.shape[0] % max(slots.shape[0], 1) == 0 if rows_per_request
                                    else tokens.shape == slots.shape)
    if context.dim() != 2 or slots.dim() != 1 or not shaped:
        raise ValueError(f"PLE context: context {tuple(context.shape)} must be [S, P], slots {tuple(slots.shape)} "
                         f"[B] and tokens {tuple(tokens.shape)} [B]" + (" or [B*T]" if rows_per_request else ""))


def check_advance_args(context, slots, tokens, state_slots) -> torch.Tensor:
    """`advance_context`'s checks (both forms); returns state_slots as [B, T] (slots[:, None] when None)."""
    check_context_args(context, slots, tokens, rows_per_request=state_slots is not None)
    state_slots = slots[:, None] if state_slots is None else state_slots
    if state_slots.dim() != 2 or state_slots.shape[0] != slots.shape[0] or tokens.shape[0] != state_slots.numel():
        raise ValueError(f"PLE context: state_slots {tuple(state_slots.shape)} must be [B, T] for slots "
                         f"{tuple(slots.shape)} and tokens {tuple(tokens.shape)} [B*T]")
    return state_slots


def check_embedding_args(context, slots, tokens, table, multipliers, sizes, offsets, heads_per_ngram) -> None:
    check_context_args(context, slots, tokens, rows_per_request=True)
    ngram_size = context.shape[1] + 1
    heads = (ngram_size - 1) * heads_per_ngram
    if multipliers.numel() != ngram_size or sizes.numel() != heads or offsets.numel() != heads:
        raise ValueError(f"PLE embeddings: a context of {ngram_size - 1} ids needs {ngram_size} multipliers and "
                         f"{heads} sizes and offsets, got {multipliers.numel()}, {sizes.numel()}, {offsets.numel()}")
    if table.dim() != 2:
        raise ValueError(f"PLE embeddings: table {tuple(table.shape)} must be [rows, dE]")


def check_residual_args(streams, key, value, conv_weight, conv_state, slots, dilation,
                        state_slots=None) -> tuple[int, int]:
    """(H, hc) of valid arguments."""
    if state_slots is not None:
        if state_slots.dim() != 2 or state_slots.shape[0] != slots.shape[0] or (
                streams.dim() == 2 and streams.shape[0] != state_slots.numel()):
            raise ValueError(f"PLE residual: state_slots {tuple(state_slots.shape)} must be [B, T] for slots "
                             f"{tuple(slots.shape)} and streams of B*T rows, got {tuple(streams.shape)}")
        slots = state_slots.flatten()  # one per row, for the shape checks below
    if value.dim() != 2 or streams.dim() != 2 or streams.shape[1] % value.shape[1]:
        raise ValueError(f"PLE residual: streams {tuple(streams.shape)} must be [B, hc*H], value "
                         f"{tuple(value.shape)} [B, H]")
    hidden = value.shape[1]
    width = streams.shape[1]
    kernel = conv_weight.shape[-1]
    if key.shape != streams.shape or value.shape[0] != streams.shape[0] or slots.shape != (streams.shape[0],):
        raise ValueError(f"PLE residual: key {tuple(key.shape)}, value {tuple(value.shape)} and slots "
                         f"{tuple(slots.shape)} must match streams {tuple(streams.shape)}")
    if conv_weight.shape != (width, kernel) or conv_state.shape[1:] != (width, (kernel - 1) * dilation):
        raise ValueError(f"PLE residual: conv weight {tuple(conv_weight.shape)} must be [{width}, K] and the "
                         f"state {tuple(conv_state.shape)} [S, {width}, (K-1)*{dilation}]")
    if conv_state.dtype != streams.dtype:
        raise ValueError(f"PLE residual: the conv state is {conv_state.dtype} but the streams are {streams.dtype}")
    return hidden, width // hidden
