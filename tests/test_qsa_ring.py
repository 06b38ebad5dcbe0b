"""kernels/qsa_ring: the indexer rings after each verified row and their block keys' rows, the Triton launch
against the torch path, under TRITON_INTERPRET=1 on CPU (compiled on a GPU), at 3 rows per request and at
one (decode). Copies and integer arithmetic: bit-identical, the ring pool included."""

from __future__ import annotations

import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.qsa_ring import ring_after_rows

RATIO, HEAD_DIM, BLOCK_SIZE, SCRATCH, ROWS = 4, 8, 8, 9, 3


def workload(dtype: torch.dtype, rows: int):
    """3 requests at ring offsets 1, 0 and 2 (rows that close a group, and groups opened inside the batch),
    their own slots last in their row slots, raw keys a view with a row stride (as the projection's split).
    rows 1: a decode batch (contexts 7, 11, 3: two close their groups, one in its table's second
    block), its block table column-major."""
    gen = torch.Generator().manual_seed(0)
    contexts = torch.tensor([5, 8, 2]) if rows > 1 else torch.tensor([7, 11, 3])
    ring = torch.randn(12, RATIO, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.tensor([2, 5, 0])
    raw_keys = torch.randn(3 * rows, HEAD_DIM + 5, generator=gen).to(dtype)[:, :HEAD_DIM]
    positions = (contexts[:, None] + torch.arange(rows)).flatten()
    state_slots = torch.tensor([[6, 7, 2], [8, 9, 5], [10, 11, 0]])[:, ROWS - rows :]
    tables = torch.tensor([[3, 1, -1, -1], [0, 4, 2, -1], [5, -1, -1, -1]])
    if rows == 1:  # a column-major table (the kernel's launch makes its rows contiguous)
        tables = tables.t().contiguous().t()
    return ring, slots, raw_keys, positions, contexts, state_slots, tables


def compare(device: str) -> None:
    from tierlm.kernels.qsa_ring.triton import triton_ring_after_rows

    for dtype, rows in ((torch.float32, ROWS), (torch.bfloat16, ROWS), (torch.float32, 1)):
        ring, *rest = workload(dtype, rows)
        expected_ring = ring.clone()
        expected = ring_after_rows(expected_ring, *rest, BLOCK_SIZE, SCRATCH)
        got_ring = ring.clone().to(device)
        got = triton_ring_after_rows(got_ring, *(t.to(device) for t in rest), BLOCK_SIZE, SCRATCH)
        for name, ours, theirs in zip(("rings", "key rows"), got, expected, strict=True):
            assert torch.equal(ours.cpu(), theirs), f"{dtype} {rows} rows: {name}"
        assert torch.equal(got_ring.cpu(), expected_ring), f"{dtype} {rows} rows: ring pool"
        assert expected[1].tolist().count(SCRATCH * BLOCK_SIZE // RATIO) < rows * 3  # some blocks close


def test_triton_rings_equal_the_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_triton_rings_equal_the_reference")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_rings_equal_the_reference": ("import test_qsa_ring as t; t.compare('cpu')",),
}
