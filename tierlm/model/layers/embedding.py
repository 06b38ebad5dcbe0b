"""`Embedding`: the token embedding table, held by a quant method (dense, or packed INT8 rows whose
gathered rows alone are dequantized)."""

from __future__ import annotations

import torch
from torch import nn

from tierlm.model.quantization.base import DENSE, EmbeddingMethod, ModulePart, WeightFormat


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

    def checkpoint_modules(self, path: str) -> list[ModulePart]:
        return [ModulePart(path, 0, self.num_embeddings, self.embedding_dim)]

    def runtime_tensor(self, part: ModulePart, name: str) -> torch.Tensor:
        return getattr(self, name)
