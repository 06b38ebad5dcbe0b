"""The Qwen4-Exp text model: embedding -> hc streams -> decoder layers -> final mixer -> lm_head.

Module names mirror the checkpoint (`model.layers.{i}.linear_attn...`), so loading is a name map.
A forward takes a `ForwardBatch` (packed varlen tokens of several requests at different positions) and
the `ModelCache` whose slots and blocks the batch names, updates that state in place, and returns the
logits of `batch.logits_rows`.

A VLM config adds the vision tower (`visual`, `model/vision/`): `encode_images` turns an image's patches
into features, which a forward takes in place of the image placeholders' embeddings
(`ForwardBatch.image_features`), with the prompt's M-RoPE positions (`ForwardBatch.mrope_positions`).

With an MTP draft head (`model/mtp.py`, built when the loader is asked for it) the model also serves
speculative decoding: `forward_with_streams` returns, beside the logits, every row's multi-stream state
before the final mixer (the draft's input), and `draft` runs the head.

The last decoder layer's MoE combine is left to the final mixer (`final_mix`: in its launches when the
logits rows are every row, as in a decode step); the streams returned to a caller are always combined.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tierlm.config import ModelConfig
from tierlm.kernels.ple.naive import advance_context
from tierlm.model.checkpoint_layout import MTPLayout
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.decoder_layer import DecoderLayer
from tierlm.model.layers.embedding import Embedding
from tierlm.model.layers.hyper_connection import HyperConnection, PendingStreams
from tierlm.model.layers.packed_linear import Linear
from tierlm.model.layers.ple import NgramIds, fused_decode_applies
from tierlm.model.layers.rotary import Rope, RotaryEmbedding
from tierlm.model.model_cache import ModelCache
from tierlm.model.mtp import MultiTokenPredictor
from tierlm.model.vision.tower import VisionTower


class Qwen4ExpTextModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c, c.layer_types[i], c.ple_index(i)) for i in range(c.num_hidden_layers)
        )
        self.hyper_connection_mixer = HyperConnection(
            c.hidden_size, c.hc_count, c.hc_lowrank, c.rms_norm_eps, with_inject=False
        )
        self.rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta, c.mrope_section)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Returns the final mixer's output [M, H] for `batch.logits_rows`."""
        return final_mix(self.hyper_connection_mixer, self.run_layers(batch, cache), batch)[1]

    def mix(self, streams: torch.Tensor) -> torch.Tensor:
        """The final mixer: streams [M, hc*H] -> [M, H] (lm_head's input)."""
        return self.hyper_connection_mixer.mix(streams)[0]

    def run_layers(self, batch: ForwardBatch, cache: ModelCache, rope: Rope | None = None) -> PendingStreams:
        """Every row's streams [N, hc*H] after the last decoder layer, its combine pending (the caches
        updated). rope: the batch's rotary tables, when the caller shares them (see `run_decoder_layers`)."""
        streams = embed_streams(self.embed_tokens, batch, self.config.hc_count)
        return run_decoder_layers(self.layers, streams, batch, cache, self.config, self.rotary, rope)


def embed_streams(embed_tokens: Embedding, batch: ForwardBatch, hc_count: int) -> torch.Tensor:
    """The token embeddings (image placeholders' rows replaced by the batch's image features) copied into
    the hc residual streams: [N, hc_count * H]. On CUDA a dense or per-row INT8 table's rows go into the
    streams in one launch (`kernels/embed_streams`, reading the table in place; the torch path of an INT8
    table is ~26 small kernels); other formats, and batches with image features, take the torch path."""
    fused = None if batch.image_features is not None else _kernel_rows(embed_tokens, batch.token_ids, hc_count)
    if fused is not None:
        return fused
    embeddings = embed_tokens(batch.token_ids)
    if batch.image_features is not None:
        embeddings = embeddings.index_copy(0, batch.image_rows, batch.image_features.to(embeddings.dtype))
    return embeddings.repeat(1, hc_count)


def embed_rows(embed_tokens: Embedding, token_ids: torch.Tensor) -> torch.Tensor:
    """The token embeddings [N, H] (the MTP draft head's input; no image features): on CUDA a dense or
    per-row INT8 table's rows in one launch (`kernels/embed_streams` with one stream; an INT8 table's torch
    gather is ~24 small kernels), else the layer's own gather."""
    fused = _kernel_rows(embed_tokens, token_ids, 1)
    return embed_tokens(token_ids) if fused is None else fused


def _kernel_rows(embed_tokens: Embedding, token_ids: torch.Tensor, hc_count: int) -> torch.Tensor | None:
    """The token embeddings copied into hc_count streams [N, hc_count * H] by `kernels/embed_streams` (one
    launch), or None where it does not run (`fused_embed_streams`, `Embedding.kernel_table`)."""
    weights = embed_tokens.kernel_table() if fused_embed_streams(token_ids) else None
    if weights is None:
        return None
    from tierlm.kernels.embed_streams import triton as kernels

    table, scales = weights
    return kernels.embed_streams(table, token_ids.contiguous(), hc_count, scales)


def fused_embed_streams(token_ids: torch.Tensor) -> bool:
    """Whether `embed_streams` (and `embed_rows`) may run its kernel: on CUDA, unless TIERLM_NO_FUSED_EMBED_STREAMS=1."""
    return token_ids.is_cuda and not os.environ.get("TIERLM_NO_FUSED_EMBED_STREAMS")


def run_decoder_layers(
    layers, streams: torch.Tensor, batch: ForwardBatch, cache: ModelCache, config: ModelConfig,
    rotary: RotaryEmbedding, rope: Rope | None = None,
) -> PendingStreams:
    """The streams through `layers` (whose caches are `cache.layers`, in order), the last layer's combine
    pending (each layer's is done by the next one's first mix); then the requests' n-gram context moves
    past this batch's tokens (and a verification batch keeps it after each row).
    rope: the batch's rotary tables made by the caller (shared with another forward at the same
    positions); made here when absent or of another dtype."""
    ngram_ids = None
    if config.ple_layer_ids and batch.ple_embeddings is None:
        ngram_ids = NgramIds(batch, cache.ngram_context, config.eos_token_id, config.ngram_size)
    if rope is None or rope.dtype != streams.dtype:
        rope = Rope(rotary, batch, streams.dtype)
    pending = PendingStreams(streams)
    for layer, caches in zip(layers, cache.layers):
        pending = layer(pending, batch, caches, rope, ngram_ids)
    _advance_ngram_context(batch, cache)
    return pending


def final_mix(mixer: HyperConnection, pending: PendingStreams, batch: ForwardBatch,
              every_row_streams: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The final mixer over `batch`'s logits rows of `pending`: (the streams, combined: every row's when
    every_row_streams, else the logits rows'; the mixer's output [M, H]). When the logits rows are every
    row (a decode step) the pending combine runs in the mixer's launches; else every row is combined, then
    the logits rows gathered, as without the fold."""
    if batch.logits_every_row:
        streams, mixed, _ = mixer.mix_pending(pending)
        return streams, mixed
    streams = pending.combined()
    wanted = batch.wanted_rows(streams)
    return (streams if every_row_streams else wanted), mixer.mix(wanted)[0]


def _advance_ngram_context(batch: ForwardBatch, cache: ModelCache) -> None:
    keep = cache.ngram_context.shape[1]
    if keep == 0:
        return
    if batch.is_decode_only or batch.verify_slots is not None:  # verification: the context after each row kept
        advance = advance_context
        if fused_decode_applies(cache.ngram_context, batch):
            from tierlm.kernels.ple.triton import advance_context as advance
        advance(cache.ngram_context, batch.slots, batch.token_ids, batch.verify_slots)
        return
    position_slots = batch.position_slots or [[]] * batch.num_requests
    for (start, end), slot, after in zip(batch.bounds, batch.state_slots, position_slots):
        history = torch.cat([cache.ngram_context[slot], batch.token_ids[start:end]])
        for t, target in enumerate(after):  # speculative verification: the context after each row
            cache.ngram_context[target] = history[t + 1 : t + 1 + keep]
        cache.ngram_context[slot] = history[-keep:]


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, mtp: MTPLayout | None = None) -> None:
        """mtp: build the checkpoint's MTP draft head too (`self.mtp`; None: the target model alone)."""
        super().__init__()
        self.config = config
        self.model = Qwen4ExpTextModel(config)
        # (unquantized, cuBLAS at decode too: it already streams this vocab-wide weight near the memory
        # roofline, 1.27 GB at ~4.2 TB/s on an H200 for the real width)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, decode_gemv=False)
        self.mtp = MultiTokenPredictor(config, mtp) if mtp is not None else None
        # the vision tower of a VLM config (checkpoint `model.visual.*`); None: a text-only model
        self.visual = VisionTower(config.vision) if config.vision is not None else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding's tensors (dense or packed) with lm_head when the config says so (again after
        materialising, and after the loader sets the formats)."""
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.tie(self.lm_head)

    @torch.no_grad()
    def encode_images(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The vision tower over flattened patches [P, patch_values] of images with patch grids `grids`:
        their features [sum t*h*w/merge^2, H], the rows a forward's `image_features` take."""
        if self.visual is None:
            raise ValueError("this model has no vision tower (its config.json has no vision_config)")
        return self.visual(patches, grids)

    @torch.no_grad()  # not inference_mode: its tensors cannot flow through torch.compile
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Logits [M, vocab] for `batch.logits_rows`."""
        return self.lm_head(self.model(batch, cache))

    @torch.no_grad()
    def forward_with_streams(
        self, batch: ForwardBatch, cache: ModelCache, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward, also returning every row's streams before the final mixer [N, hc*H]: at row t, the
        hidden state the draft head reads (with token t+1) to propose token t+2. rope: rotary tables the
        caller shares with the draft head's pass over the same rows."""
        pending = self.model.run_layers(batch, cache, rope)
        streams, mixed = final_mix(self.model.hyper_connection_mixer, pending, batch, every_row_streams=True)
        return self.lm_head(mixed), streams

    @torch.no_grad()
    def draft(
        self, batch: ForwardBatch, hidden_streams: torch.Tensor, cache: ModelCache, step: int = 0,
        rope: Rope | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-head forward; the draft layer's caches (`cache.draft_layers`) updated in place.

        batch: rows at the target's positions, each row's token the one AFTER its position (row t holds
        token t+1); hidden_streams [N, hc*H]: the target's `forward_with_streams` streams of those rows,
        or at a later draft step the streams the previous step returned. Returns the draft logits [M, V]
        and the output streams [M, hc*H] of `batch.logits_rows` (the next step's hidden input)."""
        if self.mtp is None:
            raise RuntimeError("this model was loaded without its MTP draft head (load_model(..., load_mtp=True))")
        embeddings = embed_rows(self.model.embed_tokens, batch.token_ids)
        if rope is None or rope.dtype != embeddings.dtype:  # rope: the verify forward's, at the same rows
            rope = Rope(self.model.rotary, batch, embeddings.dtype)
        pending = self.mtp(embeddings, hidden_streams, batch, cache.draft_layers, rope, step)  # the logits rows'
        streams, mixed, _ = self.mtp.hyper_connection_mixer.mix_pending(pending)
        return self.mtp.logits(self.lm_head, mixed), streams
