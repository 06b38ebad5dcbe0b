"""The MTP draft head (`mtp.*`; vLLM's `Qwen4ExpMultiTokenPredictor`, transformers has none): from the
target's state at position t and token t+1, a distribution for token t+2.

Inputs at position t: token t+1 and the target's multi-stream hidden state at t, taken before its final
mixer ([hc*H]; at later draft steps, the previous draft step's output streams instead):
- e = fc_embedding(pre_fc_norm_embedding(embed(token))) [H], with the target's embedding table;
- u = fc_hidden on each stream of pre_fc_norm_hidden(h), that norm over the whole hc*H vector (not one
  per stream: vLLM's GemmaRMSNorm(hc*H)); fc_hidden [H, H] is shared by the streams;
- streams = u + e on every stream (a hyper-connection combine with unit weight), then a QSA decoder layer
  without PLE (`DecoderLayer`, with its own K/V and indexer caches: `ModelCache.draft_layers`), run past
  its attention on the logits rows only (`MultiTokenPredictor.forward`), its MoE combine left to its final
  mixer (`mix_pending`);
- its own final mixer, then the target's lm_head unless the checkpoint has `mtp.shared_head.head`
  (`Qwen4ExpForCausalLM.draft` does this last part and picks the head).
A reduced draft vocabulary (`restrict_vocab`; FR-Spec, SGLang's speculative token map): the draft's logits
come from the head's rows of a set of frequent tokens only, a copy of those rows in the head's format (at
the real width the full head is 1.27 GB in bf16, 3/4 of the draft pass's bytes; 32k rows are 0.17 GB).
The logits keep the full vocabulary's shape, every other token at NOT_DRAFTED, so whatever picks a draft
(argmax, a draw, a grammar's mask) works unchanged, and verification, which reads the target's full
logits, stays exact: a draft is only ever a proposal.
A draft row at position t takes the target's position t (rotary angle, K/V row, indexer group), so the
draft layer's caches are paged with the same block tables and slots as the target's. They hold nothing
that is not addressed by position, so a rejected draft needs no undo: the next forward at that position
overwrites it. With several layers, draft step k runs layer k % n, as vLLM's module does.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tierlm.config import ModelConfig
from tierlm.model.checkpoint_layout import MTPLayout
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.decoder_layer import DecoderLayer
from tierlm.model.layers.hyper_connection import HyperConnection, PendingStreams
from tierlm.model.layers.norm import RMSNorm
from tierlm.model.layers.packed_linear import Linear
from tierlm.model.layers.rotary import Rope
from tierlm.model.model_cache import LayerCaches

# the logit of a token outside a reduced draft vocabulary (`restrict_vocab`): finite, so a row whose every
# drafted token a grammar masks still has a distribution (its remaining tokens, uniformly), and low enough
# that exp() of it after any temperature is 0 beside a drafted token's (fp16: its own lowest finite half)
NOT_DRAFTED = -1e30

# the most rows `layer_input` runs as one kernel: each row re-reads fc_embedding and fc_hidden (see
# kernels/mtp_input/triton.py). H200, real width, bf16 (bench/mtp_input_kernel.py, session 15): the kernel
# over torch 2.47x at 1 row, 1.64x at 2, 1.11x at 4, 0.36x at 16
FUSED_INPUT_MAX_ROWS = 4


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelConfig, layout: MTPLayout) -> None:
        super().__init__()
        c = config
        if not c.has_qsa:
            raise ValueError("the MTP draft head's layers are QSA layers: the config needs the indexer_* fields")
        if layout.num_layers < 1:
            raise ValueError(f"an MTP draft head needs at least one layer, got {layout.num_layers}")
        h = c.hidden_size
        self.hc_count, self.hidden_size = c.hc_count, h
        self.fc_embedding = Linear(h, h)
        self.fc_hidden = Linear(h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(c.hc_count * h, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, "indexed_attention") for _ in range(layout.num_layers))
        self.hyper_connection_mixer = HyperConnection(h, c.hc_count, c.hc_lowrank, c.rms_norm_eps, with_inject=False)
        # checkpoint name mtp.shared_head.head.weight (vocab-wide: on cuBLAS at decode, as the target's lm_head)
        self.shared_head = (nn.ModuleDict({"head": Linear(h, c.vocab_size, decode_gemv=False)}) if layout.shared_head
                            else None)
        self.vocab_size = c.vocab_size
        # a reduced draft vocabulary (`restrict_vocab`): its token ids [R] and the head's rows for them
        self.draft_token_ids: torch.Tensor | None = None
        self.draft_head: Linear | None = None

    def forward(
        self, embeddings: torch.Tensor, hidden_streams: torch.Tensor, batch: ForwardBatch,
        caches: list[LayerCaches], rope: Rope, step: int = 0,
    ) -> PendingStreams:
        """embeddings [N, H] of each row's next token; hidden_streams [N, hc*H] -> the draft layer's output
        streams of `batch`'s logits rows [M, hc*H] (before the draft's final mixer; its MoE combine
        pending). step: the draft step (picks the layer). Every row's K/V and indexer state is written;
        past the attention only the logits rows are computed (the others' outputs feed nothing: a pass
        over 1 + K verify rows or a prefill chunk proposes from one row a request), unless
        TIERLM_MTP_EVERY_ROW=1 (every row through the whole layer, then the logits rows taken)."""
        index = step % len(self.layers)
        streams = PendingStreams(self.layer_input(embeddings, hidden_streams))
        if not os.environ.get("TIERLM_MTP_EVERY_ROW"):
            return self.layers[index](streams, batch, caches[index], rope, None, wanted_rows_only=True)
        pending = self.layers[index](streams, batch, caches[index], rope, None)
        return pending if batch.logits_every_row else PendingStreams(batch.wanted_rows(pending.combined()))

    def layer_input(self, embeddings: torch.Tensor, hidden_streams: torch.Tensor) -> torch.Tensor:
        """The draft layer's input streams [N, hc*H]: fc_hidden of the normed hidden streams plus the
        projected embedding on every stream."""
        n = embeddings.shape[0]
        if self._fused_input_applies(embeddings):
            from tierlm.kernels.mtp_input.triton import mtp_layer_input

            return mtp_layer_input(embeddings, hidden_streams, self.pre_fc_norm_embedding.weight,
                                   self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps,
                                   self.fc_embedding.dense_weight(), self.fc_hidden.dense_weight())
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeddings))
        u = self.pre_fc_norm_hidden(hidden_streams).reshape(n * self.hc_count, self.hidden_size)
        u = self.fc_hidden(u).reshape(n, self.hc_count, self.hidden_size)
        return (u + e[:, None, :]).flatten(1)

    def _fused_input_applies(self, embeddings: torch.Tensor) -> bool:
        """`layer_input` as one launch (`kernels/mtp_input`, ~20 small kernels otherwise): on CUDA, at most
        FUSED_INPUT_MAX_ROWS rows, both fc layers held unquantized in the activations' dtype, unless
        TIERLM_NO_FUSED_MTP_INPUT=1."""
        if not embeddings.is_cuda or os.environ.get("TIERLM_NO_FUSED_MTP_INPUT"):
            return False
        weights = (self.fc_embedding.dense_weight(), self.fc_hidden.dense_weight(),
                   self.pre_fc_norm_embedding.weight, self.pre_fc_norm_hidden.weight)
        return (embeddings.shape[0] <= FUSED_INPUT_MAX_ROWS and self.pre_fc_norm_embedding.eps == self.pre_fc_norm_hidden.eps
                and all(w is not None and w.dtype == embeddings.dtype for w in weights))

    def head(self, target_lm_head: Linear) -> Linear:
        """The lm_head the draft's logits come from."""
        return self.shared_head["head"] if self.shared_head is not None else target_lm_head

    def restrict_vocab(self, token_ids: torch.Tensor, target_lm_head: Linear) -> None:
        """Draft from the tokens `token_ids` only (1-D, distinct, in the vocabulary): their rows of the head
        (`head`) copied into a head of their own, in its format (see the module)."""
        head = self.head(target_lm_head)
        if token_ids.dim() != 1 or token_ids.numel() == 0 or token_ids.is_floating_point():
            raise ValueError(f"speculative_token_map: expected a non-empty list of token ids, got a "
                             f"{token_ids.dtype} tensor of shape {tuple(token_ids.shape)}")
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"speculative_token_map: token id {low if low < 0 else high} is outside the model's "
                             f"vocabulary [0, {self.vocab_size})")
        if token_ids.unique().numel() != token_ids.numel():
            raise ValueError("speculative_token_map: a token id is listed more than once")
        device = next(head.parameters()).device
        self.draft_token_ids = token_ids.to(device=device, dtype=torch.int64)
        self.draft_head = head.output_rows(self.draft_token_ids)

    def logits(self, target_lm_head: Linear, x: torch.Tensor) -> torch.Tensor:
        """The draft's logits [M, vocab] of the final mixer's output x [M, H]; with a reduced vocabulary,
        NOT_DRAFTED outside it."""
        if self.draft_head is None:
            return self.head(target_lm_head)(x)
        drafted = self.draft_head(x)
        floor = max(NOT_DRAFTED, torch.finfo(drafted.dtype).min)
        out = drafted.new_full((drafted.shape[0], self.vocab_size), floor)
        return out.index_copy_(1, self.draft_token_ids, drafted)
