"""Torch reference of `mtp_layer_input` (see the package docstring): the norms, the two products, the sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierlm.kernels.ple.naive import rms_norm


def check_args(embeddings: torch.Tensor, hidden_streams: torch.Tensor, embedding_norm: torch.Tensor,
               hidden_norm: torch.Tensor, fc_embedding: torch.Tensor, fc_hidden: torch.Tensor) -> int:
    """Validate the shapes; returns hc, the streams per row."""
    n, h = embeddings.shape
    if hidden_streams.dim() != 2 or hidden_streams.shape[0] != n or hidden_streams.shape[1] % h:
        raise ValueError(f"mtp_layer_input: hidden streams must be [{n}, hc*{h}], got {tuple(hidden_streams.shape)}")
    hc = hidden_streams.shape[1] // h
    if embedding_norm.shape != (h,) or hidden_norm.shape != (hc * h,):
        raise ValueError(f"mtp_layer_input: norm weights must be [{h}] and [{hc * h}], got "
                         f"{tuple(embedding_norm.shape)} and {tuple(hidden_norm.shape)}")
    if fc_embedding.shape != (h, h) or fc_hidden.shape != (h, h):
        raise ValueError(f"mtp_layer_input: fc weights must be [{h}, {h}], got {tuple(fc_embedding.shape)} and "
                         f"{tuple(fc_hidden.shape)}")
    return hc


def mtp_layer_input(embeddings: torch.Tensor, hidden_streams: torch.Tensor, embedding_norm: torch.Tensor,
                    hidden_norm: torch.Tensor, eps: float, fc_embedding: torch.Tensor,
                    fc_hidden: torch.Tensor) -> torch.Tensor:
    hc = check_args(embeddings, hidden_streams, embedding_norm, hidden_norm, fc_embedding, fc_hidden)
    n, h = embeddings.shape
    e = F.linear(rms_norm(embeddings, embedding_norm, eps, h), fc_embedding)
    u = F.linear(rms_norm(hidden_streams, hidden_norm, eps, hc * h).reshape(n * hc, h), fc_hidden).reshape(n, hc, h)
    return (u + e[:, None, :]).flatten(1)
