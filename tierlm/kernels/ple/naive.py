"""PLE's decode step in plain torch: the reference (see the package docstring). The same ops, in the same
dtypes, as the layer's torch path (`model/layers/ple.py`: `shifted_token_streams`, `NgramHasher.rows`, the
table's gather, `gated_values`, the short conv), for one new token per request."""

from __future__ import annotations

import math

import torch


def decode_embeddings(
    context: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None,
    multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, heads_per_ngram: int, eos: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    check_embedding_args(context, slots, tokens, table, multipliers, sizes, offsets, heads_per_ngram)
    history = torch.cat([context.index_select(0, slots), tokens.view(-1, 1)], dim=-1)  # [B, n]: oldest first
    ngram_size = history.shape[1]
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


def advance_context(context: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    check_context_args(context, slots, tokens)
    history = torch.cat([context.index_select(0, slots), tokens.view(-1, 1).to(context.dtype)], dim=-1)
    context.index_copy_(0, slots, history[:, 1:])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int) -> torch.Tensor:
    """Gemma RMS norm over groups of `group` (the layer's `RMSNorm(group_size=H)`)."""
    xf = x.float().unflatten(-1, (-1, group))
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def decode_residual(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor, norm_conv_weight: torch.Tensor, conv_weight: torch.Tensor,
    conv_state: torch.Tensor, slots: torch.Tensor, eps: float, dilation: int,
) -> torch.Tensor:
    hidden, hc = check_residual_args(streams, key, value, conv_weight, conv_state, slots, dilation)
    key = rms_norm(key, norm_key_weight, eps, hidden).unflatten(-1, (hc, hidden))
    query = rms_norm(streams, norm_query_weight, eps, hidden).unflatten(-1, (hc, hidden))
    dot = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = dot.abs().clamp_min(1e-6).sqrt() * dot.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    conv_in = rms_norm(gated, norm_conv_weight, eps, hidden)
    window = torch.cat([conv_state.index_select(0, slots), conv_in.unsqueeze(-1)], dim=-1)  # [B, C, P + 1]
    conv_state.index_copy_(0, slots, window[..., 1:])
    taps = window[..., ::dilation]  # the K taps of the one new output
    conv = (taps * conv_weight.float()).sum(-1).to(window.dtype)
    return streams + (gated + torch.nn.functional.silu(conv))


def check_context_args(context, slots, tokens) -> None:
    if context.dim() != 2 or slots.dim() != 1 or tokens.shape != slots.shape:
        raise ValueError(f"PLE context: context {tuple(context.shape)} must be [S, P], slots {tuple(slots.shape)} "
                         f"and tokens {tuple(tokens.shape)} both [B]")


def check_embedding_args(context, slots, tokens, table, multipliers, sizes, offsets, heads_per_ngram) -> None:
    check_context_args(context, slots, tokens)
    ngram_size = context.shape[1] + 1
    heads = (ngram_size - 1) * heads_per_ngram
    if multipliers.numel() != ngram_size or sizes.numel() != heads or offsets.numel() != heads:
        raise ValueError(f"PLE embeddings: a context of {ngram_size - 1} ids needs {ngram_size} multipliers and "
                         f"{heads} sizes and offsets, got {multipliers.numel()}, {sizes.numel()}, {offsets.numel()}")
    if table.dim() != 2:
        raise ValueError(f"PLE embeddings: table {tuple(table.shape)} must be [rows, dE]")


def check_residual_args(streams, key, value, conv_weight, conv_state, slots, dilation) -> tuple[int, int]:
    """(H, hc) of valid arguments."""
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
