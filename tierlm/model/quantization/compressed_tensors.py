"""compressed-tensors `pack-quantized` weights (as llm-compressor writes them), and their config section.

Per quantized module X (conventions of compressed-tensors 0.20 `pack_quantized` and vLLM 0.32's
`CompressedTensorsWNA16`):
- `X.weight_packed` int32 [N, ceil(K * bits / 32)]: each row's K values as one LSB-first bit stream
  (`packing.pack_int32` along K; 6 bits: 32 values in 6 words, values straddling words);
- `X.weight_scale` [N, K / group_size] (strategy `group`) or [N, 1] (strategy `channel`);
- `X.weight_shape` int64 (N, K), checked on load and not kept;
- asymmetric only: `X.weight_zero_point` int32 [ceil(N * bits / 32), K / group_size] packed along N.
Every value is stored unsigned with a bias of 2^(bits-1) (the signed value q plus 2^(bits-1)), zero
points too, so W = (stored - 2^(bits-1)) * scale when symmetric and (stored - stored_zero_point) * scale
when not. Bits 2 to 8 load; tierlm's quantizer writes 4, 6 and 8.

The config section (`quantization_config` with `quant_method: compressed-tensors`): `config_groups`, each
with `targets` (a module name, `re:<regex>` matched from the start of the name, or a module class name:
`Linear`, `Embedding`) and `weights` (num_bits, type int, symmetric, strategy group|channel, group_size),
an optional per-group `format`, the top-level `format` and `ignore` (names or `re:` patterns). A module is
quantized by the first group that targets it unless ignored. Weight-only schemes only (W*A16).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tierlm.model.quantization.base import (
    CheckpointTensor,
    QuantizationError,
    RuntimeTensor,
    WeightFormat,
)
from tierlm.model.quantization.packing import pack_int32, packed_length, unpack_int32

PACK_QUANTIZED = "pack-quantized"
KERNEL_BITS = (4, 6, 8)  # what tierlm/kernels/quant_linear and fused_moe read
CLASS_NAMES = {"linear": "Linear", "embedding": "Embedding"}


@dataclass(frozen=True)
class PackQuantizedFormat(WeightFormat):
    bits: int
    group_size: int | None  # None: one scale per output channel
    symmetric: bool = True

    @property
    def label(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "channel"
        return f"int{self.bits}/{group}" + ("" if self.symmetric else "/asym")

    @property
    def runtime_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale") + (() if self.symmetric else ("weight_zero_point",))

    def groups(self, in_features: int) -> int:
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise QuantizationError(f"group_size {self.group_size} does not divide the {in_features} input columns")
        return in_features // self.group_size

    def checkpoint_tensors(self, out_features, in_features):
        groups = self.groups(in_features)
        tensors = {
            "weight_packed": CheckpointTensor((out_features, packed_length(in_features, self.bits)), "int32"),
            "weight_scale": CheckpointTensor((out_features, groups)),
            "weight_shape": CheckpointTensor((2,), "int64"),
        }
        if not self.symmetric:
            tensors["weight_zero_point"] = CheckpointTensor((packed_length(out_features, self.bits), groups), "int32")
        return tensors

    def runtime_tensors(self, out_features, in_features):
        groups = self.groups(in_features)
        tensors = {
            "weight_packed": RuntimeTensor((out_features, packed_length(in_features, self.bits)), torch.int32, 0),
            "weight_scale": RuntimeTensor((out_features, groups), None, 0),
        }
        if not self.symmetric:
            tensors["weight_zero_point"] = RuntimeTensor((out_features, groups), torch.uint8, 0)
        return tensors

    def convert(self, name, tensor, out_features, in_features, where):
        if name == "weight_shape":
            if tensor.tolist() != [out_features, in_features]:
                raise QuantizationError(f"{where} is {tensor.tolist()}, expected {[out_features, in_features]}")
            return {}
        if name == "weight_zero_point":
            return {name: unpack_int32(tensor, self.bits, out_features, dim=0).to(torch.uint8)}
        return {name: tensor}

    def dequantize(self, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        stored = unpack_int32(tensors["weight_packed"], self.bits, in_features)
        scale = tensors["weight_scale"].float()
        if self.symmetric:
            zero = torch.full_like(scale, float(1 << (self.bits - 1)))
        else:
            zero = tensors["weight_zero_point"].float()
        width = in_features if self.group_size is None else self.group_size
        grouped = stored.float().unflatten(-1, (-1, width))
        return ((grouped - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).flatten(-2)

    # ---- fused kernels (tierlm/kernels): symmetric INT4/6/8 on CUDA ------------------------------------
    def _has_kernel(self, x: torch.Tensor) -> bool:
        return x.is_cuda and self._kernels_read()

    def _kernels_read(self) -> bool:
        """Symmetric INT4 / INT6 / INT8 the Triton kernels read in place (unless TIERLM_QUANT_KERNELS=0)."""
        return self.symmetric and self.bits in KERNEL_BITS and os.environ.get("TIERLM_QUANT_KERNELS", "1") != "0"

    def kernel_linear(self, x, tensors, in_features):
        if not self._has_kernel(x):
            return None
        return self.linear_kernel(x, tensors, in_features)

    def linear_kernel(self, x, tensors, in_features):
        """The Triton GEMV / GEMM over this format's runtime tensors (any device Triton runs on)."""
        from tierlm.kernels.quant_linear.triton import quant_linear

        return quant_linear(x, tensors["weight_packed"], scales=tensors["weight_scale"], bits=self.bits,
                            group_size=self.group_size or in_features)

    def int8_per_channel(self, tensors, in_features):
        if self.bits != 8 or self.group_size is not None or not self.symmetric or in_features % 4:
            return None
        return tensors["weight_packed"], tensors["weight_scale"]

    def kernel_experts(self, x, gate_up, down, weights, experts, shared=None):
        if not self._has_kernel(x) or self.group_size is None:  # per-channel: gate_up and down groups differ
            return None
        return self.experts_kernel(x, gate_up, down, weights, experts, shared)

    def experts_kernel(self, x, gate_up, down, weights, experts, shared=None):
        """The fused Triton MoE over stacked runtime tensors (any device Triton runs on), with `shared`'s
        sum added (`fused_moe` runs it inside its launches or beside them)."""
        from tierlm.kernels.fused_moe.triton import fused_moe

        return fused_moe(x, gate_up["weight_packed"], down["weight_packed"], weights, experts,
                         format=f"int{self.bits}", scales=(gate_up["weight_scale"], down["weight_scale"]),
                         group_size=self.group_size, shared=shared)

    def kernel_weight(self, tensors):
        """Symmetric INT4 / INT6 / INT8 (group or per-channel scales): the fused MoE kernels read it
        (unless TIERLM_QUANT_KERNELS=0)."""
        if not self._kernels_read():
            return None
        return f"int{self.bits}", tensors["weight_packed"], tensors["weight_scale"]

    # ---- writing (the quantizer) ----------------------------------------------------------------------
    def pack(self, signed: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Signed values [N, K] in [-2^(bits-1), 2^(bits-1)) and scales [N, groups] -> the checkpoint
        tensors of one symmetric module."""
        if not self.symmetric:
            raise QuantizationError("tierlm writes symmetric pack-quantized weights only")
        stored = signed.to(torch.int32) + (1 << (self.bits - 1))
        return {
            "weight_packed": pack_int32(stored, self.bits),
            "weight_scale": scale,
            "weight_shape": torch.tensor(list(signed.shape), dtype=torch.int64),
        }

    def scheme_dict(self) -> dict[str, Any]:
        """The `weights` entry of a config group, as compressed-tensors serialises QuantizationArgs."""
        return {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": "group" if self.group_size else "channel",
            "block_structure": None,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
            "observer_kwargs": {},
        }


def matches(name: str, pattern: str) -> bool:
    """A compressed-tensors target or ignore entry: `re:<regex>` (matched from the start) or an exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


@dataclass(frozen=True)
class ConfigGroup:
    name: str
    targets: tuple[str, ...]
    format: PackQuantizedFormat


@dataclass(frozen=True)
class CompressedTensorsConfig:
    groups: tuple[ConfigGroup, ...]
    ignore: tuple[str, ...]

    def resolve(self, names: tuple[str, ...], kind: str) -> PackQuantizedFormat | None:
        """The format of the module known by `names` (its canonical and checkpoint names) of `kind`
        (linear | embedding), or None when it stays unquantized."""
        if any(matches(name, pattern) for name in names for pattern in self.ignore):
            return None
        class_name = CLASS_NAMES[kind]
        for group in self.groups:
            for target in group.targets:
                if any(matches(name, target) for name in names) or (
                    not target.startswith("re:") and target.lower() in class_name.lower()
                ):
                    return group.format
        return None


def _weights_format(group: str, weights: Any, group_format: str | None) -> PackQuantizedFormat:
    where = f"quantization_config.config_groups.{group}"
    if group_format not in (None, PACK_QUANTIZED):
        raise QuantizationError(f"{where}.format: {group_format!r} is not supported; tierlm reads {PACK_QUANTIZED!r}")
    if not isinstance(weights, dict):
        raise QuantizationError(f"{where}.weights: expected an object with num_bits, type, strategy, got {weights!r}")
    bits = weights.get("num_bits")
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise QuantizationError(f"{where}.weights.num_bits: must be an integer in [2, 8], got {bits!r}")
    if weights.get("type", "int") != "int":
        raise QuantizationError(f"{where}.weights.type: {weights.get('type')!r} is not supported (only 'int')")
    if weights.get("dynamic", False):
        raise QuantizationError(f"{where}.weights.dynamic: dynamic weight quantization is not supported")
    if weights.get("actorder") == "group":
        raise QuantizationError(f"{where}.weights.actorder: 'group' (weight_g_idx) is not supported")
    if weights.get("block_structure"):
        raise QuantizationError(f"{where}.weights.block_structure: block quantization is not supported")
    strategy = weights.get("strategy") or ("group" if weights.get("group_size") else "channel")
    group_size = weights.get("group_size")
    if strategy == "group":
        if not isinstance(group_size, int) or group_size <= 0:
            raise QuantizationError(
                f"{where}.weights.group_size: strategy 'group' needs a positive integer, got {group_size!r}"
            )
    elif strategy == "channel":
        group_size = None
    else:
        raise QuantizationError(f"{where}.weights.strategy: {strategy!r} is not supported (use 'group' or 'channel')")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise QuantizationError(f"{where}.weights.symmetric: must be true or false, got {symmetric!r}")
    return PackQuantizedFormat(bits, group_size, symmetric)


def parse_compressed_tensors(raw: dict[str, Any]) -> CompressedTensorsConfig:
    """A `quantization_config` with quant_method compressed-tensors -> its groups; QuantizationError names
    the field when something is missing or unsupported."""
    top_format = raw.get("format")
    groups_raw = raw.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise QuantizationError("quantization_config.config_groups: missing or empty (expected name -> scheme)")
    if raw.get("kv_cache_scheme"):
        raise QuantizationError("quantization_config.kv_cache_scheme: quantized KV caches are not supported")
    groups = []
    for name, scheme in groups_raw.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(scheme, dict):
            raise QuantizationError(f"{where}: expected an object with targets and weights, got {scheme!r}")
        targets = scheme.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise QuantizationError(f"{where}.targets: expected a non-empty list of names or 're:' patterns")
        if scheme.get("input_activations") or scheme.get("output_activations"):
            raise QuantizationError(
                f"{where}: activation quantization is not supported (weight-only W*A16 schemes only)"
            )
        fmt = _weights_format(name, scheme.get("weights"), scheme.get("format") or top_format)
        groups.append(ConfigGroup(name, tuple(targets), fmt))
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise QuantizationError("quantization_config.ignore: expected a list of names or 're:' patterns")
    return CompressedTensorsConfig(tuple(groups), tuple(ignore))
