"""A differentiable forward of tierlm's `Qwen4ExpForCausalLM` over token windows [B, T] (training, evaluation).

The engine's forward serves requests: packed varlen rows, state in cache slots updated in place, no
autograd. Training wants B windows of equal length, each starting at position 0 with empty state (as a
new request does), and gradients. This module runs the same modules, with the same parameters and the
same math, batched over the windows:
- hyper-connections, the router, projections and norms: the modules' own torch paths on rows [B*T, ...];
  the routed experts all run on every row, weighted by the routing weights (0 off the row's top-k), which
  gives the routed sum without a per-expert loop of host syncs (`sparse_moe`);
- Gated DeltaNet: the causal conv over a zero history, then `chunk_gated_delta_rule` from a zero state,
  in fp32 with autocast off (as the engine's rule runs), in chunks of `GDN_CHUNK`;
- QSA: each query's indexer scores over the complete blocks it sees, its top blocks taken as the engine
  takes them (`ranking_keys`: ties to the lower block), and attention (SDPA) under a [T, T] mask of the
  chosen blocks' tokens and the query's open tail. Top-k passes no gradient, so the language-model loss
  does not train the indexer: `indexer_distillation` does when asked (KL from the dense attention's mass per
  block to a softmax of the indexer's scores, the indexer's input detached);
- PLE: n-gram rows from an EOS history (a request's start), the layer's gate, its dilated conv over a zero
  history;
- the MTP draft head at every position t < T - 1, from the target's streams at t and token t + 1.

The fused CUDA kernels have no backward: `torch_paths()` turns them off while a forward runs here.
Logits equal the engine's prefill of the same windows (tests/test_train_demo.py, fp32).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tierlm.kernels.gated_delta_rule import chunk_gated_delta_rule
from tierlm.kernels.norm_rope.naive import apply_rotary
from tierlm.kernels.qsa_block_scores.naive import block_of_key, ranking_keys
from tierlm.model.layers.decoder_layer import DecoderLayer
from tierlm.model.layers.gated_deltanet import GatedDeltaNet
from tierlm.model.layers.hyper_connection import HyperConnection
from tierlm.model.layers.moe import SparseMoeBlock
from tierlm.model.layers.ple import PLELayer
from tierlm.model.layers.qsa_attention import QSAAttention, QSAIndexer
from tierlm.model.ngram_hash import ngram_context
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM

# the kill switches of every fused CUDA kernel a training forward could reach
TORCH_PATH_SWITCHES = (
    "TIERLM_NO_FUSED_HC", "TIERLM_NO_FUSED_ROUTER", "TIERLM_NO_FUSED_MOE", "TIERLM_NO_FUSED_SHARED_EXPERT",
    "TIERLM_NO_FUSED_NORM_ROPE",
)

# the gated delta rule's chunk length here: half the engine's chunk loop (fewer, larger products); the
# decays within a chunk stay <= 1, so longer chunks cannot overflow
GDN_CHUNK = 128
# the attention kernels that take an arbitrary boolean mask (and its backward)
MASKED_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def torch_paths() -> Iterator[None]:
    """Inside: the modules take their torch paths (autograd works through them); the environment is
    restored after."""
    saved = {name: os.environ.get(name) for name in TORCH_PATH_SWITCHES}
    os.environ.update(dict.fromkeys(TORCH_PATH_SWITCHES, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Windows:
    """What every layer of one forward shares: B windows of T tokens at positions 0..T-1."""

    def __init__(
        self, model: Qwen4ExpForCausalLM, ids: torch.Tensor, dtype: torch.dtype, indexer_losses: list | None = None
    ) -> None:
        """indexer_losses: a list the QSA layers append their indexer's distillation loss to (None: none)."""
        self.batch, self.length = ids.shape
        self.indexer_losses = indexer_losses
        config = model.config
        positions = torch.arange(self.length, device=ids.device)
        self.rotary = model.model.rotary
        self.dtype = dtype
        cos, sin = self.rotary.cos_sin(positions, dtype)
        self.cos, self.sin = cos.repeat(self.batch, 1), sin.repeat(self.batch, 1)  # per row [B*T, rd]
        self.positions = positions
        self.ngram = None
        if config.ple_layer_ids:
            history = torch.cat([ids.new_full((self.batch, config.ngram_size - 1), config.eos_token_id), ids], -1)
            self.ngram = ngram_context(history, config.eos_token_id, config.ngram_size)  # [n, B, T]

    def sequences(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [B*T, ...] -> [B, T, ...]"""
        return rows.unflatten(0, (self.batch, self.length))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """Depthwise causal conv over time from a zero history: x [B, T, C], weight [C, 1, K] -> [B, T, C]."""
    history = (weight.shape[-1] - 1) * dilation
    padded = F.pad(x.transpose(1, 2), (history, 0))
    return F.conv1d(padded, weight.to(x.dtype), dilation=dilation, groups=x.shape[-1]).transpose(1, 2)


def gated_deltanet(layer: GatedDeltaNet, x: torch.Tensor, w: Windows) -> torch.Tensor:
    """x [B*T, H] -> [B*T, H]."""
    mixed, z, b, a = layer.in_proj(x)
    z = z.unflatten(-1, (layer.num_v_heads, layer.head_v_dim))
    beta = torch.sigmoid(b)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    conv = F.silu(causal_conv(w.sequences(mixed), layer.conv1d.weight))  # [B, T, C]
    q, k, v = layer.heads(conv)
    state = torch.zeros(w.batch, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=x.device)
    with torch.autocast(x.device.type, enabled=False):
        core, _ = chunk_gated_delta_rule(q, k, v.float(), w.sequences(g), w.sequences(beta.float()), state,
                                         chunk_size=GDN_CHUNK)
    core = core.flatten(0, 1).to(x.dtype)  # [B*T, nv, dv]
    return layer.out_proj(layer.norm(core, z).flatten(-2))


def indexer_scores(indexer: QSAIndexer, x: torch.Tensor, w: Windows) -> torch.Tensor:
    """Each query's fp32 block scores [B, T, G] (G = T // R complete blocks; blocks it cannot see yet
    -inf), as the engine scores them. x is detached: the indexer's training moves only the indexer."""
    r = indexer.ratio
    raw_q, raw_keys = indexer.project(x.detach())
    q_rows = apply_rotary(indexer.q_layernorm(raw_q), w.cos, w.sin)
    q, raw_keys = w.sequences(q_rows), w.sequences(raw_keys)  # [B, T, ih, id], [B, T, id]
    groups = w.length // r
    if groups == 0:
        return q.new_zeros(w.batch, w.length, 0, dtype=torch.float32)
    cos, sin = w.rotary.cos_sin(torch.arange(groups, device=x.device) * r, w.dtype)
    pooled = raw_keys[:, : groups * r].reshape(w.batch * groups, r, -1)
    block_keys = indexer.compress(pooled, cos.repeat(w.batch, 1), sin.repeat(w.batch, 1))
    block_keys = block_keys.unflatten(0, (w.batch, groups))
    with torch.autocast(x.device.type, enabled=False):  # fp32 scores, as the engine's
        products = torch.matmul(q.float(), block_keys.float()[:, None].transpose(-1, -2))  # [B, T, ih, G]
    scores = torch.relu(products).sum(dim=2) / math.sqrt(indexer.head_dim)
    visible = torch.arange(groups, device=x.device) < ((w.positions + 1) // r)[:, None]  # [T, G]
    return scores.masked_fill(~visible, float("-inf"))


@torch.no_grad()
def selection_mask(scores: torch.Tensor, indexer: QSAIndexer, w: Windows) -> torch.Tensor:
    """[B, T, T] bool from the block scores [B, T, G]: the keys each query attends to (its top blocks'
    tokens, ties to the lower block as the engine breaks them, and its open tail)."""
    r, t, groups = indexer.ratio, w.length, scores.shape[-1]
    mask_tail = _open_tail(w.positions, r)  # [T, T]
    if groups == 0:
        return mask_tail.expand(w.batch, t, t)
    top = torch.topk(ranking_keys(scores.detach()), min(indexer.block_topk, groups), dim=-1).values  # [B, T, K]
    chosen = torch.zeros(w.batch, t, groups, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, block_of_key(top), top >= 0)
    chosen_tokens = F.pad(chosen.repeat_interleave(r, dim=-1), (0, t - groups * r))  # [B, T, T]
    return chosen_tokens | mask_tail


def indexer_distillation(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, ratio: int, scale: float
                         ) -> torch.Tensor:
    """KL(attention's block distribution || the indexer's), averaged over the queries that see a block:
    the target is dense causal attention (q, k [B, heads, T, hd], no gradient), averaged over heads and
    summed over each visible complete block's tokens, renormalised; the indexer's is a softmax of its
    scores over the same blocks (DeepSeek-V3.2's lightning-indexer objective, on compressed blocks)."""
    length, groups = scores.shape[1:]
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        probs = logits.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)  # [B, T, T]
        mass = probs[..., : groups * ratio].unflatten(-1, (groups, ratio)).sum(-1)  # [B, T, G]
        visible = torch.isfinite(scores)
        mass = mass.masked_fill(~visible, 0.0)
        target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-9)
    rows = visible.any(-1)  # queries past the first block
    log_q = scores.masked_fill(~visible, -1e9).log_softmax(-1)
    kl = torch.where(visible, target * (target.clamp_min(1e-9).log() - log_q), 0.0).sum(-1)
    return (kl * rows).sum() / rows.sum().clamp_min(1)  # no host sync


def _open_tail(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """[T, T] bool: key s is in query p's open tail [(p+1)//R*R, p]."""
    start = (positions + 1) // ratio * ratio
    return (positions[None, :] >= start[:, None]) & (positions[None, :] <= positions[:, None])


def qsa_attention(layer: QSAAttention, x: torch.Tensor, w: Windows) -> torch.Tensor:
    """x [B*T, H] -> [B*T, H]."""
    n = x.shape[0]
    q_and_gate, k, v = layer.qkv_proj(x)
    q, gate = q_and_gate.reshape(n, layer.num_heads, 2 * layer.head_dim).chunk(2, dim=-1)
    q = apply_rotary(layer.q_norm(q), w.cos, w.sin)
    k = apply_rotary(layer.k_norm(k.reshape(n, layer.num_kv_heads, layer.head_dim)), w.cos, w.sin)
    v = v.reshape(n, layer.num_kv_heads, layer.head_dim)
    repeat = layer.num_heads // layer.num_kv_heads  # query head j reads KV head j // repeat
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and w.indexer_losses is not None):
        scores = indexer_scores(layer.indexer, x, w)
    mask = selection_mask(scores, layer.indexer, w)
    q, k, v = (w.sequences(t).transpose(1, 2) for t in (q, k, v.to(q.dtype)))  # [B, heads, T, hd]
    if w.indexer_losses is not None:
        w.indexer_losses.append(indexer_distillation(scores, q, k, layer.indexer.ratio, layer.scale))
    with sdpa_kernel(MASKED_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v, attn_mask=mask[:, None], scale=layer.scale)
    out = out.transpose(1, 2).flatten(0, 1).reshape(n, -1)
    return layer.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


def ple(layer: PLELayer, streams: torch.Tensor, w: Windows) -> torch.Tensor:
    """The PLE output [B*T, hc*H] added to the streams."""
    emb = layer.table.gather(layer.hasher.rows(w.ngram)).flatten(0, 1).to(streams.dtype)
    gated = layer.gated_values(streams, emb)
    conv = causal_conv(w.sequences(layer.norm_conv(gated)), layer.conv1d.weight, layer.ngram_size)
    return gated + F.silu(conv.flatten(0, 1))


def decoder_layer(layer: DecoderLayer, streams: torch.Tensor, w: Windows) -> torch.Tensor:
    """As `DecoderLayer.forward`: [PLE] -> mix -> GDN | QSA -> combine -> mix -> MoE -> combine."""
    if layer.ple is not None:
        streams = streams + ple(layer.ple, streams, w)
    x, inject = layer.attn_hyper_connection.mix(streams)
    if layer.layer_type == "linear_attention":
        out = gated_deltanet(layer.linear_attn, x, w)
    else:
        out = qsa_attention(layer.self_attn, x, w)
    streams = HyperConnection.combine(streams, out, inject)
    x, inject = layer.mlp_hyper_connection.mix(streams)
    return HyperConnection.combine(streams, sparse_moe(layer.mlp, x), inject)


def sparse_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The MoE block on x [N, H] with every expert run on every row and weighted by the routing weights
    (zero for the experts a row does not route to): the routed sum of the engine's, without its per-expert
    loop and the host syncs each expert's row selection costs. Cheap while experts are few and small."""
    weights, experts, shared_gate = block.route(x)
    dense = torch.zeros(x.shape[0], block.experts.num_experts, dtype=weights.dtype, device=x.device)
    dense = dense.scatter(1, experts, weights)  # [N, E]
    gate, up = torch.einsum("nh,eih->eni", x, block.experts.gate_up_proj).chunk(2, dim=-1)  # [E, N, I] each
    outputs = torch.einsum("eni,ehi->enh", F.silu(gate) * up, block.experts.down_proj)  # [E, N, H]
    routed = torch.einsum("ne,enh->nh", dense.to(outputs.dtype), outputs)
    return routed.to(x.dtype) + shared_gate * block.shared_expert(x)


class Output(NamedTuple):
    logits: torch.Tensor  # [B, T, V]: the next token's
    draft_logits: torch.Tensor | None  # [B, T-1, V]: the MTP head's, for the token after next (row t reads
    # token t+1); None unless asked for
    indexer_loss: torch.Tensor | None  # the mean of the QSA layers' `indexer_distillation`; None unless asked


def forward(model: Qwen4ExpForCausalLM, ids: torch.Tensor, with_draft: bool = False,
            train_indexers: bool = False) -> Output:
    """ids [B, T] -> `Output`. with_draft: run the MTP head too; train_indexers: also the indexers'
    distillation loss (the only gradient their weights get)."""
    dtype = torch.get_autocast_dtype(ids.device.type) if torch.is_autocast_enabled(ids.device.type) else None
    losses = [] if train_indexers else None
    with torch_paths():
        inner = model.model
        streams = inner.embed_tokens(ids.flatten()).repeat(1, model.config.hc_count)
        w = Windows(model, ids, dtype or streams.dtype, losses)
        for layer in inner.layers:
            streams = decoder_layer(layer, streams, w)
        logits = model.lm_head(inner.mix(streams)).unflatten(0, (w.batch, w.length))
        draft_logits = None
        if with_draft and model.mtp is not None:
            mtp = model.mtp
            hidden = w.sequences(streams)[:, :-1].flatten(0, 1)
            embeddings = inner.embed_tokens(ids[:, 1:].flatten())
            draft_windows = Windows(model, ids[:, 1:], w.dtype, losses)  # positions 0..T-2, as the target's rows
            draft = decoder_layer(mtp.layers[0], mtp.layer_input(embeddings, hidden), draft_windows)
            draft_logits = mtp.head(model.lm_head)(mtp.hyper_connection_mixer.mix(draft)[0])
            draft_logits = draft_logits.unflatten(0, (w.batch, w.length - 1))
    indexer_loss = torch.stack(losses).mean() if losses else None
    return Output(logits, draft_logits, indexer_loss)
