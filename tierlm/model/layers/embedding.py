"""`Embedding`: the token embedding table, held by a quant method (dense, or packed INT8 rows whose
gathered rows alone are dequantized), and the tie that lets a `tie_word_embeddings` lm_head run on it.

A tied pair is one tensor in every format: the table's rows are vocab ids for the gather and output rows
for the lm_head's product, so a per-row (per-channel) scale serves both, and the packed words and scales
are held once (as vLLM reuses a tied embedding as its lm_head; the checkpoint stores the table once under
`model.embed_tokens`, as transformers saves tied weights)."""

from __future__ import annotations

import torch
from torch import nn

from tierlm.model.quantization.base import (
    DENSE,
    EmbeddingMethod,
    ModulePart,
    QuantizationError,
    WeightFormat,
    runtime_view,
)


class Embedding(nn.Module):
    kind = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.quant_method = None
        self.set_format(DENSE)

    def set_format(self, fmt: WeightFormat) -> None:
        if self.quant_method is not None:
            for name in self.quant_method.format.runtime_names:
                delattr(self, name)
        self.quant_method = EmbeddingMethod(fmt, self.num_embeddings, self.embedding_dim)
        self.quant_method.create_weights(self, self.num_embeddings, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, ids)

    def kernel_table(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """What `kernels/embed_streams` reads in place: (table [V, H], None) when held unquantized, (packed
        words [V, H / 4] int32, scales [V, 1]) when held as symmetric INT8 with one scale per row
        (`WeightFormat.int8_per_channel`); None for any other format (the torch path gathers then)."""
        fmt = self.quant_method.format
        if fmt == DENSE:
            return self.weight, None
        return fmt.int8_per_channel(runtime_view(self, fmt), self.embedding_dim)

    def checkpoint_modules(self, path: str) -> list[ModulePart]:
        return [ModulePart(path, 0, self.num_embeddings, self.embedding_dim)]

    def runtime_tensor(self, part: ModulePart, name: str) -> torch.Tensor:
        return getattr(self, name)

    def tie(self, lm_head: nn.Module) -> None:
        """Make `lm_head` (a [vocab, hidden] `Linear` held in this table's format) run on this table's own
        runtime tensors, so the pair is held once; a different format is an error naming both."""
        fmt, head_fmt = self.quant_method.format, lm_head.quant_method.format
        if head_fmt != fmt:
            raise QuantizationError(
                f"tie_word_embeddings: model.embed_tokens is {fmt.label} but lm_head is {head_fmt.label}; a tied pair is "
                "stored and held once, so the quantization_config must give both one format (target or ignore both)"
            )
        for name in fmt.runtime_names:
            setattr(lm_head, name, getattr(self, name))
