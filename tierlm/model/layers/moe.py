"""Sparse MoE block: softmax router (fp32), top-k, optional renormalisation, SwiGLU experts, and a
shared expert behind a sigmoid gate.

The router (its E rows and the shared gate's row in one weight) runs as fused kernels on CUDA for
decode batches (`kernels/moe_router`: a split-K GEMV, then softmax, top-k, renormalisation and the gate's
sigmoid per token; TIERLM_NO_FUSED_ROUTER=1 turns them off), else as F.linear and `route` in torch.

Experts are held stacked by a fused-experts method (dense `gate_up_proj` [E, 2I, H] = gate rows then up
rows, `down_proj` [E, H, I], or packed low-bit stacks; see `quantization.experts`), which also runs them;
the loader fills them from the per-expert checkpoint tensors.

The shared expert (a SwiGLU whose output the shared gate's sigmoid scales) runs on CUDA inside the routed
experts' fused decode kernels as one more expert of every token, its gate its routing weight, whatever
its own format (`kernels/fused_moe`, `SharedExpert`; TIERLM_NO_FUSED_SHARED_EXPERT=1 turns that off);
elsewhere, at prefill sizes, or where its format or the experts' has no kernel, it runs apart and its
gated output is added to theirs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.kernels.fused_moe.naive import SharedExpert
from tierlm.kernels.moe_router.naive import route
from tierlm.model.layers.packed_linear import Linear, PackedLinear
from tierlm.model.quantization.base import DENSE, ModulePart, WeightFormat
from tierlm.model.quantization.experts import PROJECTIONS, FusedExpertsMethod


def fuse_shared_expert(x: torch.Tensor) -> bool:
    """Whether the shared expert may run inside the routed experts' fused kernel: on CUDA, unless
    TIERLM_NO_FUSED_SHARED_EXPERT=1 (where the kernel does not take it, it runs apart all the same)."""
    return x.is_cuda and not os.environ.get("TIERLM_NO_FUSED_SHARED_EXPERT")


def _decode_sized(experts: torch.Tensor) -> bool:
    """Whether the fused kernel's decode form (the only one that takes the shared expert) runs these ids:
    checked before the shared expert's kernel view is built, which a prefill-sized call would not use."""
    from tierlm.kernels.fused_moe.triton import fuses_shared_expert

    return fuses_shared_expert(experts)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = PackedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)

    def as_fused_expert(self, gate: torch.Tensor) -> SharedExpert | None:
        """This SwiGLU as the fused MoE kernels take a shared expert (its weights read in place; `gate`
        [N, 1] its routing weight), or None when its projections are in a format they do not read, or in
        two different ones."""
        gate_up, down = self.gate_up.kernel_weight(), self.down_proj.kernel_weight()
        if gate_up is None or down is None or gate_up[0] != down[0]:
            return None
        scales = None if gate_up[2] is None else (gate_up[2], down[2])
        return SharedExpert(gate, gate_up[1], down[1], gate_up[0], scales)


class Experts(nn.Module):
    """The stacked routed experts of one layer; held and run by a fused-experts method
    (`quantization.experts`): dense `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
    [E, H, I], or the same stacks packed."""

    kind = "experts"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.quant_method = None
        self.set_format(DENSE)

    def set_format(self, fmt: WeightFormat) -> None:
        if self.quant_method is not None:
            for projection in PROJECTIONS:
                for name in self.quant_method.format.runtime_names:
                    delattr(self, self.quant_method.tensor_name(projection, name))
        self.quant_method = FusedExpertsMethod(fmt)
        self.quant_method.create_weights(self, self.num_experts, self.hidden_size, self.intermediate_size)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, static: bool = False
    ) -> torch.Tensor:
        """static: take the sync-free expert form (see `FusedExpertsMethod`)."""
        return self.quant_method.apply(self, x, weights, experts, static)

    def with_shared(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: SharedExpert
                    ) -> torch.Tensor | None:
        """The routed sum plus `shared`'s (the MoE block's shared expert) in the fused kernel's launches,
        or None where the kernel does not take it (see `FusedExpertsMethod.apply_with_shared`)."""
        return self.quant_method.apply_with_shared(self, x, weights, experts, shared)

    def checkpoint_modules(self, path: str) -> list[ModulePart]:
        """Per expert e: `{path}.{e}.gate_proj` / `up_proj` fill gate_up's rows, `down_proj` fills down."""
        h, i = self.hidden_size, self.intermediate_size
        parts = []
        for e in range(self.num_experts):
            parts += [
                ModulePart(f"{path}.{e}.gate_proj", 0, i, h, e, "gate_up"),
                ModulePart(f"{path}.{e}.up_proj", i, 2 * i, h, e, "gate_up"),
                ModulePart(f"{path}.{e}.down_proj", 0, h, i, e, "down"),
            ]
        return parts

    def runtime_tensor(self, part: ModulePart, name: str) -> torch.Tensor:
        return getattr(self, self.quant_method.tensor_name(part.projection, name))[part.expert]


class SparseMoeBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        # the router's E rows and the shared expert's gate row read the same input: one product
        self.router = PackedLinear(h, {"gate": config.num_experts, "shared_expert_gate": 1})
        self.experts = Experts(config.num_experts, h, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(h, config.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor, static: bool = False) -> torch.Tensor:
        """static: take the sync-free expert form (see `Experts`)."""
        weights, experts, shared_gate = self.route(x)
        if fuse_shared_expert(x) and _decode_sized(experts):
            shared = self.shared_expert.as_fused_expert(shared_gate)
            out = None if shared is None else self.experts.with_shared(x, weights, experts, shared)
            if out is not None:
                return out
        routed = self.experts(x, weights, experts, static)
        return routed + shared_gate * self.shared_expert(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (routing weights [N, k], expert ids [N, k], the shared expert's gate [N, 1] after its
        sigmoid): the fused kernel where it runs (see the module docstring), else the torch reference."""
        weight = self.router.dense_weight()
        if x.is_cuda and weight is not None and not os.environ.get("TIERLM_NO_FUSED_ROUTER"):
            from tierlm.kernels.moe_router.triton import MAX_TOKENS, route_and_gate

            if x.shape[0] <= MAX_TOKENS:
                return route_and_gate(x, weight, self.top_k, self.renormalize)
        router_logits, shared_gate = self.router(x)
        weights, experts = route(router_logits, self.top_k, self.renormalize)
        return weights, experts, torch.sigmoid(shared_gate)
