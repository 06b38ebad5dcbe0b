"""The Qwen4-Exp text model: embedding -> hc streams -> decoder layers -> final mixer -> lm_head.

Module names mirror the checkpoint (`model.layers.{i}.linear_attn...`), so loading is a name map.
A forward takes a `ForwardBatch` (packed varlen tokens of several requests at different positions) and
the `ModelCache` whose slots and blocks the batch names, updates that state in place, and returns the
logits of `batch.logits_rows`.
"""

from __future__ import annotations

import torch
from torch import nn

from tierlm.config import ModelConfig
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.embedding import Embedding
from tierlm.model.layers.gated_deltanet import GatedDeltaNet
from tierlm.model.layers.hyper_connection import HyperConnection
from tierlm.model.layers.moe import SparseMoeBlock
from tierlm.model.layers.packed_linear import Linear
from tierlm.model.layers.ple import PLELayer, shifted_token_streams
from tierlm.model.layers.qsa_attention import QSAAttention
from tierlm.model.layers.rotary import Rope, RotaryEmbedding
from tierlm.model.model_cache import LayerCaches, ModelCache


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_type = c.layer_types[layer_idx]
        ple_index = c.ple_index(layer_idx)
        self.ple = PLELayer(c, ple_index) if ple_index is not None else None
        hc = dict(hidden_size=c.hidden_size, hc_count=c.hc_count, lowrank=c.hc_lowrank, eps=c.rms_norm_eps)
        self.attn_hyper_connection = HyperConnection(**hc, with_inject=True)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = QSAAttention(c)
        self.mlp_hyper_connection = HyperConnection(**hc, with_inject=True)
        self.mlp = SparseMoeBlock(c)

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, caches: LayerCaches, rope: Rope,
        token_streams: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.ple is not None:
            streams = streams + self.ple(streams, batch, caches.ple, token_streams)
        x, inject = self.attn_hyper_connection.mix(streams)
        if self.layer_type == "linear_attention":
            out = self.linear_attn(x, batch, caches.gdn)
        else:
            out = self.self_attn(x, batch, caches.kv, caches.indexer, rope)
        streams = HyperConnection.combine(streams, out, inject)
        x, inject = self.mlp_hyper_connection.mix(streams)
        return HyperConnection.combine(streams, self.mlp(x, batch.static), inject)


class Qwen4ExpTextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.hyper_connection_mixer = HyperConnection(
            c.hidden_size, c.hc_count, c.hc_lowrank, c.rms_norm_eps, with_inject=False
        )
        self.rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Returns the final mixer's output [M, H] for `batch.logits_rows`."""
        streams = embed_streams(self.embed_tokens, batch, self.config.hc_count)
        streams = run_decoder_layers(self.layers, streams, batch, cache, self.config, self.rotary)
        mixed, _ = self.hyper_connection_mixer.mix(streams[batch.logits_rows])
        return mixed


def embed_streams(embed_tokens: Embedding, batch: ForwardBatch, hc_count: int) -> torch.Tensor:
    """The token embeddings copied into the hc residual streams: [N, hc_count * H]."""
    return embed_tokens(batch.token_ids).repeat(1, hc_count)


def run_decoder_layers(
    layers, streams: torch.Tensor, batch: ForwardBatch, cache: ModelCache, config: ModelConfig,
    rotary: RotaryEmbedding,
) -> torch.Tensor:
    """The streams through `layers` (whose caches are `cache.layers`, in order); then the requests'
    n-gram context moves past this batch's tokens."""
    token_streams = None
    if config.ple_layer_ids and batch.ple_embeddings is None:
        token_streams = shifted_token_streams(batch, cache.ngram_context, config.eos_token_id, config.ngram_size)
    rope = Rope(rotary, batch.positions, streams.dtype)
    for layer, caches in zip(layers, cache.layers):
        streams = layer(streams, batch, caches, rope, token_streams)
    _advance_ngram_context(batch, cache)
    return streams


def _advance_ngram_context(batch: ForwardBatch, cache: ModelCache) -> None:
    keep = cache.ngram_context.shape[1]
    if keep == 0:
        return
    if batch.is_decode_only:
        history = torch.cat([cache.ngram_context.index_select(0, batch.slots), batch.token_ids[:, None]], dim=-1)
        cache.ngram_context.index_copy_(0, batch.slots, history[:, 1:])
        return
    for (start, end), slot in zip(batch.bounds, batch.state_slots):
        history = torch.cat([cache.ngram_context[slot], batch.token_ids[start:end]])
        cache.ngram_context[slot] = history[-keep:]


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen4ExpTextModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so (again after materialising)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()  # not inference_mode: its tensors cannot flow through torch.compile
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Logits [M, vocab] for `batch.logits_rows`."""
        return self.lm_head(self.model(batch, cache))
