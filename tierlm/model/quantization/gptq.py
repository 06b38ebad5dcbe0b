"""GPTQ-packed weights (`auto_round:auto_gptq`, AutoGPTQ), and the AutoRound / GPTQ config sections.

Per quantized module X (AutoGPTQ's v1 layout, as AutoRound exports it and vLLM 0.32's INC / GPTQ
methods read it), for a weight W [N, K] with 32 / bits values per int32 word (bits 2, 4 or 8):
- `X.qweight` int32 [K * bits / 32, N]: packed along the INPUT dimension (word i of column n holds
  inputs i * 32/bits .. , value j at bits [j * bits, (j + 1) * bits)), i.e. W transposed;
- `X.scales` [K / group_size, N] (one group per output channel when group_size is -1: [1, N]);
- `X.qzeros` int32 [K / group_size, N * bits / 32]: zero points packed along N, stored minus one
  (the v1 convention: a symmetric 4-bit weight stores 7 for its zero point 8);
- `X.g_idx` int32 [K] (optional): the group of each input column (activation order); without it input
  k is in group k // group_size.
W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]. Symmetric weights use zero = 2^(bits-1) and leave
qzeros unread, as vLLM does.

Config sections: `quant_method` `auto-round` / `intel/auto-round` / `inc` with `packing_format`
`auto_round:auto_gptq` (also the default for int data), `bits`, `group_size`, `sym`, optional
`block_name_to_quantize` (modules outside those blocks stay unquantized) and `extra_config` (per-module
overrides keyed by name, name suffix or regex: `bits` 16+ means unquantized); and plain `gptq` (`bits`,
`group_size`, `sym`, `desc_act`). lm_head stays unquantized unless extra_config names it; embeddings are
never GPTQ-packed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tierlm.model.quantization.base import CheckpointTensor, QuantizationError, RuntimeTensor, WeightFormat
from tierlm.model.quantization.packing import pack_int32, unpack_int32

GPTQ_BITS = (2, 4, 8)
AUTO_ROUND_METHODS = ("auto-round", "intel/auto-round", "inc")
GPTQ_PACKING = "auto_round:auto_gptq"
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")


@dataclass(frozen=True)
class GptqFormat(WeightFormat):
    bits: int
    group_size: int  # -1: one group over all inputs
    symmetric: bool = True
    has_g_idx: bool = False

    @property
    def label(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"int{self.bits}/{group}/gptq" + ("" if self.symmetric else "/asym")

    @property
    def runtime_names(self) -> tuple[str, ...]:
        names = ("qweight", "scales")
        names += () if self.symmetric else ("zeros",)
        return names + (("g_idx",) if self.has_g_idx else ())

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int) -> int:
        if self.group_size == -1:
            return 1
        if in_features % self.group_size:
            raise QuantizationError(f"group_size {self.group_size} does not divide the {in_features} input columns")
        return in_features // self.group_size

    def _check_divisible(self, out_features: int, in_features: int) -> None:
        if in_features % self.pack_factor or out_features % self.pack_factor:
            raise QuantizationError(
                f"a {out_features} x {in_features} weight cannot be GPTQ-packed at {self.bits} bits "
                f"(both dimensions must be multiples of {self.pack_factor})"
            )

    def checkpoint_tensors(self, out_features, in_features):
        self._check_divisible(out_features, in_features)
        groups, pf = self.groups(in_features), self.pack_factor
        tensors = {
            "qweight": CheckpointTensor((in_features // pf, out_features), "int32"),
            "scales": CheckpointTensor((groups, out_features)),
            "qzeros": CheckpointTensor((groups, out_features // pf), "int32"),
        }
        if self.has_g_idx:
            tensors["g_idx"] = CheckpointTensor((in_features,), "int32")
        return tensors

    def runtime_tensors(self, out_features, in_features):
        self._check_divisible(out_features, in_features)
        groups = self.groups(in_features)
        tensors = {
            "qweight": RuntimeTensor((in_features // self.pack_factor, out_features), torch.int32, 1),
            "scales": RuntimeTensor((groups, out_features), None, 1),
        }
        if not self.symmetric:
            tensors["zeros"] = RuntimeTensor((groups, out_features), torch.uint8, 1)
        if self.has_g_idx:
            tensors["g_idx"] = RuntimeTensor((in_features,), torch.int32, None)
        return tensors

    def convert(self, name, tensor, out_features, in_features, where):
        if name == "qzeros":
            if self.symmetric:
                return {}
            return {"zeros": (unpack_int32(tensor, self.bits, out_features, dim=1) + 1).to(torch.uint8)}
        if name == "g_idx":
            groups = self.groups(in_features)
            if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= groups):
                raise QuantizationError(f"{where}: group indices must lie in [0, {groups})")
            return {name: tensor.to(torch.int32)}
        return {name: tensor}

    def group_index(self, tensors: Mapping[str, torch.Tensor], in_features: int, device) -> torch.Tensor:
        if self.has_g_idx:
            return tensors["g_idx"].long()
        if self.group_size == -1:
            return torch.zeros(in_features, dtype=torch.long, device=device)
        return torch.arange(in_features, device=device) // self.group_size

    def dequantize(self, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        q = unpack_int32(tensors["qweight"], self.bits, in_features, dim=-2).float()  # [..., K, N]
        groups = self.group_index(tensors, in_features, q.device)  # [..., K]
        scale = _take_groups(tensors["scales"].float(), groups)
        if self.symmetric:
            zero = float(1 << (self.bits - 1))
        else:
            zero = _take_groups(tensors["zeros"].float(), groups)
        return ((q - zero) * scale).transpose(-1, -2)

    # ---- writing (tests build hand-made checkpoints with this) -------------------------------------------
    def pack(self, stored: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             g_idx: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Unsigned values W_q [N, K], scales [groups, N], zero points [groups, N] (None: symmetric) ->
        the checkpoint tensors in AutoGPTQ's v1 layout."""
        if zeros is None:
            zeros = torch.full_like(scales, 1 << (self.bits - 1), dtype=torch.int32)
        tensors = {
            "qweight": pack_int32(stored.t().contiguous().to(torch.int32), self.bits, dim=0),
            "scales": scales,
            "qzeros": pack_int32(zeros.to(torch.int32) - 1, self.bits, dim=1),
        }
        if g_idx is not None:
            tensors["g_idx"] = g_idx.to(torch.int32)
        return tensors


def _take_groups(per_group: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """per_group [..., G, N] and each input's group [..., K] -> [..., K, N]."""
    if groups.dim() == 1:
        return per_group.index_select(-2, groups)
    return torch.gather(per_group, -2, groups.unsqueeze(-1).expand(*groups.shape, per_group.shape[-1]))


@dataclass(frozen=True)
class GptqConfig:
    """The per-module resolution of an AutoRound or GPTQ config section."""

    bits: int
    group_size: int
    symmetric: bool
    blocks: tuple[str, ...]  # block_name_to_quantize (empty: every block)
    extra: dict[str, dict[str, Any]]
    has_g_idx: bool = False

    def _format(self, bits: int, group_size: int, symmetric: bool, where: str) -> GptqFormat | None:
        if bits >= 16:
            return None
        if bits not in GPTQ_BITS:
            raise QuantizationError(
                f"{where}: {bits}-bit GPTQ packing is not supported "
                f"(auto_gptq packs {', '.join(map(str, GPTQ_BITS))} bits)"
            )
        return GptqFormat(bits, group_size, symmetric, self.has_g_idx)

    def _override(self, name: str) -> dict[str, Any] | None:
        if name in self.extra:
            return self.extra[name]
        for key, value in self.extra.items():
            if name.endswith(f".{key}"):
                return value
        for key, value in self.extra.items():
            if any(c in _REGEX_CHARS for c in key):
                try:
                    if re.search(key, name):
                        return value
                except re.error:
                    continue
        return None

    def resolve(self, names: tuple[str, ...], kind: str) -> GptqFormat | None:
        for name in names:
            override = self._override(name)
            if override is not None:
                if kind == "embedding" and override.get("bits", self.bits) < 16:
                    raise QuantizationError(f"quantization_config.extra_config: {name} is an embedding; "
                                            "GPTQ packing cannot hold one")
                return self._format(
                    int(override.get("bits", self.bits)), int(override.get("group_size", self.group_size)),
                    bool(override.get("sym", self.symmetric)), f"quantization_config.extra_config[{name!r}]",
                )
        if kind == "embedding" or any(name == "lm_head" or name.endswith(".lm_head") for name in names):
            return None
        if self.blocks and not any(name.startswith(block) for name in names for block in self.blocks):
            return None
        return self._format(self.bits, self.group_size, self.symmetric, "quantization_config.bits")


def parse_gptq(raw: dict[str, Any], method: str) -> GptqConfig:
    """An AutoRound (`auto-round`, `inc`) or `gptq` quantization_config -> its resolution rules."""
    if method in AUTO_ROUND_METHODS:
        packing = raw.get("packing_format") or GPTQ_PACKING
        if packing != GPTQ_PACKING:
            raise QuantizationError(
                f"quantization_config.packing_format: {packing!r} is not supported; tierlm reads {GPTQ_PACKING!r} "
                "(and compressed-tensors checkpoints)"
            )
        if raw.get("data_type", "int") != "int":
            raise QuantizationError(
                f"quantization_config.data_type: {raw.get('data_type')!r} is not supported (only 'int')"
            )
    bits = raw.get("bits")
    if not isinstance(bits, int):
        raise QuantizationError(f"quantization_config.bits: expected an integer, got {bits!r}")
    group_size = raw.get("group_size", 128)
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise QuantizationError(
            f"quantization_config.group_size: expected a positive integer or -1, got {group_size!r}"
        )
    symmetric = raw.get("sym", True)
    blocks = raw.get("block_name_to_quantize") or raw.get("to_quant_block_names") or []
    if isinstance(blocks, str):
        blocks = blocks.split(",")
    extra = raw.get("extra_config") or {}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise QuantizationError("quantization_config.extra_config: expected module name -> {bits, group_size, sym}")
    return GptqConfig(bits, group_size, bool(symmetric), tuple(blocks), extra)
