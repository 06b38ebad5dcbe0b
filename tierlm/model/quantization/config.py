"""A checkpoint's `quantization_config` (config.json) read into one object that says each module's format.

`QuantizationConfig.from_config_json(raw)` dispatches on `quant_method` (compressed-tensors, AutoRound /
INC, GPTQ) and validates the section; `format_of(name, kind)` answers, for one checkpoint module (e.g.
`model.layers.3.mlp.experts.7.up_proj`, `lm_head`), the `WeightFormat` it is stored in (`DENSE` when
unquantized). Names are matched both as tierlm writes them (`model.`) and with the VLM checkpoint's
`model.language_model.` prefix, so a config's patterns work with either. `module_format` resolves a
group of checkpoint modules that tierlm runs as one (a packed projection, a layer's experts), which must
share a format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tierlm.model.quantization.base import DENSE, QuantizationError, WeightFormat
from tierlm.model.quantization.compressed_tensors import CompressedTensorsConfig, parse_compressed_tensors
from tierlm.model.quantization.gptq import AUTO_ROUND_METHODS, GptqConfig, parse_gptq

PREFIX, VLM_PREFIX = "model.", "model.language_model."
SUPPORTED_METHODS = ("compressed-tensors", *AUTO_ROUND_METHODS, "gptq")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str
    rules: CompressedTensorsConfig | GptqConfig

    @classmethod
    def from_config_json(cls, raw: dict[str, Any]) -> QuantizationConfig | None:
        """The `quantization_config` of a config.json dict (top level or in text_config), or None."""
        section = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
        if section is None:
            return None
        if not isinstance(section, dict):
            raise QuantizationError(f"quantization_config: expected an object, got {type(section).__name__}")
        method = section.get("quant_method")
        if method == "compressed-tensors":
            return cls(method, parse_compressed_tensors(section))
        if method in AUTO_ROUND_METHODS or method == "gptq":
            return cls(method, parse_gptq(section, method))
        raise QuantizationError(
            f"quantization_config.quant_method: {method!r} is not supported; "
            f"tierlm reads {', '.join(SUPPORTED_METHODS)}"
        )

    def bind_checkpoint(self, tensor_names: set[str]) -> QuantizationConfig:
        """Settle what the config leaves to the files: whether GPTQ modules carry `g_idx`."""
        if isinstance(self.rules, GptqConfig):
            has_g_idx = any(name.endswith(".g_idx") for name in tensor_names)
            return dataclasses.replace(self, rules=dataclasses.replace(self.rules, has_g_idx=has_g_idx))
        return self

    def format_of(self, name: str, kind: str) -> WeightFormat:
        """name: a checkpoint module in tierlm's naming (`model.` prefix); kind: linear | embedding."""
        names = (name, VLM_PREFIX + name[len(PREFIX):]) if name.startswith(PREFIX) else (name,)
        return self.rules.resolve(names, kind) or DENSE


def module_format(config: QuantizationConfig | None, names: list[str], kind: str, what: str) -> WeightFormat:
    """The one format of checkpoint modules `names` that tierlm holds together (`what` names the group)."""
    if config is None:
        return DENSE
    formats = {name: config.format_of(name, kind) for name in names}
    distinct = set(formats.values())
    if len(distinct) > 1:
        by_format: dict[WeightFormat, str] = {}
        for name, fmt in formats.items():
            by_format.setdefault(fmt, name)
        examples = ", ".join(f"{name} is {fmt.label}" for fmt, name in by_format.items())
        raise QuantizationError(
            f"{what} runs as one module, so its checkpoint modules must share one format, but {examples}"
        )
    return distinct.pop()
