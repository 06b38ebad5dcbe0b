"""Quantization's two abstractions: a weight format, and the quant methods layers are built with.

A `WeightFormat` says how one weight W [N, K] (N output rows, K inputs) is stored: the tensors a
checkpoint holds for it (`checkpoint_tensors`, names relative to the module, e.g. `weight_packed`), the
tensors held in memory (`runtime_tensors`: still packed; each names the dimension its output rows run
along, so projections packed into one module, or experts stacked into one tensor, fill their own rows),
how a checkpoint tensor becomes runtime tensors (`convert`: e.g. zero points unpacked, `weight_shape`
checked and dropped) and the plain torch `dequantize` of runtime tensors back to W.

Layers (`Linear`, `PackedLinear`, `Embedding`, `Experts`) hold a quant method, as vLLM's layers do:
`create_weights(layer, ...)` registers the runtime tensors of its format on the layer and `apply(layer, x)`
runs the op. The model files never branch on the format; the loader picks each layer's method from the
checkpoint's `quantization_config` (see `quantization.config`).

The quantized `apply` runs the format's fused kernel where there is one (`kernel_linear`,
`kernel_experts`: symmetric `pack-quantized` INT4/6/8 on CUDA through `tierlm/kernels/quant_linear` and
`tierlm/kernels/fused_moe`, which read the same runtime tensors, [N, ceil(K * bits / 32)] int32 words and
[N, K / group] scales, [E, ...] for stacked experts; TIERLM_QUANT_KERNELS=0 turns them off). Elsewhere
it is the torch reference: it dequantizes one layer's weight (one expert's, in the MoE) on the fly,
inside the op, and drops it after; nothing keeps a dequantized copy. Unquantized experts on CUDA run the
same fused MoE kernel (TIERLM_NO_FUSED_MOE=1: the torch path). Unquantized linear layers are F.linear,
except on CUDA at a decode step of one or two rows (DENSE_GEMV_MAX_ROWS), where a layer that takes it
(`decode_gemv`: all but the vocab-wide output heads) runs quant_linear's Triton GEMV over its weight:
there the step's projections chain to their neighbours with programmatic dependent launch (cuBLAS
would break the chain and, for the long-K ones, add a split-K reduce kernel);
TIERLM_NO_TRITON_DENSE_GEMV=1 turns it off.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class QuantizationError(ValueError):
    """A quantization_config or quantized tensor that tierlm cannot use; the message names it."""


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor a checkpoint stores for one module: shape and dtype tag (None: the model's float dtype)."""

    shape: tuple[int, ...]
    dtype: str | None = None  # "int32" | "int64" | None


@dataclass(frozen=True)
class RuntimeTensor:
    """A tensor held in memory for one weight [N, K]."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: the model's float dtype
    out_dim: int | None  # where the N output rows run (parts are concatenated there); None: shared by parts


@dataclass(frozen=True)
class ModulePart:
    """One checkpoint module a layer holds: its name, the output rows [start, end) it fills in the
    layer's weight, its input width, and for stacked experts the expert and projection (gate_up | down)."""

    name: str
    start: int
    end: int
    in_features: int
    expert: int | None = None
    projection: str | None = None

    @property
    def out_features(self) -> int:
        return self.end - self.start


class WeightFormat(ABC):
    """How one weight [N, K] is stored on disk and in memory (see the module docstring). Concrete
    formats also say their `bits` per value."""

    @property
    @abstractmethod
    def label(self) -> str:
        """Short name for plans and logs, e.g. `int4/g32`."""

    @property
    @abstractmethod
    def runtime_names(self) -> tuple[str, ...]:
        """The names `runtime_tensors` returns (whatever the shape)."""

    @abstractmethod
    def checkpoint_tensors(self, out_features: int, in_features: int) -> dict[str, CheckpointTensor]: ...

    @abstractmethod
    def runtime_tensors(self, out_features: int, in_features: int) -> dict[str, RuntimeTensor]: ...

    @abstractmethod
    def convert(
        self, name: str, tensor: torch.Tensor, out_features: int, in_features: int, where: str
    ) -> dict[str, torch.Tensor]:
        """Checkpoint tensor `name` of one weight -> runtime tensors; `where` (the full tensor name) is
        for error messages."""

    @abstractmethod
    def dequantize(self, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        """Runtime tensors (with any leading batch dims, e.g. experts) -> W [..., N, K] in fp32."""

    def kernel_linear(self, x: torch.Tensor, tensors: Mapping[str, torch.Tensor], in_features: int):
        """y = x W^T through a fused low-bit kernel, or None where this format or device has none (the
        torch reference runs then). This default has none."""

    def kernel_experts(self, x, gate_up: Mapping[str, torch.Tensor], down: Mapping[str, torch.Tensor],
                       weights: torch.Tensor, experts: torch.Tensor, shared=None):
        """The routed experts' sum through the fused MoE kernel over stacked runtime tensors, or None.
        shared (a `kernels.fused_moe.SharedExpert`): the sum with the shared expert's added (`fused_moe`
        decides whether it runs inside the routed launches or beside them). This default has none."""

    def kernel_weight(self, tensors: Mapping[str, torch.Tensor]):
        """(the fused MoE kernels' format name, the weight or its packed words, the scales or None) when
        those kernels can read this format in place (a shared expert fused into them), else None. This
        default: None."""

    def int8_per_channel(self, tensors: Mapping[str, torch.Tensor], in_features: int):
        """(packed words [N, K / 4] int32, scales [N, 1]) when this format holds W as symmetric INT8 with
        one scale per output row, packed as compressed-tensors `pack-quantized` (kernels that read that form
        in place take them: the hyper-connection mix), else None. This default: None."""

    def rows_dim_is_leading(self, out_features: int, in_features: int) -> bool:
        """Whether every runtime tensor has its output rows first (a row gather then works: embeddings)."""
        return all(t.out_dim == 0 for t in self.runtime_tensors(out_features, in_features).values())


# the rows up to which a dense projection takes the Triton GEMV on CUDA. H200, real widths, bf16, session 9
# (bench/decode_roofline.py --ab TIERLM_NO_TRITON_DENSE_GEMV, PDL on): one row 1.11x the step's tok/s with
# it (cuBLAS's kernels break the PDL chain), four rows 0.91x (quant_linear_kernel.py --sweep-dense: the
# GEMV at 4 rows reads 0.58x as fast as cuBLAS at best; at 1 row 0.94x alone). Two rows since session 23
# (H100): alone the GEMV's best is 0.97x cuBLAS at the real widths (bench/results/
# quant_linear_kernel_dense_sweep_nvidia-h100_s23.txt), in the chain the real-width stack at batch 2 1.003x
# (bench/results/tiles_ab_b2_nvidia-h100_s23.txt: 64 kernels a step against 68), its MTP K=1 step (a 2-row
# verify) 1.00x; demo-small's MTP K=1 step, launch-bound (23 cuBLAS launches a step left the chain), 1.065x
# with its own drafts and 1.06x with oracle drafts (`bench/spec_decode.py --size small --variants base
# DENSE_GEMV_MAX_ROWS=1`, medians of 3 interleaved rounds; an earlier run 1.07x / 1.01x; bench/results/
# spec_decode_dense_rows_nvidia-h100_s23.txt)
DENSE_GEMV_MAX_ROWS = 2


class DenseFormat(WeightFormat):
    """An unquantized weight: `weight` [N, K] in the model's dtype, on disk and in memory."""

    @property
    def label(self) -> str:
        return "dense"

    bits = 16
    runtime_names = ("weight",)

    def checkpoint_tensors(self, out_features, in_features):
        return {"weight": CheckpointTensor((out_features, in_features))}

    def runtime_tensors(self, out_features, in_features):
        return {"weight": RuntimeTensor((out_features, in_features), None, 0)}

    def convert(self, name, tensor, out_features, in_features, where):
        return {"weight": tensor}

    def dequantize(self, tensors, in_features):
        return tensors["weight"].float()

    def kernel_linear(self, x, tensors, in_features):
        """On CUDA one decode row's Triton GEMV (`linear_kernel`; DENSE_GEMV_MAX_ROWS), unless TIERLM_NO_TRITON_DENSE_GEMV=1;
        elsewhere None (F.linear). Also None where autograd records the product (training: the kernel
        has no backward)."""
        if not x.is_cuda or os.environ.get("TIERLM_NO_TRITON_DENSE_GEMV", "0") not in ("", "0"):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or tensors["weight"].requires_grad):
            return None
        if math.prod(x.shape[:-1]) > DENSE_GEMV_MAX_ROWS:
            return None
        return self.linear_kernel(x, tensors, in_features)

    def linear_kernel(self, x, tensors, in_features):
        """Up to GEMV_MAX_ROWS rows (decode), y = x W^T by quant_linear's Triton GEMV over the weight in
        place (any device Triton runs on); more rows: None (F.linear: cuBLAS's GEMM serves prefill)."""
        from tierlm.kernels.quant_linear.triton import GEMV_MAX_ROWS, quant_linear

        if math.prod(x.shape[:-1]) > GEMV_MAX_ROWS:
            return None
        return quant_linear(x, tensors["weight"])

    def kernel_experts(self, x, gate_up, down, weights, experts, shared=None):
        """On CUDA the fused MoE kernel (`tierlm/kernels/fused_moe`) over the stacked experts, read in
        place (TIERLM_NO_FUSED_MOE=1: the torch path instead); elsewhere None (the torch path)."""
        if not x.is_cuda or os.environ.get("TIERLM_NO_FUSED_MOE", "0") not in ("", "0"):
            return None
        return self.experts_kernel(x, gate_up, down, weights, experts, shared)

    def experts_kernel(self, x, gate_up, down, weights, experts, shared=None):
        """The fused Triton MoE over the stacked unquantized experts (any device Triton runs on), with
        `shared`'s sum added (`fused_moe` runs it inside its launches or beside them)."""
        from tierlm.kernels.fused_moe.triton import fused_moe

        return fused_moe(x, gate_up["weight"], down["weight"], weights, experts, shared=shared)

    def kernel_weight(self, tensors):
        return "unquantized", tensors["weight"], None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DenseFormat)

    def __hash__(self) -> int:
        return hash("dense")


DENSE = DenseFormat()


def register_runtime_tensors(
    layer: nn.Module, specs: dict[str, RuntimeTensor], leading: tuple[int, ...] = ()
) -> None:
    """Register the runtime tensors as frozen parameters (int ones included: the loader fills parameters).
    Floating-point ones first: the engine takes the model's dtype from its first parameter."""
    for name, spec in sorted(specs.items(), key=lambda item: item[1].dtype is not None):
        data = torch.empty(*leading, *spec.shape, dtype=spec.dtype or torch.get_default_dtype())
        layer.register_parameter(name, nn.Parameter(data, requires_grad=False))


def runtime_view(layer: nn.Module, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, name) for name in fmt.runtime_names}


# ---- linear -------------------------------------------------------------------------------------------


class LinearMethod(ABC):
    """How a linear layer holds its weight and computes y = x W^T (+ bias)."""

    def __init__(self, fmt: WeightFormat) -> None:
        self.format = fmt

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        register_runtime_tensors(layer, self.format.runtime_tensors(out_features, in_features))

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return self.format.dequantize(runtime_view(layer, self.format), layer.in_features).to(dtype)


class UnquantizedLinearMethod(LinearMethod):
    """F.linear; on CUDA, a `decode_gemv` layer's decode rows through the Triton GEMV
    (`DenseFormat.kernel_linear`)."""

    def __init__(self) -> None:
        super().__init__(DENSE)

    def apply(self, layer, x):
        y = self.format.kernel_linear(x, runtime_view(layer, DENSE), layer.in_features) if layer.decode_gemv else None
        if y is None:
            return F.linear(x, layer.weight, layer.bias)
        return y if layer.bias is None else y + layer.bias


class QuantizedLinearMethod(LinearMethod):
    """The format's fused kernel where it has one (pack-quantized on CUDA); else the torch reference,
    which dequantizes this layer's weight inside the op."""

    def apply(self, layer, x):
        y = self.format.kernel_linear(x, runtime_view(layer, self.format), layer.in_features)
        if y is None:
            return F.linear(x, self.dequantized_weight(layer, x.dtype), layer.bias)
        return y if layer.bias is None else y + layer.bias


def linear_method(fmt: WeightFormat) -> LinearMethod:
    return UnquantizedLinearMethod() if fmt == DENSE else QuantizedLinearMethod(fmt)


# ---- embedding ----------------------------------------------------------------------------------------


class EmbeddingMethod:
    """Rows of the table [V, H] for token ids; a quantized table dequantizes only the gathered rows."""

    def __init__(self, fmt: WeightFormat, vocab_size: int, hidden_size: int) -> None:
        if not fmt.rows_dim_is_leading(vocab_size, hidden_size):
            raise QuantizationError(f"an embedding cannot be stored as {fmt.label}: its rows are not leading")
        self.format = fmt

    def create_weights(self, layer: nn.Module, vocab_size: int, hidden_size: int) -> None:
        register_runtime_tensors(layer, self.format.runtime_tensors(vocab_size, hidden_size))

    def apply(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if self.format == DENSE:
            return F.embedding(ids, layer.weight)
        tensors = runtime_view(layer, self.format)
        dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
        rows = {name: t.index_select(0, ids.reshape(-1)) for name, t in tensors.items()}
        out = self.format.dequantize(rows, layer.embedding_dim).to(dtype)
        return out.view(*ids.shape, layer.embedding_dim)
