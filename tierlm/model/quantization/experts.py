"""The fused-experts method the MoE layer is built with: how the stacked experts are held and run.

The experts of one MoE layer are held stacked: `gate_up` (each expert's gate rows, then its up rows:
[E, 2I, H] as a weight) and `down` ([E, H, I]), in one `WeightFormat`. Unquantized, the tensors are
`gate_up_proj` / `down_proj` in the model's dtype; quantized, `gate_up_<runtime name>` /
`down_<runtime name>` (e.g. `gate_up_weight_packed` int32 [E, 2I, ceil(H * bits / 32)]).

`apply` is the torch reference: top-k SwiGLU experts, summed with the routing weights, in three forms
that give the same result (grouped by expert for prefill, a per-pair loop for a small eager decode, and
one gathered batched product for a static (captured or compiled) step, which has no host sync). A
quantized expert is dequantized when the loop reaches it (the gathered form dequantizes the gathered
experts' weights), never the whole stack. Where the format has a fused kernel (`kernel_experts`:
unquantized, or `pack-quantized` with group scales, on CUDA: `tierlm/kernels/fused_moe`) that runs
instead, reading the same stacked tensors in place; `apply_with_shared` runs the MoE block's shared
expert in the same launches (decode sizes), as one more expert of every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.model.quantization.base import DENSE, WeightFormat, register_runtime_tensors

PROJECTIONS = ("gate_up", "down")


class FusedExpertsMethod:
    # Up to this many (token, expert) pairs (a decode step), eager mode loops over the pairs on weight
    # views (no copy), which measured 3x faster than gathering on CPU.
    SMALL_BATCH_PAIRS = 16

    def __init__(self, fmt: WeightFormat) -> None:
        self.format = fmt

    def tensor_name(self, projection: str, runtime_name: str) -> str:
        if self.format == DENSE:
            return f"{projection}_proj"
        return f"{projection}_{runtime_name}"

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        shapes = {"gate_up": (2 * intermediate_size, hidden_size), "down": (hidden_size, intermediate_size)}
        for projection, (n, k) in shapes.items():
            specs = self.format.runtime_tensors(n, k)
            renamed = {self.tensor_name(projection, name): spec for name, spec in specs.items()}
            register_runtime_tensors(layer, renamed, (num_experts,))

    def _stack(self, layer: nn.Module, projection: str) -> dict[str, torch.Tensor]:
        return {name: getattr(layer, self.tensor_name(projection, name)) for name in self.format.runtime_names}

    def expert_weight(self, layer: nn.Module, projection: str, index, dtype: torch.dtype) -> torch.Tensor:
        """The weight of expert(s) `index` (an int, or ids [M] for a stack [M, N, K]) in `dtype`."""
        if self.format == DENSE:
            return getattr(layer, f"{projection}_proj")[index]
        tensors = {
            name: getattr(layer, self.tensor_name(projection, name))[index] for name in self.format.runtime_names
        }
        in_features = layer.hidden_size if projection == "gate_up" else layer.intermediate_size
        return self.format.dequantize(tensors, in_features).to(dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, static: bool = False
    ) -> torch.Tensor:
        """x [N, H], routing weights and expert ids [N, k] -> sum_k w_k * expert_k(x) [N, H].
        static: the sync-free gathered form (captured or compiled decode steps); the fused kernel, where the
        format has one, is sync-free in both cases."""
        gate_up, down = self._stack(layer, "gate_up"), self._stack(layer, "down")
        y = self.format.kernel_experts(x, gate_up, down, weights, experts)
        if y is not None:
            return y
        if static:
            return self._gathered(layer, x, weights, experts)
        if experts.numel() <= self.SMALL_BATCH_PAIRS:
            return self._per_pair(layer, x, weights, experts)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token_idx, slot_idx = torch.where(experts == expert)
            gate, up = F.linear(x[token_idx], self.expert_weight(layer, "gate_up", expert, x.dtype)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.expert_weight(layer, "down", expert, x.dtype))
            # a token routes to an expert at most once, so the indices are unique (index_add_ is slow on CPU)
            out[token_idx] += (y * weights[token_idx, slot_idx, None]).to(out.dtype)
        return out

    def apply_with_shared(self, layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                          shared) -> torch.Tensor | None:
        """The routed sum plus the shared expert's (`kernels.fused_moe.SharedExpert`: its weights and
        gate) through the fused kernel (which runs it in its launches or beside them), or None where this
        format or device has no kernel: then the caller runs the two apart."""
        gate_up, down = self._stack(layer, "gate_up"), self._stack(layer, "down")
        return self.format.kernel_experts(x, gate_up, down, weights, experts, shared)

    def _per_pair(self, layer, x, weights, experts) -> torch.Tensor:
        rows = []
        for token, (ids, token_weights) in enumerate(zip(experts.tolist(), weights)):
            acc = torch.zeros_like(x[token])
            for slot in sorted(range(len(ids)), key=ids.__getitem__):  # ascending expert id, as the reference
                gate_up = self.expert_weight(layer, "gate_up", ids[slot], x.dtype)
                gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
                down = self.expert_weight(layer, "down", ids[slot], x.dtype)
                acc = acc + F.linear(F.silu(gate) * up, down) * token_weights[slot]
            rows.append(acc)
        return torch.stack(rows)

    def _gathered(self, layer, x, weights, experts) -> torch.Tensor:
        n, k = experts.shape
        flat = experts.flatten()
        inputs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [n*k, H, 1]
        gate_up = self.expert_weight(layer, "gate_up", flat, x.dtype)
        gate, up = torch.bmm(gate_up, inputs).squeeze(-1).chunk(2, dim=-1)
        down = self.expert_weight(layer, "down", flat, x.dtype)
        y = torch.bmm(down, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [n*k, H]
        return (y.view(n, k, -1) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
