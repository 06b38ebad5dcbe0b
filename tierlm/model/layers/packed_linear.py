"""`Linear` and `PackedLinear`: the model's linear layers, each run by a quant method.

`PackedLinear` stacks several checkpoint projections that read the same input into one weight
(GDN's q|k|v, z, b, a; a hyper-connection's mixer and injection gates; the router and the shared-expert
gate), so they run as one matrix product instead of several: at decode, each small GEMV costs more in
launch and dispatch than in arithmetic. The checkpoint keeps them apart; `checkpoint_modules` tells the
loader which output rows each checkpoint module fills. `Linear` is the one-projection case.

How the weight is held and multiplied (bf16, or packed INT4/6/8 in some checkpoint format) is the
layer's quant method (`tierlm.model.quantization`), set by the loader with `set_format`; the model files
never see the format.
"""

from __future__ import annotations

import torch
from torch import nn

from tierlm.model.quantization.base import DENSE, ModulePart, WeightFormat, linear_method, runtime_view


class PackedLinear(nn.Module):
    kind = "linear"

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, decode_gemv: bool = True) -> None:
        """parts: checkpoint name (relative to the parent module) -> output rows, in packing order.
        decode_gemv: held unquantized, its decode rows run through quant_linear's Triton GEMV on CUDA (in
        the step's chain of dependent launches; `quantization.base`); False keeps them on F.linear."""
        super().__init__()
        self.decode_gemv = decode_gemv
        self.part_names = list(parts)
        self.part_sizes = list(parts.values())
        self.in_features, self.out_features = in_features, sum(self.part_sizes)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.quant_method = None
        self.set_format(DENSE)

    def set_format(self, fmt: WeightFormat) -> None:
        """Hold the weight in `fmt` (replacing the tensors of the previous format; built on meta first)."""
        if self.quant_method is not None:
            for name in self.quant_method.format.runtime_names:
                delattr(self, name)
        self.quant_method = linear_method(fmt)
        self.quant_method.create_weights(self, self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.quant_method.apply(self, x).split(self.part_sizes, dim=-1)

    def dense_weight(self) -> torch.Tensor | None:
        """The weight [N, K] when it is held unquantized and without a bias (a fused kernel that reads it
        in place can run then), else None."""
        return self.weight if self.quant_method.format == DENSE and self.bias is None else None

    def kernel_weight(self) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
        """(format name, weight or packed words, scales or None) when the fused MoE kernels can read this
        layer's weight in place (`WeightFormat.kernel_weight`) and there is no bias, else None."""
        fmt = self.quant_method.format
        return None if self.bias is not None else fmt.kernel_weight(runtime_view(self, fmt))

    def int8_channel_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed words [N, K / 4] int32, scales [N, 1]) when the weight is held as symmetric per-channel
        INT8 (`WeightFormat.int8_per_channel`) and there is no bias, else None."""
        fmt = self.quant_method.format
        return None if self.bias is not None else fmt.int8_per_channel(runtime_view(self, fmt), self.in_features)

    def checkpoint_modules(self, path: str) -> list[ModulePart]:
        """The checkpoint modules this layer holds (siblings of `path`) and their output rows."""
        parent = path.rsplit(".", 1)[0]
        parts, start = [], 0
        for name, size in zip(self.part_names, self.part_sizes):
            parts.append(ModulePart(f"{parent}.{name}", start, start + size, self.in_features))
            start += size
        return parts

    def runtime_tensor(self, part: ModulePart, name: str) -> torch.Tensor:
        return getattr(self, name)


class Linear(PackedLinear):
    """y = x W^T (+ b), the checkpoint module being this layer itself."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, decode_gemv: bool = True) -> None:
        super().__init__(in_features, {"": out_features}, bias, decode_gemv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def checkpoint_modules(self, path: str) -> list[ModulePart]:
        return [ModulePart(path, 0, self.out_features, self.in_features)]

    def output_rows(self, rows: torch.Tensor) -> Linear:
        """A Linear of this layer's output rows `rows` (int64 [R]) alone, held in the same format: each
        runtime tensor gathered along its output dimension (one shared by every row, as GPTQ's g_idx, is
        kept). The MTP draft head's reduced-vocabulary lm_head (`MultiTokenPredictor.restrict_vocab`)."""
        if self.bias is not None:
            raise ValueError("output_rows: a layer with a bias is not supported")
        fmt = self.quant_method.format
        with torch.device("meta"):  # no full-size allocation before the gathered tensors replace it
            part = Linear(self.in_features, rows.numel(), decode_gemv=self.decode_gemv)
        # not set_format: a checkpoint's shape rules (GPTQ packs its zero points along N, so N % 8 == 0)
        # are not the runtime tensors', which hold every row apart
        for name in part.quant_method.format.runtime_names:
            delattr(part, name)
        part.quant_method = linear_method(fmt)
        for name, spec in fmt.runtime_tensors(self.out_features, self.in_features).items():
            tensor = getattr(self, name)
            if spec.out_dim is not None:
                tensor = tensor.index_select(spec.out_dim, rows.to(tensor.device))
            setattr(part, name, nn.Parameter(tensor, requires_grad=False))
        return part
