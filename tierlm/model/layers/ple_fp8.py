"""`Fp8NgramTable`: a PLE n-gram table stored as float8 e4m3 with one global fp32 scale (vLLM's fp8 PLE
checkpoints: the `shard_{j}` parts in F8_E4M3 and `ngram_embedding.weight_scale`); half the bytes of
bf16. Gathered rows are dequantized (row * scale, in fp32); the table itself stays fp8. The loader puts
it in place of the `NgramTable` when the checkpoint's shards are fp8."""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn


class Fp8NgramTable(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=FP8), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, heads] -> embeddings [T, heads * dE] in fp32."""
        # gathered as bytes: indexing kernels do not cover float8 on every device
        stored = self.weight.view(torch.uint8)[rows].view(FP8)
        return (stored.float() * self.scale).flatten(-2)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the fp8 table, its scale): what `kernels/ple.decode_embeddings` reads."""
        return self.weight, self.scale
