"""kernels/embed_streams: the one-launch gather into the hc streams against the torch reference (F.embedding
then repeat), under TRITON_INTERPRET=1 on CPU at small shapes (compiled on a GPU, at the real width too).
A copy: equal bit for bit in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.embed_streams import naive


def compare(device: str, vocab: int = 50, hidden: int = 40, block: int = 16) -> None:
    """Row slices of several blocks (the last part-full), repeated and extreme ids, hc 1 and 4, a table
    whose rows are strided (a column slice of a wider one), fp32 and bf16."""
    from tierlm.kernels.embed_streams import triton as kernels

    kernels.BLOCK_H, default = block, kernels.BLOCK_H
    try:
        check(device, kernels, vocab, hidden)
    finally:
        kernels.BLOCK_H = default


def check(device: str, kernels, vocab: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(vocab, hidden + 8, generator=gen)
    ids = torch.tensor([3, vocab - 1, 0, 3, 17])
    for dtype in (torch.float32, torch.bfloat16):
        for table in (wide[:, :hidden].contiguous(), wide[:, 4 : 4 + hidden]):
            table = table.to(dtype)
            for hc_count in (1, 4):
                expected = naive.embed_streams(table, ids, hc_count)
                got = kernels.embed_streams(table.to(device), ids.to(device), hc_count)
                assert got.dtype == dtype and got.shape == (ids.shape[0], hc_count * hidden)
                assert torch.equal(got.cpu(), expected), (dtype, hc_count, table.stride())
    assert kernels.embed_streams(wide.to(device), ids[:0].to(device), 4).shape == (0, 4 * (hidden + 8))


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_kernel_matches_reference": ("import test_embed_streams_kernel as t; t.compare('cpu')",),
}


def test_kernel_matches_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_kernel_matches_reference")


def test_bad_arguments_are_named():
    table = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="ids must be"):
        naive.embed_streams(table, torch.zeros(2, 1, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="hc_count"):
        naive.embed_streams(table, torch.zeros(2, dtype=torch.int64), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernel_at_real_width_on_gpu():
    compare("cuda", vocab=1000, hidden=2560, block=1024)
