"""PLE: hashed n-gram embeddings injected into every hyper-connection stream before a layer.

Per token: the rows chosen by `ngram_hash` are concatenated (emb [D]); key = norm_key(key_proj(emb))
per stream, value = value_proj(emb); each stream's gate is sigmoid(signed sqrt(<key_s, norm_query(h)_s>
/ sqrt(H))); gv_s = gate_s * value. The output gv + silu(dilated causal conv(norm_conv(gv))) is added to
the streams. The conv history and the token context live in the request's state slot (a speculative
verification batch also keeps the history after each of a request's rows: `ForwardBatch.position_slots`).

Where table rows come from: the in-memory table here (`NgramTable`), or, when the tables are memory-mapped
files (`memory/ngram_store.py`, the NVMe tier), embeddings the host gathered into `batch.ple_embeddings`.

A decode batch on CUDA takes `kernels/ple`'s two launches around the key/value projection (the hash and
gather; then gate, norms, conv, history and the residual add), and `model/qwen4_exp.py` moves the n-gram
context on with a third; a speculative verification batch (T rows per request) takes the same three, the
history and context after each row kept in its slot; TIERLM_NO_FUSED_PLE=1 turns them off.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.model.cache import PLEState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.gated_deltanet import causal_depthwise_conv
from tierlm.model.layers.norm import RMSNorm
from tierlm.model.layers.packed_linear import PackedLinear
from tierlm.model.ngram_hash import NgramHasher, NgramHashSpec, ngram_context


def shifted_token_streams(batch: ForwardBatch, context: torch.Tensor, eos: int, ngram_size: int) -> torch.Tensor:
    """The n-gram context of every packed token, [ngram_size, N] (see `ngram_hash.ngram_context`);
    context [S, ngram_size-1] holds each slot's last ids. The same for every PLE layer: computed once."""
    if batch.is_decode_only or batch.verify_slots is not None:  # T rows per request (decode: 1)
        tokens = batch.token_ids.view(batch.num_requests, -1)
        history = torch.cat([context.index_select(0, batch.slots), tokens], dim=-1)  # [B, P+T]
        return ngram_context(history, eos, ngram_size).flatten(1)
    return torch.cat([
        ngram_context(torch.cat([context[slot], batch.token_ids[start:end]]), eos, ngram_size)
        for (start, end), slot in zip(batch.bounds, batch.state_slots)
    ], dim=-1)


class NgramIds:
    """A forward's n-gram ids, shared by its PLE layers: the requests' last ids (`ModelCache.ngram_context`,
    [S, ngram_size-1], which the fused decode kernel hashes from) and, made on first use, the batch's
    `shifted_token_streams` (what the torch path hashes)."""

    def __init__(self, batch: ForwardBatch, context: torch.Tensor, eos: int, ngram_size: int) -> None:
        self.batch, self.context, self.eos, self.ngram_size = batch, context, eos, ngram_size
        self._streams: torch.Tensor | None = None

    def streams(self) -> torch.Tensor:
        if self._streams is None:
            self._streams = shifted_token_streams(self.batch, self.context, self.eos, self.ngram_size)
        return self._streams


def fused_decode_applies(x: torch.Tensor, batch: ForwardBatch) -> bool:
    """A decode batch or a speculative verification batch (T rows per request) on CUDA (x: a tensor it runs
    on) takes `kernels/ple.triton`, unless TIERLM_NO_FUSED_PLE=1."""
    shaped = batch.is_decode_only or batch.verify_slots is not None
    return x.is_cuda and shaped and not os.environ.get("TIERLM_NO_FUSED_PLE")


class NgramTable(nn.Module):
    """The table as one in-memory tensor [rows, dE] (checkpoint shards are concatenated on load)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, heads] -> embeddings [T, heads * dE]."""
        return F.embedding(rows, self.weight).flatten(-2)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the table as stored, its scale): what `kernels/ple.decode_embeddings` reads."""
        return self.weight, None


class PLELayer(nn.Module):
    def __init__(self, config, ple_index: int) -> None:
        super().__init__()
        c = config
        self.ple_index = ple_index
        self.spec = NgramHashSpec.from_config(c, ple_index)
        self.hasher = NgramHasher(self.spec)
        self.hidden_size, self.hc_count, self.ngram_size = c.hidden_size, c.hc_count, c.ngram_size
        width = c.hc_count * c.hidden_size
        self.table = NgramTable(self.spec.table_rows, c.ngram_head_dim)
        self.key_value_proj = PackedLinear(c.ple_embed_dim, {"key_proj": width, "value_proj": c.hidden_size})
        self.norm_key = RMSNorm(width, c.rms_norm_eps, group_size=c.hidden_size)
        self.norm_query = RMSNorm(width, c.rms_norm_eps, group_size=c.hidden_size)
        self.norm_conv = RMSNorm(width, c.rms_norm_eps, group_size=c.hidden_size)
        self.conv1d = nn.Conv1d(width, width, c.ple_conv_kernel_size, groups=width, bias=False)
        self.history = (c.ple_conv_kernel_size - 1) * c.ngram_size

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, state: PLEState, ngram_ids: NgramIds | None
    ) -> torch.Tensor:
        """streams [N, hc*H] -> streams with the PLE output added. ngram_ids: the batch's (shared by every PLE
        layer), or None when the host gathered the embeddings (`batch.ple_embeddings`)."""
        fused = fused_decode_applies(streams, batch)
        if batch.ple_embeddings is not None:
            emb = batch.ple_embeddings[self.ple_index].to(streams.dtype)
        elif fused:
            from tierlm.kernels.ple.triton import decode_embeddings

            table, scale = self.table.stored()
            emb = decode_embeddings(ngram_ids.context, batch.slots, batch.token_ids, table, scale,
                                    *self.hasher.constants(streams.device), self.spec.heads_per_ngram,
                                    self.spec.eos_token_id, streams.dtype)
        else:
            emb = self.table.gather(self.hasher.rows(ngram_ids.streams())).to(streams.dtype)
        if fused:
            from tierlm.kernels.ple.triton import decode_residual

            key, value = self.key_value_proj(emb)
            return decode_residual(streams, key, value, self.norm_key.weight, self.norm_query.weight,
                                   self.norm_conv.weight, self.conv1d.weight.squeeze(1), state.conv, batch.slots,
                                   self.norm_key.eps, self.ngram_size, batch.verify_slots)
        gated = self.gated_values(streams, emb)
        return streams + (gated + F.silu(self._short_conv(self.norm_conv(gated), batch, state)))

    def gated_values(self, streams: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """streams [..., hc*H] and their n-gram embeddings [..., D] -> each stream's gated value [..., hc*H]
        (before the short conv)."""
        key, value = self.key_value_proj(emb)
        key = self.norm_key(key).unflatten(-1, (self.hc_count, self.hidden_size))
        query = self.norm_query(streams).unflatten(-1, (self.hc_count, self.hidden_size))
        dot = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = dot.abs().clamp_min(1e-6).sqrt() * dot.sign()
        return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)

    def _short_conv(self, conv_in: torch.Tensor, batch: ForwardBatch, state: PLEState) -> torch.Tensor:
        """Dilated causal conv over each request's history of conv_in [N, hc*H]; updates the history."""
        weight = self.conv1d.weight.squeeze(1)
        if batch.is_decode_only:
            window = torch.cat([state.conv.index_select(0, batch.slots), conv_in.unsqueeze(-1)], dim=-1)
            state.conv.index_copy_(0, batch.slots, window[..., 1:])
            return causal_depthwise_conv(window, weight, self.ngram_size)[..., 0]
        if batch.verify_slots is not None:  # T rows per request, the history after each kept
            requests, width = batch.verify_slots.shape
            window = torch.cat([state.conv.index_select(0, batch.slots),
                                conv_in.view(requests, width, -1).transpose(1, 2)], dim=-1)  # [B, C, P+T]
            after = window.unfold(-1, self.history, 1)[:, :, 1:]  # [B, C, T, P]
            state.conv.index_copy_(0, batch.verify_slots.flatten(), after.transpose(1, 2).flatten(0, 1))
            return causal_depthwise_conv(window, weight, self.ngram_size).transpose(1, 2).flatten(0, 1)
        conv_out = torch.empty_like(conv_in)
        position_slots = batch.position_slots or [[]] * batch.num_requests
        for (start, end), slot, after in zip(batch.bounds, batch.state_slots, position_slots):
            window = torch.cat([state.conv[slot], conv_in[start:end].T], dim=-1)
            for t, target in enumerate(after):  # speculative verification: the history after each row
                state.conv[target] = window[:, t + 1 : t + 1 + self.history]
            state.conv[slot] = window[:, -self.history :]
            conv_out[start:end] = causal_depthwise_conv(window.unsqueeze(0), weight, self.ngram_size)[0].T
        return conv_out
