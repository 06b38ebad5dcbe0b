"""The Hugging Face checkpoint layout of a Qwen4-Exp text model: every tensor's name, shape and kind.

One table serves three users: the loader (what must be present, with which shape), the demo-model
generator (what to write) and the capacity planner (bytes per tier). Names are given with the `model.`
prefix that `Qwen4ExpForCausalLM` uses; the VLM checkpoint's `model.language_model.` prefix is mapped by
the loader. Experts are per-expert tensors on disk; PLE tables are split into `shard_{j}` parts exactly as
`torch.chunk(table, split_ngram_parts)` splits them.

A VLM config (one with a `vision_config`) adds the vision tower's `model.visual.*` tensors, always dense
(the weight formats of `quantization` cover the text model only).

A checkpoint may carry an MTP draft head (`mtp.*`, vLLM's names; transformers ignores it): it is part of
the layout only when asked for (`MTPLayout`), since the target model alone never reads it.

An fp8 PLE table (vLLM's format) adds its `ngram_embedding.weight_scale`. With a quantization config, each
linear or embedding weight whose module is quantized is replaced by
its format's tensors (e.g. `weight_packed` int32, `weight_scale`, `weight_shape`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierlm.config import ModelConfig, VisionConfig
from tierlm.model.ngram_hash import NgramHashSpec
from tierlm.model.quantization.base import DENSE, QuantizationError
from tierlm.model.quantization.config import QuantizationConfig

PREFIX = "model."
VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."
MTP_SHARED_HEAD = "mtp.shared_head.head.weight"
PLE_FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    # weight | norm (Gemma 1+w, zero-init) | ones | int64 (hash buffers) | ple_table | quantized (packed
    # integers and their shapes) | scale (quantization scales)
    kind: str = "weight"
    # int32 | int64 (integer tensors of quantized modules), float8_e4m3fn (an fp8 PLE table) or float32 (its
    # scale); None: as the kind says
    dtype: str | None = None


@dataclass(frozen=True)
class MTPLayout:
    """The MTP draft head a checkpoint carries: its decoder layers (`mtp.layers.{k}`) and whether it has
    its own lm_head (`mtp.shared_head.head`) instead of the target's; and, not in the checkpoint, the rows
    of that head a reduced draft vocabulary copies at load (`MultiTokenPredictor.restrict_vocab`; 0: none)."""

    num_layers: int = 1
    shared_head: bool = False
    draft_vocab_rows: int = 0


def ple_shard_rows(rows: int, parts: int) -> list[int]:
    """Row counts of the shards `torch.chunk(rows, parts)` makes (the last is shorter; maybe fewer parts)."""
    size = math.ceil(rows / parts)
    return [min(size, rows - start) for start in range(0, rows, size)]


def _hyper_connection(prefix: str, config: ModelConfig, with_inject: bool) -> list[TensorSpec]:
    width = config.hc_count * config.hidden_size
    specs = [
        TensorSpec(f"{prefix}.hc_norm.weight", (width,), "norm"),
        TensorSpec(f"{prefix}.input_mix_weight_down.weight", (config.hc_lowrank, width)),
        TensorSpec(f"{prefix}.input_mix_weight_up.weight", (width, config.hc_lowrank)),
    ]
    if with_inject:
        specs.append(TensorSpec(f"{prefix}.block_inject_weight.weight", (config.hc_count, width)))
    return specs


def _gated_deltanet(prefix: str, c: ModelConfig) -> list[TensorSpec]:
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    h = c.hidden_size
    return [
        TensorSpec(f"{prefix}.in_proj_qkv.weight", (conv_dim, h)),
        TensorSpec(f"{prefix}.in_proj_z.weight", (value_dim, h)),
        TensorSpec(f"{prefix}.in_proj_b.weight", (c.linear_num_value_heads, h)),
        TensorSpec(f"{prefix}.in_proj_a.weight", (c.linear_num_value_heads, h)),
        TensorSpec(f"{prefix}.conv1d.weight", (conv_dim, 1, c.linear_conv_kernel_dim)),
        TensorSpec(f"{prefix}.dt_bias", (c.linear_num_value_heads,), "ones"),
        TensorSpec(f"{prefix}.A_log", (c.linear_num_value_heads,), "a_log"),
        TensorSpec(f"{prefix}.norm.weight", (c.linear_value_head_dim,), "ones"),
        TensorSpec(f"{prefix}.out_proj.weight", (h, value_dim)),
    ]


def _qsa_attention(prefix: str, c: ModelConfig) -> list[TensorSpec]:
    h, hd = c.hidden_size, c.head_dim
    q_out, kv_out = 2 * c.num_attention_heads * hd, c.num_key_value_heads * hd
    specs = [
        TensorSpec(f"{prefix}.q_proj.weight", (q_out, h)),
        TensorSpec(f"{prefix}.k_proj.weight", (kv_out, h)),
        TensorSpec(f"{prefix}.v_proj.weight", (kv_out, h)),
        TensorSpec(f"{prefix}.o_proj.weight", (h, c.num_attention_heads * hd)),
        TensorSpec(f"{prefix}.q_norm.weight", (hd,), "norm"),
        TensorSpec(f"{prefix}.k_norm.weight", (hd,), "norm"),
        TensorSpec(f"{prefix}.indexer.index_qk_proj.weight", ((c.indexer_n_heads + 1) * c.indexer_head_dim, h)),
        TensorSpec(f"{prefix}.indexer.q_layernorm.weight", (c.indexer_head_dim,), "norm"),
        TensorSpec(f"{prefix}.indexer.k_layernorm.weight", (c.indexer_head_dim,), "norm"),
    ]
    if c.attention_bias:
        specs += [
            TensorSpec(f"{prefix}.q_proj.bias", (q_out,), "bias"),
            TensorSpec(f"{prefix}.k_proj.bias", (kv_out,), "bias"),
            TensorSpec(f"{prefix}.v_proj.bias", (kv_out,), "bias"),
            TensorSpec(f"{prefix}.o_proj.bias", (h,), "bias"),
        ]
    return specs


def _moe(prefix: str, c: ModelConfig) -> list[TensorSpec]:
    h, i, s = c.hidden_size, c.moe_intermediate_size, c.shared_expert_intermediate_size
    specs = [TensorSpec(f"{prefix}.gate.weight", (c.num_experts, h))]
    for e in range(c.num_experts):
        specs += [
            TensorSpec(f"{prefix}.experts.{e}.gate_proj.weight", (i, h)),
            TensorSpec(f"{prefix}.experts.{e}.up_proj.weight", (i, h)),
            TensorSpec(f"{prefix}.experts.{e}.down_proj.weight", (h, i)),
        ]
    specs += [
        TensorSpec(f"{prefix}.shared_expert.gate_proj.weight", (s, h)),
        TensorSpec(f"{prefix}.shared_expert.up_proj.weight", (s, h)),
        TensorSpec(f"{prefix}.shared_expert.down_proj.weight", (h, s)),
        TensorSpec(f"{prefix}.shared_expert_gate.weight", (1, h)),
    ]
    return specs


def _ple(prefix: str, c: ModelConfig, ple_index: int, ple_fp8: bool) -> list[TensorSpec]:
    spec = NgramHashSpec.from_config(c, ple_index)
    width = c.hc_count * c.hidden_size
    table = f"{prefix}.ple_embedding"
    specs = [
        TensorSpec(f"{table}.ngram_embedding.shard_{j}.weight", (rows, c.ngram_head_dim), "ple_table",
                   PLE_FP8 if ple_fp8 else None)
        for j, rows in enumerate(ple_shard_rows(spec.table_rows, c.split_ngram_parts))
    ]
    if ple_fp8:  # one global scale (a scalar or [1])
        specs.append(TensorSpec(f"{table}.ngram_embedding.weight_scale", (1,), "ple_scale", "float32"))
    specs += [
        TensorSpec(f"{table}.layer_multipliers", (c.ngram_size,), "int64"),
        TensorSpec(f"{table}.ngram_heads_vocab_sizes", (spec.num_heads,), "int64"),
        TensorSpec(f"{table}.ngram_heads_offsets", (spec.num_heads,), "int64"),
        TensorSpec(f"{prefix}.key_proj.weight", (width, c.ple_embed_dim)),
        TensorSpec(f"{prefix}.value_proj.weight", (c.hidden_size, c.ple_embed_dim)),
        TensorSpec(f"{prefix}.norm_key.weight", (width,), "norm"),
        TensorSpec(f"{prefix}.norm_query.weight", (width,), "norm"),
        TensorSpec(f"{prefix}.norm_conv.weight", (width,), "norm"),
        TensorSpec(f"{prefix}.conv1d.weight", (width, 1, c.ple_conv_kernel_size)),
    ]
    return specs


def ple_hash_buffers(c: ModelConfig, ple_index: int) -> dict[str, list[int]]:
    """The int64 buffers a checkpoint stores beside each PLE table (recomputed and compared on load)."""
    spec = NgramHashSpec.from_config(c, ple_index)
    return {
        "layer_multipliers": list(spec.multipliers),
        "ngram_heads_vocab_sizes": list(spec.head_sizes),
        "ngram_heads_offsets": list(spec.head_offsets),
    }


def checkpoint_layout(
    c: ModelConfig, quantization: QuantizationConfig | None = None, ple_fp8: bool = False,
    mtp: MTPLayout | None = None,
) -> list[TensorSpec]:
    """Every tensor of a `Qwen4ExpForCausalLM` checkpoint, in module order. ple_fp8: the PLE tables are
    float8 e4m3 with one global scale each; mtp: the MTP draft head's tensors too (after the target's)."""
    specs = _dense_layout(c, ple_fp8)
    if mtp is not None:
        specs += _mtp(c, mtp)
    if quantization is not None:
        specs = [q for spec in specs for q in _stored(spec, quantization)]
    return specs + (_vision(c.vision) if c.vision is not None else [])


def _vision(v: VisionConfig) -> list[TensorSpec]:
    """The vision tower (`model/vision/tower.py`): patch embed, position table, pre-LN blocks, merger."""
    p, d, merged = VISION_PREFIX, v.hidden_size, v.hidden_size * v.spatial_merge_size**2
    kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)

    def linear(name: str, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec(f"{name}.weight", (out_features, in_features)),
                TensorSpec(f"{name}.bias", (out_features,), "bias")]

    def layer_norm(name: str, width: int) -> list[TensorSpec]:
        return [TensorSpec(f"{name}.weight", (width,), "ones"), TensorSpec(f"{name}.bias", (width,), "bias")]

    specs = [
        TensorSpec(f"{p}patch_embed.proj.weight", (d, v.in_channels, *kernel)),
        TensorSpec(f"{p}patch_embed.proj.bias", (d,), "bias"),
        TensorSpec(f"{p}pos_embed.weight", (v.num_position_embeddings, d)),
    ]
    for i in range(v.depth):
        b = f"{p}blocks.{i}"
        specs += layer_norm(f"{b}.norm1", d) + linear(f"{b}.attn.qkv", 3 * d, d) + linear(f"{b}.attn.proj", d, d)
        specs += layer_norm(f"{b}.norm2", d) + linear(f"{b}.mlp.linear_fc1", v.intermediate_size, d)
        specs += linear(f"{b}.mlp.linear_fc2", d, v.intermediate_size)
    specs += layer_norm(f"{p}merger.norm", d) + linear(f"{p}merger.linear_fc1", merged, merged)
    return specs + linear(f"{p}merger.linear_fc2", v.out_hidden_size, merged)


def weight_module(spec: TensorSpec) -> tuple[str, str] | None:
    """(module, kind) of a linear or embedding weight a quantization config may cover, else None."""
    if spec.kind != "weight" or len(spec.shape) != 2 or not spec.name.endswith(".weight"):
        return None
    module = spec.name[: -len(".weight")]
    return module, "embedding" if module.endswith("embed_tokens") else "linear"


def _stored(spec: TensorSpec, quantization: QuantizationConfig) -> list[TensorSpec]:
    """The tensors a checkpoint stores for one dense-layout tensor under `quantization`."""
    found = weight_module(spec)
    if found is None:
        return [spec]
    module, kind = found
    fmt = quantization.format_of(module, kind)
    if fmt == DENSE:
        return [spec]
    try:
        tensors = fmt.checkpoint_tensors(*spec.shape)
    except QuantizationError as exc:
        raise QuantizationError(f"{module} ({fmt.label}): {exc}") from None
    return [
        TensorSpec(f"{module}.{name}", t.shape, "quantized" if t.dtype else "scale", t.dtype)
        for name, t in tensors.items()
    ]


def _decoder_layer(prefix: str, c: ModelConfig, layer_type: str) -> list[TensorSpec]:
    """A decoder layer's hyper-connections, token mixer and MoE (PLE, where a layer has it, comes first)."""
    specs = _hyper_connection(f"{prefix}.attn_hyper_connection", c, with_inject=True)
    if layer_type == "linear_attention":
        specs += _gated_deltanet(f"{prefix}.linear_attn", c)
    else:
        specs += _qsa_attention(f"{prefix}.self_attn", c)
    specs += _hyper_connection(f"{prefix}.mlp_hyper_connection", c, with_inject=True)
    return specs + _moe(f"{prefix}.mlp", c)


def _mtp(c: ModelConfig, mtp: MTPLayout) -> list[TensorSpec]:
    """The draft head (vLLM's `Qwen4ExpMultiTokenPredictor`): input projections and norms, QSA decoder
    layers without PLE, its own final mixer, and maybe its own lm_head."""
    h, p = c.hidden_size, MTP_PREFIX
    specs = [
        TensorSpec(f"{p}fc_embedding.weight", (h, h)),
        TensorSpec(f"{p}fc_hidden.weight", (h, h)),
        TensorSpec(f"{p}pre_fc_norm_embedding.weight", (h,), "norm"),
        TensorSpec(f"{p}pre_fc_norm_hidden.weight", (c.hc_count * h,), "norm"),
    ]
    for k in range(mtp.num_layers):
        specs += _decoder_layer(f"{p}layers.{k}", c, "indexed_attention")
    specs += _hyper_connection(f"{p}hyper_connection_mixer", c, with_inject=False)
    if mtp.shared_head:
        specs.append(TensorSpec(MTP_SHARED_HEAD, (c.vocab_size, h)))
    return specs


def _dense_layout(c: ModelConfig, ple_fp8: bool) -> list[TensorSpec]:
    specs = [TensorSpec(f"{PREFIX}embed_tokens.weight", (c.vocab_size, c.hidden_size))]
    for layer in range(c.num_hidden_layers):
        p = f"{PREFIX}layers.{layer}"
        ple_index = c.ple_index(layer)
        if ple_index is not None:
            specs += _ple(f"{p}.ple", c, ple_index, ple_fp8)
        specs += _decoder_layer(p, c, c.layer_types[layer])
    specs += _hyper_connection(f"{PREFIX}hyper_connection_mixer", c, with_inject=False)
    if not c.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (c.vocab_size, c.hidden_size)))
    return specs
