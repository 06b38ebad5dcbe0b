"""One pipeline rank's part of the model: which tensors it holds (`StageLayout`) and its forward
(`PipelineStage`).

A rank holds a contiguous range of decoder layers; the first rank also the token embedding, the last
rank the final hyper-connection mixer and lm_head (and the embedding too when lm_head is tied to it).
`PipelineStage` is cut out of a `Qwen4ExpForCausalLM` built on the meta device, so its modules keep the
checkpoint's names (`model.layers.17.mlp...`) and the loader fills it as it fills the whole model.

Its forward takes the same `ForwardBatch` and the rank's own `ModelCache` (whose `layers` are this
rank's layers, in order). The first stage starts from the embedding, the others from
`batch.stage_input`: the multi-stream residual [N, hc_count * hidden] the previous stage returned. A
stage that is not the last returns that residual for every row; the last returns the logits of
`batch.logits_rows`. What crosses ranks, and how, is `engine/pipeline.py`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.model_cache import ModelCache
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM, embed_streams, run_decoder_layers


@dataclass(frozen=True)
class StageLayout:
    """Rank `rank` of `world_size` holds decoder layers `layer_ids` (contiguous, ascending)."""

    rank: int
    world_size: int
    layer_ids: tuple[int, ...]
    tie_word_embeddings: bool = False

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def has_embedding(self) -> bool:
        """The first stage embeds the tokens; the last one needs the table too when lm_head is tied to it."""
        return self.is_first or (self.is_last and self.tie_word_embeddings)

    def holds(self, name: str) -> bool:
        """Whether a checkpoint tensor (its canonical `model.`-prefixed name) is loaded on this rank."""
        parts = name.split(".")
        if name.startswith("model.layers."):
            return int(parts[2]) in self.layer_ids
        if name.startswith(("model.embed_tokens.", "model.visual.")):
            return self.has_embedding
        if name.startswith(("model.hyper_connection_mixer.", "lm_head.")):
            return self.is_last
        return True

    def describe(self) -> str:
        ends = [part for part, held in (("embedding", self.has_embedding), ("lm_head", self.is_last)) if held]
        extra = f" + {', '.join(ends)}" if ends else ""
        return f"layers {self.layer_ids[0]}-{self.layer_ids[-1]} ({len(self.layer_ids)}){extra}"


class _StageTextModel(nn.Module):
    """The `model.` part of a stage: the held layers under their global indices, and the ends it holds."""

    def __init__(self, full: Qwen4ExpForCausalLM, layout: StageLayout) -> None:
        super().__init__()
        text = full.model
        self.config = text.config
        self.rotary = text.rotary
        if layout.has_embedding:
            self.embed_tokens = text.embed_tokens
        self.layers = nn.ModuleDict({str(i): text.layers[i] for i in layout.layer_ids})
        if layout.is_last:
            self.hyper_connection_mixer = text.hyper_connection_mixer


class PipelineStage(nn.Module):
    """A `Qwen4ExpForCausalLM` cut down to one rank's `StageLayout` (built on the meta device)."""

    def __init__(self, full: Qwen4ExpForCausalLM, layout: StageLayout) -> None:
        super().__init__()
        self.config = full.config
        self.layout = layout
        self.model = _StageTextModel(full, layout)
        if layout.has_embedding and full.visual is not None:
            self.visual = full.visual
        if layout.is_last:
            self.lm_head = full.lm_head

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.layout.is_last:
            self.model.embed_tokens.tie(self.lm_head)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The next stage's input [N, hc * hidden], or on the last stage the logits [M, vocab]."""
        text = self.model
        if self.layout.is_first:
            streams = embed_streams(text.embed_tokens, batch, self.config.hc_count)
        else:
            streams = batch.stage_input
        streams = run_decoder_layers(self.decoder_layers(), streams, batch, cache, self.config, text.rotary)
        if not self.layout.is_last:
            return streams
        mixed, _ = text.hyper_connection_mixer.mix(batch.wanted_rows(streams))
        return self.lm_head(mixed)
