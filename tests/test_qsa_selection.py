"""QSA selection: the rows kernels (top-k by a radix select, no sort: one program a query, or split over
many) against the torch path (scores -> ranking keys -> top-k -> block order -> positions -> rows), under
TRITON_INTERPRET=1 on CPU (compiled on a GPU), each with its module's tiles and small ones (rows over
several tiles or chunks). Integer work on the scores' bits:
bit-identical, in fp32 and bf16 workloads alike; random scores end the radix passes early, the tied ones
below run them all."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import on_cuda_else_interpreted
from test_qsa_block_scores import RATIO, workload

from tierlm.kernels.qsa_block_scores import block_scores
from tierlm.kernels.qsa_selection import selection_rows
from tierlm.model.layers.qsa_attention import top_blocks

BLOCK_SIZE, SCRATCH, TOP = 8, 60, 5  # PER_BLOCK = 2 keys per block of 8 tokens


def tied_scores(groups: int, seen: list[int], seed: int = 1) -> torch.Tensor:
    """Scores with many exact ties (a few distinct values, zeros and -0.0 among them), -inf past `seen`."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (len(seen), groups), generator=gen).float() * 0.375
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, 0.0, -0.0)
    return scores.masked_fill(torch.arange(groups) >= torch.tensor(seen)[:, None], float("-inf"))


def compare(device: str) -> None:
    """The one-program select at its tile and a small one; the split select at its tiles and small chunks
    (several a query) of 8 and 11 bits a pass. The split select leaves its histograms and counters at zero."""
    import tierlm.kernels.qsa_selection.split_triton as split
    import tierlm.kernels.qsa_selection.triton as kernels
    from tierlm.kernels.split_reduce import arrival_counters

    saved = kernels.BLOCK_G, kernels.SPLIT_FROM_GROUPS, split.CHUNK, split.DIGIT_BITS
    try:
        kernels.SPLIT_FROM_GROUPS = 1 << 30
        for kernels.BLOCK_G in {saved[0], 256}:
            compare_tile(device)
        kernels.SPLIT_FROM_GROUPS = 0
        for split.CHUNK, split.DIGIT_BITS in {saved[2:], (64, 8), (128, 11)}:
            compare_tile(device)
            for owner in ("qsa_selection.histograms", "qsa_selection.passes"):  # (the kernels' device, as keyed)
                assert not arrival_counters(owner, torch.empty(0, device=device).device, 1).any(), owner
    finally:
        kernels.BLOCK_G, kernels.SPLIT_FROM_GROUPS, split.CHUNK, split.DIGIT_BITS = saved


def compare_tile(device: str) -> None:
    from tierlm.kernels.qsa_block_scores.triton import triton_block_scores
    from tierlm.kernels.qsa_selection.triton import triton_selection_rows

    on = lambda *ts: [t.to(device) for t in ts]
    for dtype in (torch.float32, torch.bfloat16):
        q, index_keys, tables, positions = workload(dtype)
        # the layer's two launches (scores of requests that see <= TOP blocks left out) against the torch path
        scores = triton_block_scores(*on(q, index_keys, tables, positions), RATIO, skip_up_to=TOP)
        rows, valid = triton_selection_rows(scores, *on(positions, tables), RATIO, BLOCK_SIZE, SCRATCH, TOP)
        expected = selection_rows(block_scores(q, index_keys, tables, positions, RATIO), positions, tables, RATIO,
                                  BLOCK_SIZE, SCRATCH, TOP)
        assert torch.equal(valid.cpu(), expected[1]) and torch.equal(rows.cpu(), expected[0]), dtype
    # every seen block chosen (the table holds <= top blocks): no scores at all
    rows, valid = triton_selection_rows(None, *on(positions, tables), RATIO, BLOCK_SIZE, SCRATCH, 40)
    expected = selection_rows(None, positions, tables, RATIO, BLOCK_SIZE, SCRATCH, 40)
    assert torch.equal(valid.cpu(), expected[1]) and torch.equal(rows.cpu(), expected[0])
    # ties across several tiles of the select; one query's seen count exactly the budget
    positions = torch.tensor([1100 * RATIO - 1, 700 * RATIO + 2, 300 * RATIO])
    tables = torch.randperm(2000)[: 3 * 550].view(3, 550)
    scores = tied_scores(1100, [1100, 700, 300])
    rows, valid = triton_selection_rows(*on(scores, positions, tables), RATIO, BLOCK_SIZE, SCRATCH, 300)
    expected = selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, SCRATCH, 300)
    assert torch.equal(valid.cpu(), expected[1]) and torch.equal(rows.cpu(), expected[0])


def test_triton_selection_equals_the_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_triton_selection_equals_the_reference")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_selection_equals_the_reference": ("import test_qsa_selection as t; t.compare('cpu')",),
}


def test_reference_rows_are_the_top_blocks_tokens_in_block_order_and_the_open_tail():
    q, index_keys, tables, positions = workload(torch.float32)
    scores = block_scores(q, index_keys, tables, positions, RATIO)
    rows, valid = selection_rows(scores, positions, tables, RATIO, BLOCK_SIZE, SCRATCH, TOP)
    _, blocks = top_blocks(scores, TOP)
    for i, p in enumerate(positions.tolist()):
        seen = min(TOP, (p + 1) // RATIO)
        chosen = sorted(blocks[i, :seen].tolist())
        tokens = [b * RATIO + t for b in chosen for t in range(RATIO)]
        tokens += list(range((p + 1) // RATIO * RATIO, p + 1))
        logical = tables[i][torch.tensor(tokens) // BLOCK_SIZE] * BLOCK_SIZE + torch.tensor(tokens) % BLOCK_SIZE
        assert rows[i][valid[i]].tolist() == logical.tolist()
        assert (rows[i][~valid[i]] == SCRATCH * BLOCK_SIZE).all()


def test_both_forms_need_scores_when_the_table_holds_more_blocks_than_the_budget():
    forms = [selection_rows]
    if importlib.util.find_spec("triton") is not None:
        from tierlm.kernels.qsa_selection.triton import triton_selection_rows

        forms.append(triton_selection_rows)
    tables = torch.zeros(1, 3, dtype=torch.int64)  # 3 blocks of 8 tokens: 6 compressed keys, more than TOP
    for form in forms:
        with pytest.raises(ValueError, match="scores are needed"):
            form(None, torch.tensor([20]), tables, RATIO, BLOCK_SIZE, SCRATCH, TOP)
