"""One Qwen4-Exp decoder layer: [PLE] -> hyper-connection mix -> GDN or QSA -> combine -> mix -> MoE -> combine.

There are no pre-layer norms: the hyper-connections' mixes normalise. Both combines are done by the mix
after them, in its launches: the attention's by the MoE's mix (`combine_and_mix`), the MoE's by the next
layer's first mix or the final mixer (the layer takes and returns `PendingStreams`; a PLE layer, which
reads the streams itself, gets them combined first). The target model stacks these
(`model/qwen4_exp.py`); the MTP draft head runs QSA ones without PLE (`model/mtp.py`). A layer reads and
writes only the caches it is handed (`LayerCaches`).
"""

from __future__ import annotations

from torch import nn

from tierlm.config import ModelConfig
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.gated_deltanet import GatedDeltaNet
from tierlm.model.layers.hyper_connection import HyperConnection, PendingStreams, fold_layer_combine
from tierlm.model.layers.moe import SparseMoeBlock
from tierlm.model.layers.ple import NgramIds, PLELayer
from tierlm.model.layers.qsa_attention import QSAAttention
from tierlm.model.layers.rotary import Rope
from tierlm.model.model_cache import LayerCaches


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, ple_index: int | None = None) -> None:
        """layer_type: linear_attention (GDN) or indexed_attention (QSA); ple_index: this layer's position
        among the PLE layers, or None for a layer without PLE."""
        super().__init__()
        c = config
        self.layer_type = layer_type
        self.ple = PLELayer(c, ple_index) if ple_index is not None else None
        hc = {"hidden_size": c.hidden_size, "hc_count": c.hc_count, "lowrank": c.hc_lowrank, "eps": c.rms_norm_eps}
        self.attn_hyper_connection = HyperConnection(**hc, with_inject=True)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = QSAAttention(c)
        self.mlp_hyper_connection = HyperConnection(**hc, with_inject=True)
        self.mlp = SparseMoeBlock(c)

    def forward(
        self, streams: PendingStreams, batch: ForwardBatch, caches: LayerCaches, rope: Rope,
        ngram_ids: NgramIds | None, wanted_rows_only: bool = False,
    ) -> PendingStreams:
        """streams [N, hc*H] (a combine maybe pending) -> [N, hc*H] with the MoE's combine pending (done
        here under TIERLM_NO_FOLD_LAYER_COMBINE=1); ngram_ids: the PLE layers' n-gram ids (None without
        PLE, or when the host gathered the PLE embeddings). wanted_rows_only: past the attention (which
        writes every row's caches) only `batch`'s logits rows go on, and the result is theirs [M, hc*H]
        (the MTP head: its one layer's other rows feed nothing)."""
        if self.ple is not None:
            streams = PendingStreams(self.ple(streams.combined(), batch, caches.ple, ngram_ids))
        streams, x, inject = self.attn_hyper_connection.mix_pending(streams)
        if self.layer_type == "linear_attention":
            out = self.linear_attn(x, batch, caches.gdn)
        else:
            out = self.self_attn(x, batch, caches.kv, caches.indexer, rope)
        if wanted_rows_only and not batch.logits_every_row:
            streams, out, inject = (batch.wanted_rows(t) for t in (streams, out, inject))
            if streams.shape[0] == 0:  # a pass that fills the caches only (a prefill chunk that samples nothing)
                return PendingStreams(streams)
        streams, x, inject = self.mlp_hyper_connection.combine_and_mix(streams, out, inject)
        moe_output = self.mlp(x, batch.static)
        if fold_layer_combine():
            return PendingStreams(streams, moe_output, inject)
        return PendingStreams(HyperConnection.combine(streams, moe_output, inject))
