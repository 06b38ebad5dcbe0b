"""kernels/embed_streams: the one-launch gather into the hc streams against the torch reference (F.embedding
then repeat), under TRITON_INTERPRET=1 on CPU at small shapes (compiled on a GPU, at the real width too).
A copy: equal bit for bit in fp32 and bf16. The INT8 per-row table too: the same fp32 product rounded once,
so equal bit for bit as well, and equal to what an INT8 `Embedding` layer's torch path gathers."""

from __future__ import annotations

import pytest
import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.embed_streams import naive


def compare(device: str, vocab: int = 50, hidden: int = 40, block: int = 16) -> None:
    """Row slices of several blocks (the last part-full), repeated and extreme ids, hc 1 and 4, a table
    whose rows are strided (a column slice of a wider one), fp32 and bf16; the INT8 table the same way,
    and at a width that is a whole number of blocks."""
    from tierlm.kernels.embed_streams import triton as kernels

    kernels.BLOCK_H, default = block, kernels.BLOCK_H
    try:
        check(device, kernels, vocab, hidden)
        for width in (hidden, 2 * block):
            check_int8(device, kernels, vocab, width)
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


def int8_table(vocab: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random INT8 per-row table (words [V, H / 4], scales [V, 1] in dtype) that uses the whole value range
    (-128 and 127 included), with scales of many magnitudes so the products need rounding."""
    from tierlm.kernels.quant_linear import packing

    gen = torch.Generator().manual_seed(1)
    stored = torch.randint(0, 256, (vocab, hidden), generator=gen)
    stored[0, :2] = torch.tensor([0, 255])
    scales = (torch.rand(vocab, 1, generator=gen) * 10.0 ** torch.randint(-4, 2, (vocab, 1), generator=gen))
    return packing.pack(stored, 8), scales.to(dtype)


def check_int8(device: str, kernels, vocab: int, hidden: int) -> None:
    from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

    for dtype in (torch.float32, torch.bfloat16):
        words, scales = int8_table(vocab, hidden, dtype)
        # the reference gathers what an INT8 `Embedding` layer's torch path gathers (the model's CPU path)
        layer_rows = PackQuantizedFormat(8, None).dequantize({"weight_packed": words, "weight_scale": scales}, hidden)
        for tokens in (1, 3, 7):
            ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens))
            ids[0] = 0 if tokens > 1 else vocab - 1
            for hc_count in (1, 4):
                expected = naive.embed_streams(words, ids, hc_count, scales)
                assert expected.dtype == dtype
                assert torch.equal(expected[:, :hidden], layer_rows[ids].to(dtype))
                got = kernels.embed_streams(words.to(device), ids.to(device), hc_count, scales.to(device))
                assert got.dtype == dtype and got.shape == (tokens, hc_count * hidden)
                assert torch.equal(got.cpu(), expected), (dtype, tokens, hc_count, hidden)


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
    with pytest.raises(ValueError, match="INT8 table must be int32 words"):
        naive.embed_streams(table, torch.zeros(2, dtype=torch.int64), 4, torch.ones(4, 1))
    with pytest.raises(ValueError, match="INT8 table must be int32 words"):
        naive.embed_streams(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 4,
                            torch.ones(4, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernel_at_real_width_on_gpu():
    """Dense and INT8 tables at hidden 2560 (3 blocks a row, the last part-full), bf16 and fp32, bit-identical."""
    compare("cuda", vocab=1000, hidden=2560, block=1024)
