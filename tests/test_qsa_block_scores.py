"""QSA block scores: the Triton kernels (decode: reading each request's visible keys through its block table;
prefill: a request's queries against its gathered keys) against the torch references, under
TRITON_INTERPRET=1 on CPU (compiled on a GPU), fp32 and bf16.

Both forms compute in fp32 from the same inputs (bf16 values upcast exactly), so in either dtype they may
differ only by fp32 summation order: the tolerance is a few fp32 ulps of the scores, not a bf16 one."""

from __future__ import annotations

import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.qsa_block_scores import block_scores, request_scores
from tierlm.model.layers.qsa_attention import top_blocks

RATIO, PER_BLOCK, HEADS, DIM = 4, 2, 3, 24  # DIM not a power of two: the kernel masks its columns


def workload(dtype: torch.dtype, seed: int = 0):
    """Five requests of 0 to 150 tokens over shuffled blocks; block tables padded with -1 to 20 blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 60
    index_keys = torch.randn(blocks + 1, PER_BLOCK, DIM, generator=gen).abs().to(dtype)
    positions = torch.tensor([150, 0, 9, 31, 77])
    order, tables = torch.randperm(blocks, generator=gen).tolist(), torch.full((5, 20), -1)
    for i, p in enumerate(positions.tolist()):
        used = p // (RATIO * PER_BLOCK) + 1
        tables[i, :used] = torch.tensor(order[:used])
        order = order[used:]
    q = torch.randn(5, HEADS, DIM, generator=gen)
    q[3] = -q[3].abs()  # every score of request 3 is relu(negative) = 0: a full tie
    return q.to(dtype), index_keys, tables, positions


def compare(device: str) -> None:
    from tierlm.kernels.qsa_block_scores.triton import triton_block_scores

    for dtype in (torch.float32, torch.bfloat16):
        q, index_keys, tables, positions = workload(dtype)
        expected = block_scores(q, index_keys, tables, positions, RATIO)
        # the kernel reads a block table with a row stride wider than its width, as static decode gives it
        wide = torch.full((5, 32), 7)
        wide[:, :20] = tables
        got = triton_block_scores(q.to(device), index_keys.to(device), wide[:, :20].to(device), positions.to(device),
                                  RATIO).cpu()
        assert torch.equal(got == float("-inf"), expected == float("-inf"))
        assert (expected[1] == float("-inf")).all() and (expected[3][:4] == 0).all()
        seen = expected > float("-inf")
        torch.testing.assert_close(got[seen], expected[seen], rtol=1e-6, atol=1e-6)
        assert torch.equal(top_blocks(got, 12)[1], top_blocks(expected, 12)[1])


def test_triton_block_scores_equal_the_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_triton_block_scores_equal_the_reference")


def compare_request(device: str) -> None:
    """The prefill form: a chunk of one request's queries (positions 37..96: some tiles of keys seen by no
    query of a tile, the last key tile partial) against its gathered keys, at the module's tiles and small
    ones, fp32 and bf16."""
    import tierlm.kernels.qsa_block_scores.triton as kernels

    gen = torch.Generator().manual_seed(3)
    positions = torch.arange(37, 97)
    saved = kernels.REQUEST_BLOCK_Q, kernels.REQUEST_BLOCK_K
    try:
        for kernels.REQUEST_BLOCK_Q, kernels.REQUEST_BLOCK_K in {saved, (16, 16)}:
            for dtype in (torch.float32, torch.bfloat16):
                q = torch.randn(len(positions), HEADS, DIM, generator=gen).to(dtype)
                keys = torch.randn(97 // RATIO, DIM, generator=gen).to(dtype)
                expected = request_scores(q, keys, positions, RATIO)
                got = kernels.triton_request_scores(q.to(device), keys.to(device), positions.to(device), RATIO).cpu()
                assert torch.equal(got == float("-inf"), expected == float("-inf"))
                seen = expected > float("-inf")
                assert (expected[seen] == 0).any() and (expected[seen] > 0).any()
                torch.testing.assert_close(got[seen], expected[seen], rtol=1e-6, atol=1e-6)
    finally:
        kernels.REQUEST_BLOCK_Q, kernels.REQUEST_BLOCK_K = saved


def test_triton_request_scores_equal_the_reference():
    on_cuda_else_interpreted(lambda: compare_request("cuda"), INTERPRETED_EARLY,
                             "test_triton_request_scores_equal_the_reference")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_block_scores_equal_the_reference": ("import test_qsa_block_scores as t; t.compare('cpu')",),
    "test_triton_request_scores_equal_the_reference": ("import test_qsa_block_scores as t; t.compare_request('cpu')",),
}


def test_reference_scores_only_what_each_query_sees():
    q, index_keys, tables, positions = workload(torch.float32)
    scores = block_scores(q, index_keys, tables, positions, RATIO)
    for i, p in enumerate(positions.tolist()):
        visible = (p + 1) // RATIO
        keys = index_keys[tables[i].clamp_min(0)].flatten(0, 1)[:visible]
        expected = torch.relu(q[i] @ keys.T).sum(0) / DIM**0.5
        torch.testing.assert_close(scores[i, :visible], expected, rtol=1e-6, atol=1e-6)
        assert (scores[i, visible:] == float("-inf")).all()
