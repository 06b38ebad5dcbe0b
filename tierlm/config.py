"""Model configuration: a Qwen4-Exp `config.json` read into one validated, frozen dataclass.

Owns the derivations and validation rules that transformers' `Qwen4ExpTextConfig` applies (layer types
from `full_attention_interval`, `full_attention` and transformers 5.17's `qwen_sparse_attention` read as
`indexed_attention`, one-indexed and sorted `ple_layer_ids`, the QSA and PLE field rules), so that a
checkpoint tierlm accepts is one the reference accepts too. Every rejection is a `ConfigError` naming the field and the rule. It does not own engine or
server settings; those live beside the code that uses them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# how weights are loaded: "auto" reads the checkpoint; "dummy" (vLLM's name) draws random weights from
# config.json alone (benchmarks at any size without writing a checkpoint)
LOAD_FORMATS = ("auto", "dummy")

SUPPORTED_ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
LAYER_TYPES = ("linear_attention", "indexed_attention")
# names other checkpoints give the QSA layer: the real checkpoint's `full_attention`, and transformers
# 5.17's `qwen_sparse_attention` (renamed `indexed_attention` in 5.19; vLLM accepts both)
LAYER_TYPE_ALIASES = {"full_attention": "indexed_attention", "qwen_sparse_attention": "indexed_attention"}
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


class ConfigError(ValueError):
    """A config.json that tierlm (and the reference) cannot run; the message names the field and rule."""


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (`vision_config`, transformers' `Qwen4ExpVisionConfig`) and the prompt's image
    token ids (top-level fields of the VLM config). Defaults are the reference's."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_grid_side(self) -> int:
        """Side of the square learned position table (num_position_embeddings = side^2)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_values(self) -> int:
        """Values of one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, vision: dict[str, Any], top: dict[str, Any]) -> VisionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vision.items() if k in known}
        if "num_attention_heads" in vision and "num_heads" not in vision:
            values["num_heads"] = vision["num_attention_heads"]
        rope = vision.get("rope_parameters") or {}
        values["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if key in top:
                values[key] = int(top[key])
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(values.get(key), (list, tuple)):
                sizes = set(values[key])
                if len(sizes) != 1:
                    raise ConfigError(f"vision_config.{key}: only square sizes are supported, got {values[key]}")
                values[key] = sizes.pop()
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ConfigError(
                f"vision_config.hidden_act: only 'gelu_pytorch_tanh' is supported, got {self.hidden_act!r}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(
                f"vision_config.num_heads: hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a "
                "whole head dim divisible by 4 (2-D rotary: half the dims per axis, rotate-half in each)"
            )
        if self.position_grid_side**2 != self.num_position_embeddings:
            raise ConfigError(
                f"vision_config.num_position_embeddings: must be a square (the learned position grid), "
                f"got {self.num_position_embeddings}"
            )
        if min(self.depth, self.patch_size, self.temporal_patch_size, self.spatial_merge_size) <= 0:
            raise ConfigError("vision_config: depth, patch_size, temporal_patch_size, spatial_merge_size must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """The text model's architecture. Field names and defaults follow `Qwen4ExpTextConfig`."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    layer_types: tuple[str, ...] = ()
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    # decoder layers of the MTP draft head (`mtp_num_hidden_layers`, or `num_nextn_predict_layers`); None:
    # the config does not say (a checkpoint's `mtp.*` tensors then make one layer, as vLLM assumes)
    mtp_num_hidden_layers: int | None = None
    # interleaved M-RoPE: how many rotary frequencies take the H and W positions (the rest take T); only
    # positions of image tokens differ per axis, text rows are plain 1-D RoPE
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    # the vision tower (a VLM config with a `vision_config`); None: a text-only model
    vision: VisionConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    architecture: str = "Qwen4ExpForCausalLM"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_id(self) -> int | None:
        """The EOS the n-gram hash uses (the reference takes the first of a list)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def output_gate_act(self) -> str:
        return self.output_gate_type or self.hidden_act

    @property
    def num_ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_head_dim(self) -> int:
        return self.ple_embed_dim // self.num_ngram_heads

    @property
    def has_qsa(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def num_mtp_layers(self) -> int:
        """Decoder layers of the MTP draft head, for a checkpoint that has one (vLLM's default: 1)."""
        return 1 if self.mtp_num_hidden_layers is None else self.mtp_num_hidden_layers

    def ple_index(self, layer_idx: int) -> int | None:
        """0-based position of decoder layer `layer_idx` (0-based) among the PLE layers, or None."""
        one_indexed = layer_idx + 1
        return self.ple_layer_ids.index(one_indexed) if one_indexed in self.ple_layer_ids else None

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a config.json dict (flat text fields or a `text_config`), derive, validate."""
        architectures = raw.get("architectures") or ["Qwen4ExpForCausalLM"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architectures: unknown architecture {architecture!r}; tierlm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        text = dict(raw.get("text_config") or raw)
        if architecture == "Qwen4ExpForConditionalGeneration" and "text_config" not in raw:
            raise ConfigError("text_config: Qwen4ExpForConditionalGeneration needs a text_config section")
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
            if key not in text and key in raw:
                text[key] = raw[key]
        vision = None
        if raw.get("vision_config") is not None:
            vision = VisionConfig.from_dict(raw["vision_config"], raw)
        return cls._from_text_fields(text, architecture, vision)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config.json: not found in {model_dir}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config.json: not valid JSON ({exc})") from None
        return cls.from_dict(raw)

    @classmethod
    def _from_text_fields(cls, text: dict[str, Any], architecture: str, vision: VisionConfig | None) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        derived = ("extra", "layer_types", "vision", "mrope_section")
        values: dict[str, Any] = {k: v for k, v in text.items() if k in known and k not in derived}
        values["architecture"] = architecture
        values["vision"] = vision
        values["extra"] = {k: v for k, v in text.items() if k not in known}

        num_layers = int(text.get("num_hidden_layers", cls.num_hidden_layers))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            if interval <= 0:
                raise ConfigError(f"full_attention_interval: must be > 0, got {interval}")
            layer_types = [
                "linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(num_layers)
            ]
        layer_types = [LAYER_TYPE_ALIASES.get(t, t) for t in layer_types]
        values["layer_types"] = tuple(layer_types)

        values["ple_layer_ids"] = tuple(sorted(set(text.get("ple_layer_ids") or [])))
        hidden = int(text.get("hidden_size", cls.hidden_size))
        values["ple_embed_dim"] = hidden if text.get("ple_embed_dim") is None else int(text["ple_embed_dim"])

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        values["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", cls.rope_theta)))
        values["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        )
        values["mrope_section"] = tuple(int(n) for n in rope.get("mrope_section", cls.mrope_section))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")

        eos = text.get("eos_token_id")
        values["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        values.pop("eos_token_id", None)
        mtp_key = "mtp_num_hidden_layers" if "mtp_num_hidden_layers" in text else "num_nextn_predict_layers"
        mtp_layers = text.get(mtp_key)
        if mtp_layers is not None and (isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int)):
            raise ConfigError(f"{mtp_key}: must be an integer, got {mtp_layers!r}")
        values["mtp_num_hidden_layers"] = mtp_layers
        values["torch_dtype"] = str(text.get("dtype") or text.get("torch_dtype") or "float32")
        config = cls(**values)
        config.validate()
        return config

    # ---- validation ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """The reference's `validate_architecture` rules plus the ones it needs but does not check."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types: has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        unsupported = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unsupported:
            raise ConfigError(f"layer_types: unsupported layer types {unsupported}; allowed are {list(LAYER_TYPES)}")
        if self.output_gate_act not in ("sigmoid", "silu"):
            raise ConfigError(
                f"output_gate_type: activation {self.output_gate_act!r} (from output_gate_type or hidden_act) "
                "must be 'sigmoid' or 'silu'"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.hc_count <= 1:
            raise ConfigError(f"hc_count: must be > 1, got {self.hc_count}")
        if self.num_experts <= 0:
            raise ConfigError(f"num_experts: must be > 0, got {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
            raise ConfigError("moe_intermediate_size, shared_expert_intermediate_size: must both be > 0")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads: {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads: {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.mtp_num_hidden_layers is not None and self.mtp_num_hidden_layers < 0:
            raise ConfigError(f"mtp_num_hidden_layers: must be >= 0, got {self.mtp_num_hidden_layers}")
        self._validate_qsa()
        self._validate_ple()
        self._validate_vision()

    def _validate_vision(self) -> None:
        if len(self.mrope_section) != 3:
            raise ConfigError(f"rope_parameters.mrope_section: three counts (T, H, W), got {list(self.mrope_section)}")
        v = self.vision
        if v is None:
            return
        if v.out_hidden_size != self.hidden_size:
            raise ConfigError(
                f"vision_config.out_hidden_size: the merger's output ({v.out_hidden_size}) replaces token "
                f"embeddings, so it must equal hidden_size={self.hidden_size}"
            )
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= getattr(v, key) < self.vocab_size:
                raise ConfigError(f"{key}: {getattr(v, key)} is not a token id of the vocabulary ({self.vocab_size})")

    def _validate_qsa(self) -> None:
        qsa = {name: getattr(self, name) for name in QSA_FIELDS}
        if all(v is None for v in qsa.values()):
            if "indexed_attention" in self.layer_types:
                raise ConfigError(f"{', '.join(QSA_FIELDS)}: indexed_attention layers need all five indexer fields")
            return
        missing = [name for name, value in qsa.items() if value is None]
        if missing:
            raise ConfigError(f"{', '.join(missing)}: QSA config is missing required fields (all five must be set)")
        bad = [name for name, value in qsa.items() if value <= 0]
        if bad:
            raise ConfigError(f"{', '.join(bad)}: QSA config values must be positive, got {qsa}")
        if self.indexer_kv_heads != 1:
            raise ConfigError(f"indexer_kv_heads: Qwen4-Exp QSA requires exactly 1, got {self.indexer_kv_heads}")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ConfigError(
                f"indexer_budget: {self.indexer_budget} must be divisible by "
                f"indexer_compress_ratio={self.indexer_compress_ratio}"
            )
        if self.rotary_dim > self.indexer_head_dim:
            raise ConfigError(
                f"indexer_head_dim: rotary_dim={self.rotary_dim} (head_dim x partial_rotary_factor) must fit the "
                f"QSA index head, indexer_head_dim={self.indexer_head_dim}"
            )

    def _validate_ple(self) -> None:
        if not self.ple_layer_ids:
            return
        heads = self.num_ngram_heads
        if heads <= 0 or self.ple_embed_dim <= 0 or self.ple_embed_dim % heads:
            raise ConfigError(
                f"ple_embed_dim: must be positive and divisible by the number of n-gram heads "
                f"(ngram_size-1)*heads_per_ngram={heads}, got {self.ple_embed_dim}"
            )
        out_of_range = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers]
        if out_of_range:
            raise ConfigError(
                f"ple_layer_ids: one-indexed ids must lie in [1, {self.num_hidden_layers}], got {out_of_range}"
            )
        not_linear = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != "linear_attention"]
        if not_linear:
            raise ConfigError(f"ple_layer_ids: PLE is only supported on linear_attention layers, got {not_linear}")
        if not self.eos_token_ids:
            raise ConfigError("eos_token_id: must be set when PLE layers are enabled (the n-gram hash uses it)")
