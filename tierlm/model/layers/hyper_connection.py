"""Hyper-connections: the model carries `hc` residual streams of width H, stream-major in [N, hc*H].

`mix` reads all streams into one block input (grouped RMSNorm, low-rank sigmoid mixer, mean over
streams) and, for a block, per-stream injection gates; `combine` adds the block output to every stream
with its gate. The final mixer (no injection) feeds lm_head and stands in for the final norm.

On CUDA both run as fused kernels (`kernels/hyper_connection`: mix in two launches for decode batches,
reading the mixer weights in place whether bf16 or INT8 per channel, combine in one for any batch, or
inside the next mix's launches, `combine_and_mix`, as a decoder layer's attention residual is;
TIERLM_NO_FUSED_HC=1 turns them off); elsewhere, and for mixer weights in other formats or prefill
batches, mix runs in torch through the layers' quant methods, the same math as
`kernels/hyper_connection/naive.py`.

A decoder layer's MoE residual crosses the layer boundary the same way: the layer returns its streams
with the combine still owed (`PendingStreams`), and the next layer's first mix (`mix_pending`), or the
final mixer, does it in its launches; whoever needs the streams themselves (a PLE layer, a pipeline
stage's end, the MTP draft head's input) combines first. The torch path runs the same ops in the same
order either way. TIERLM_NO_FOLD_LAYER_COMBINE=1 combines at the layer's end instead (`fold_layer_combine`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.kernels.hyper_connection import naive
from tierlm.model.layers.norm import RMSNorm
from tierlm.model.layers.packed_linear import Linear, PackedLinear


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float, with_inject: bool) -> None:
        super().__init__()
        width = hc_count * hidden_size
        self.hc_count, self.hidden_size = hc_count, hidden_size
        self.hc_norm = RMSNorm(width, eps, group_size=hidden_size)
        parts = {"input_mix_weight_down": lowrank}
        if with_inject:
            parts["block_inject_weight"] = hc_count
        self.down_and_inject = PackedLinear(width, parts)
        self.input_mix_weight_up = Linear(lowrank, width, bias=False)
        self.with_inject = with_inject

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [N, hc*H] -> (block input [N, H], injection gates [N, hc] or None)."""
        kernel_call = self.kernel_call(streams)
        if kernel_call is not None:
            kernels, args = kernel_call
            return kernels.mix(streams, *args)
        normed = self.hc_norm(streams)
        projected = self.down_and_inject(normed)
        low = F.silu(projected[0] / self.hc_count)
        gates = torch.sigmoid(self.input_mix_weight_up(low)).unflatten(-1, (self.hc_count, self.hidden_size))
        block_input = (gates * normed.unflatten(-1, (self.hc_count, self.hidden_size))).mean(dim=-2)
        if not self.with_inject:
            return block_input, None
        return block_input, 2 * torch.sigmoid(projected[1] / self.hc_count)

    def mix_pending(self, pending: PendingStreams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`mix` of `pending.combined()`, also returning those streams: (streams, block input, injection gates
        or None). A pending combine runs in the mix's launches (`combine_and_mix`)."""
        if pending.block_output is None:
            return (pending.streams, *self.mix(pending.streams))
        return self.combine_and_mix(*pending)

    def combine_and_mix(self, streams: torch.Tensor, block_output: torch.Tensor,
                        inject: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`combine(streams, block_output, inject)`, then this mixer's `mix` of the result: (the new streams,
        block input, injection gates or None). The fused kernels do both in the mix's launches."""
        kernel_call = self.kernel_call(streams)
        if kernel_call is not None and all(t.stride(-1) == 1 for t in (streams, block_output, inject)):
            kernels, args = kernel_call
            return kernels.combine_and_mix(streams, block_output, inject, *args)
        streams = self.combine(streams, block_output, inject)
        return (streams, *self.mix(streams))

    def kernel_call(self, streams: torch.Tensor):
        """(the fused kernels' module, the mix's arguments after the streams) when the kernels take this
        call: on CUDA (`fused`), a decode batch, mixer weights dense or INT8 per channel; else None."""
        if not fused(streams):
            return None
        from tierlm.kernels.hyper_connection import triton as kernels

        down, up = kernel_weight(self.down_and_inject), kernel_weight(self.input_mix_weight_up)
        if streams.shape[0] > kernels.MAX_TOKENS or down is None or up is None:
            return None
        return kernels, (self.hc_norm.weight, down[0], up[0], self.hc_count, self.hc_norm.eps, down[1], up[1])

    @staticmethod
    def combine(streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """streams [N, hc*H] + inject[:, s] * block_output on each stream s."""
        if fused(streams) and all(t.stride(-1) == 1 for t in (streams, block_output, inject)):
            from tierlm.kernels.hyper_connection import triton as kernels

            return kernels.combine(streams, block_output, inject)
        return naive.combine(streams, block_output, inject)


class PendingStreams(NamedTuple):
    """The hc streams [N, hc*H], and when a block's combine is left to whoever reads them next, that block's
    output [N, H] and injection gates [N, hc]: the streams stand for streams + inject[:, s] * block_output
    on each stream s. A decoder layer returns its MoE residual this way, so that the next mix does the
    combine in its own launches (`HyperConnection.mix_pending`) instead of a launch of its own."""

    streams: torch.Tensor
    block_output: torch.Tensor | None = None
    inject: torch.Tensor | None = None

    def combined(self) -> torch.Tensor:
        """The streams with the pending combine done (`HyperConnection.combine`)."""
        if self.block_output is None:
            return self.streams
        return HyperConnection.combine(*self)


def fold_layer_combine() -> bool:
    """Whether a decoder layer leaves its MoE combine to the next mix (`PendingStreams`), unless
    TIERLM_NO_FOLD_LAYER_COMBINE=1 (then it combines at its end: one more launch per layer on CUDA)."""
    return not os.environ.get("TIERLM_NO_FOLD_LAYER_COMBINE")


def kernel_weight(layer: PackedLinear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, None) for a dense weight, (packed words, scales) for INT8 per channel: what the mix kernels
    read in place; None for any other format (the torch path runs then)."""
    dense = layer.dense_weight()
    return (dense, None) if dense is not None else layer.int8_channel_weight()


def fused(streams: torch.Tensor) -> bool:
    """Whether the fused kernels may run: on CUDA, unless TIERLM_NO_FUSED_HC=1."""
    return streams.is_cuda and not os.environ.get("TIERLM_NO_FUSED_HC")
