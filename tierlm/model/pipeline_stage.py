"""One pipeline rank's part of the model: which tensors it holds (`StageLayout`) and its forward
(`PipelineStage`).

A rank holds a contiguous range of decoder layers; the first rank also the token embedding, the last
rank the final hyper-connection mixer and lm_head (and the embedding too when lm_head is tied to it), and
under speculative decoding the MTP draft head (`mtp.*`; it embeds the tokens too, so the last rank then
holds the embedding as well).
`PipelineStage` is cut out of a `Qwen4ExpForCausalLM` built on the meta device, so its modules keep the
checkpoint's names (`model.layers.17.mlp...`) and the loader fills it as it fills the whole model.

Its forward takes the same `ForwardBatch` and the rank's own `ModelCache` (whose `layers` are this
rank's layers, in order). The first stage starts from the embedding, the others from
`batch.stage_input`: the multi-stream residual [N, hc_count * hidden] the previous stage returned. A
stage that is not the last returns that residual for every row; the last returns the logits of
`batch.logits_rows` (`forward_with_streams`: and every row's streams before the final mixer, what the
draft head reads; `draft`: the draft head's forward, as the whole model's). The last layer's MoE combine
is done before a stage hands its residual on (the next rank receives whole streams); on the last stage
the final mixer does it, as in the whole model (`final_mix`). What crosses ranks, and how, is `engine/pipeline.py`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.hyper_connection import PendingStreams
from tierlm.model.model_cache import ModelCache
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM, embed_streams, final_mix, run_decoder_layers


@dataclass(frozen=True)
class StageLayout:
    """Rank `rank` of `world_size` holds decoder layers `layer_ids` (contiguous, ascending)."""

    rank: int
    world_size: int
    layer_ids: tuple[int, ...]
    tie_word_embeddings: bool = False
    draft_head: bool = False  # the last rank holds the MTP draft head (speculative decoding)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def has_embedding(self) -> bool:
        """The first stage embeds the tokens; the last one needs the table too when lm_head is tied to it, or
        when it holds the draft head (which embeds each row's next token)."""
        return self.is_first or (self.is_last and (self.tie_word_embeddings or self.draft_head))

    def holds(self, name: str) -> bool:
        """Whether a checkpoint tensor (its canonical `model.`-prefixed name) is loaded on this rank."""
        parts = name.split(".")
        if name.startswith("model.layers."):
            return int(parts[2]) in self.layer_ids
        if name.startswith(("model.embed_tokens.", "model.visual.")):
            return self.has_embedding
        if name.startswith(("model.hyper_connection_mixer.", "lm_head.")):
            return self.is_last
        if name.startswith("mtp."):
            return self.draft_head and self.is_last
        return True

    def describe(self) -> str:
        ends = [part for part, held in (("embedding", self.has_embedding), ("lm_head", self.is_last),
                                        ("MTP draft head", self.draft_head and self.is_last)) if held]
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
        self.mtp = full.mtp if layout.draft_head and layout.is_last else None

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.layout.is_last:
            self.model.embed_tokens.tie(self.lm_head)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The next stage's input [N, hc * hidden], or on the last stage the logits [M, vocab]."""
        pending = self._run_layers(batch, cache)
        if not self.layout.is_last:
            return pending.combined()
        return self.lm_head(final_mix(self.model.hyper_connection_mixer, pending, batch)[1])

    @torch.no_grad()
    def forward_with_streams(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage: the logits [M, vocab] and every row's streams before the final mixer [N, hc*H]
        (as `Qwen4ExpForCausalLM.forward_with_streams`: what the draft head reads)."""
        pending = self._run_layers(batch, cache)
        streams, mixed = final_mix(self.model.hyper_connection_mixer, pending, batch, every_row_streams=True)
        return self.lm_head(mixed), streams

    def draft(self, batch: ForwardBatch, hidden_streams: torch.Tensor, cache: ModelCache, step: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft head's forward on the last stage: the whole model's (`Qwen4ExpForCausalLM.draft`), on
        the parts this stage holds (embedding, rotary, draft head, lm_head)."""
        return Qwen4ExpForCausalLM.draft(self, batch, hidden_streams, cache, step)

    def _run_layers(self, batch: ForwardBatch, cache: ModelCache) -> PendingStreams:
        text = self.model
        if self.layout.is_first:
            streams = embed_streams(text.embed_tokens, batch, self.config.hc_count)
        else:
            streams = batch.stage_input
        return run_decoder_layers(self.decoder_layers(), streams, batch, cache, self.config, text.rotary)
