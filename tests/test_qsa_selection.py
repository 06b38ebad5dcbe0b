"""QSA selection: ranking keys from the block-scores kernel and rows from the selection kernel, against the
torch path (scores -> ranking keys -> top-k -> positions -> rows), under TRITON_INTERPRET=1 on CPU
(compiled on a GPU). Integer arithmetic: bit-identical."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import run_interpreted
from test_qsa_block_scores import RATIO, workload

from tierlm.kernels.qsa_block_scores import block_scores
from tierlm.kernels.qsa_block_scores.naive import ranking_keys
from tierlm.kernels.qsa_selection import selection_rows
from tierlm.model.layers.qsa_attention import top_blocks

BLOCK_SIZE, SCRATCH, TOP = 8, 60, 5  # PER_BLOCK = 2 keys per block of 8 tokens


def compare(device: str) -> None:
    from tierlm.kernels.qsa_block_scores.triton import triton_block_scores
    from tierlm.kernels.qsa_selection.triton import triton_selection_rows

    for dtype in (torch.float32, torch.bfloat16):
        q, index_keys, tables, positions = workload(dtype)
        scores = block_scores(q, index_keys, tables, positions, RATIO)
        keys = triton_block_scores(q.to(device), index_keys.to(device), tables.to(device), positions.to(device),
                                   RATIO, keys=True).cpu()
        # the ranking order is the reference's (scores equal up to fp32 summation order: same top blocks)
        assert torch.equal(torch.topk(keys, TOP).indices, torch.topk(ranking_keys(scores), TOP).indices)
        top = torch.topk(keys, TOP).values
        rows, valid = triton_selection_rows(top.to(device), positions.to(device), tables.to(device), RATIO,
                                            BLOCK_SIZE, SCRATCH)
        expected_rows, expected_valid = selection_rows(top, positions, tables, RATIO, BLOCK_SIZE, SCRATCH)
        assert torch.equal(valid.cpu(), expected_valid) and torch.equal(rows.cpu(), expected_rows)


def test_triton_selection_equals_the_reference():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        compare("cuda")
        return
    run_interpreted(*INTERPRETED_EARLY["test_triton_selection_equals_the_reference"])


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_selection_equals_the_reference": ("import test_qsa_selection as t; t.compare('cpu')",),
}


def test_reference_rows_are_the_top_blocks_tokens_and_the_open_tail():
    q, index_keys, tables, positions = workload(torch.float32)
    scores = block_scores(q, index_keys, tables, positions, RATIO)
    top = torch.topk(ranking_keys(scores), TOP).values
    rows, valid = selection_rows(top, positions, tables, RATIO, BLOCK_SIZE, SCRATCH)
    _, blocks = top_blocks(scores, TOP)
    for i, p in enumerate(positions.tolist()):
        seen = min(TOP, (p + 1) // RATIO)
        tokens = sorted({b * RATIO + t for b in blocks[i, :seen].tolist() for t in range(RATIO)}
                        | set(range((p + 1) // RATIO * RATIO, p + 1)))
        logical = tables[i][torch.tensor(tokens) // BLOCK_SIZE] * BLOCK_SIZE + torch.tensor(tokens) % BLOCK_SIZE
        assert sorted(rows[i][valid[i]].tolist()) == sorted(logical.tolist())
        assert (rows[i][~valid[i]] == SCRATCH * BLOCK_SIZE).all()
