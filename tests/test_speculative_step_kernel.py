"""kernels/speculative_step: the greedy speculative step's index work (the verify rows' inputs, acceptance,
the chained step's inputs) in one Triton launch each, against the torch reference, under TRITON_INTERPRET=1
on CPU (compiled on a GPU). Integer work: equal exactly. The verify rows' argmaxes it starts from are taken
from fp32 and from bf16 scores (bf16: ties, first index wins in both forms, as both take torch's argmax)."""

from __future__ import annotations

import copy

import pytest
import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.speculative_step import naive

BLOCK_SIZE, SCRATCH_BLOCK, SCRATCH_SLOT = 4, 9, 99


def cases(k: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """n = 5 requests of T = 1 + K rows: every accepted count 0..K (a request's drafts copy the argmaxes
    up to its count), a padding request (scratch slot, position 0), block tables as the rows of a wider
    buffer with -1 past each request's blocks, and a draft step reaching past a table's last column."""
    n, width, vocab = 5, 1 + k, 6
    scores = torch.randn(n * width, vocab, generator=gen).to(dtype)
    if dtype == torch.bfloat16:  # ties: each row's two best equal
        top = scores.float().topk(2, dim=-1)
        scores.scatter_(1, top.indices[:, 1:], top.values[:, :1].to(dtype))
    best = scores.view(n, width, vocab).argmax(dim=-1)
    counts = [j % (k + 1) for j in range(n)]
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    for i, count in enumerate(counts):
        drafts[i, :count] = best[i, :count]
        if count < k:
            drafts[i, count] = (best[i, count] + 1) % vocab  # the first mismatch
    token_ids = torch.cat([torch.randint(0, vocab, (n, 1), generator=gen), drafts], dim=1).flatten()
    starts = torch.tensor([13, 0, 7, 1, 0])  # request 0 reaches past its table; 4: padding
    positions = (starts[:, None] + torch.arange(width)).flatten()
    wide = torch.full((n + 1, 7), 50)  # what lies past a row's 4 columns is no block of it
    tables = wide[:n, :4]  # rows of a wider buffer
    tables.fill_(-1)
    for i, blocks in enumerate(([2, 5, 6], [1], [3, 4, 7], [8, 0], [SCRATCH_BLOCK])):
        tables[i, : len(blocks)] = torch.tensor(blocks)
    tables[2] = torch.tensor([3, 4, 7, 10])[:4]  # request 2 reaches its 4th block (column 3, the last)
    slots = torch.tensor([0, 1, 2, 3, SCRATCH_SLOT])
    row_slots = torch.randint(10, 40, (n, width), generator=gen)
    row_slots[:, -1] = slots
    row_slots[4] = SCRATCH_SLOT
    return {"best": best, "token_ids": token_ids, "positions": positions, "starts": starts, "tables": tables,
            "slots": slots, "row_slots": row_slots, "drafts": torch.randint(0, vocab, (n, k), generator=gen),
            "counts": counts}


def buffers(case: dict, device: str) -> tuple[torch.Tensor, naive.NextInputs]:
    """A readback and the chained step's input buffers as the fixed-shape runner holds them: views of wider
    tensors."""
    n, width = case["row_slots"].shape
    readback = torch.full((n + 2, 1 + width), -7, device=device)[:n]
    big = torch.arange(1000, 1000 + 3 * n * width, device=device)
    following = naive.NextInputs(
        input_ids=big[: n * width], positions=big[n * width : 2 * n * width].clone(),
        context_lens=case["starts"].to(device).clone(), slots=torch.cat([case["slots"], torch.tensor([5])]).to(
            device)[:n], verify_slots=torch.cat([case["row_slots"], case["row_slots"][:1]]).to(device)[:n],
        scratch_slot=SCRATCH_SLOT)
    return readback, following


def compare(device: str) -> None:
    from tierlm.kernels.speculative_step import triton as kernels

    gen = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 4):
        for dtype in (torch.float32, torch.bfloat16):
            case = cases(k, dtype, gen)
            on = {name: value.to(device) for name, value in case.items() if isinstance(value, torch.Tensor)}
            n, width = case["best"].shape
            # the verify rows' inputs: ids through picks into [previous ids | input ids], K/V rows by table
            candidates = torch.arange(100, 100 + 2 * n * width)
            picks = torch.randint(0, 2 * n * width, (n * width,), generator=gen)
            want = [torch.full((n * width,), -3) for _ in range(2)]
            naive.step_inputs(candidates, picks, case["positions"], case["tables"], BLOCK_SIZE, SCRATCH_BLOCK, *want)
            got = [torch.full((n * width,), -3, device=device) for _ in range(2)]
            kernels.step_inputs(candidates.to(device), picks.to(device), on["positions"], on["tables"], BLOCK_SIZE,
                                SCRATCH_BLOCK, *got)
            assert [g.tolist() for g in got] == [w.tolist() for w in want], (k, dtype, "step_inputs")
            assert want[1].tolist()[-width:] == [SCRATCH_BLOCK * BLOCK_SIZE + p % BLOCK_SIZE for p in range(width)]
            # acceptance
            readback, _ = buffers(case, "cpu")
            accepted = naive.accept_drafts(case["best"], case["token_ids"], case["positions"], case["row_slots"],
                                           case["tables"], BLOCK_SIZE, SCRATCH_BLOCK, readback)
            assert readback[:, 0].tolist() == case["counts"]
            got_readback, following = buffers(case, device)
            got_accepted = kernels.accept_drafts(on["best"], on["token_ids"], on["positions"], on["row_slots"],
                                                 on["tables"], BLOCK_SIZE, SCRATCH_BLOCK, got_readback)
            assert got_readback.tolist() == readback.tolist(), (k, dtype)
            for field in ("rows", "kept_slots", "step_slots", "step_positions", "step_kv_rows"):
                got_field, want_field = getattr(got_accepted, field), getattr(accepted, field)
                assert got_field.shape == want_field.shape and got_field.tolist() == want_field.tolist(), (k, field)
            # the end of the step: drafts in (strided: the oracle's [n, K] transposed), the chained inputs
            drafts = case["drafts"].T
            for chained in (True, False):
                want_readback, want_following = copy.deepcopy(readback), buffers(case, "cpu")[1]
                naive.finish_step(want_readback, drafts, want_following if chained else None)
                got_readback_end, got_following = got_readback.clone(), copy.deepcopy(following)
                kernels.finish_step(got_readback_end, drafts.to(device), got_following if chained else None)
                assert got_readback_end.tolist() == want_readback.tolist(), (k, chained)
                for field in ("input_ids", "positions", "context_lens", "slots", "verify_slots"):
                    assert getattr(got_following, field).tolist() == getattr(want_following, field).tolist(), (
                        k, chained, field)
                if chained:  # the reference's own sense: request 1 (count 1 % (k+1)) moves on by 1 + its count
                    assert want_following.context_lens.tolist()[1] == 1 + case["counts"][1]
                    assert want_following.slots.tolist()[4] == SCRATCH_SLOT
                    assert want_following.positions.tolist()[-width:] == [0] * width
    print("ok")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_kernels_match_reference": ("import test_speculative_step_kernel as t; t.compare('cpu')",),
}


def test_kernels_match_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_kernels_match_reference")


def test_reference_accepts_up_to_the_first_mismatch():
    """The reference on its own: accepted counts, the token after them, the row and slots they name, and the
    draft steps' positions and K/V rows (a column past the table: the scratch block)."""
    k = 3
    best = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    token_ids = torch.tensor([1, 5, 0, 7, 1, 5, 6, 7])  # request 0: draft 2 wrong; request 1: every draft right
    positions = torch.tensor([6, 7, 8, 9, 2, 3, 4, 5])
    row_slots = torch.tensor([[10, 11, 12, 0], [20, 21, 22, 1]])
    tables = torch.tensor([[3, 4], [6, -1]])
    readback = torch.zeros(2, 2 + k, dtype=torch.int64)
    accepted = naive.accept_drafts(best, token_ids, positions, row_slots, tables, BLOCK_SIZE, SCRATCH_BLOCK, readback)
    assert readback[:, :2].tolist() == [[1, 6], [3, 8]]
    assert accepted.rows.tolist() == [1, 7]
    assert accepted.kept_slots.tolist() == [11, 1] and accepted.step_slots.tolist() == [12, 20]
    assert accepted.step_positions.tolist() == [[8, 6], [9, 7]]  # start + a + s, s = 1, 2
    assert accepted.step_kv_rows.tolist() == [[SCRATCH_BLOCK * 4 + 0, SCRATCH_BLOCK * 4 + 2],
                                              [SCRATCH_BLOCK * 4 + 1, SCRATCH_BLOCK * 4 + 3]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernels_in_a_cuda_graph():
    """Captured and replayed (programmatic dependent launch on Hopper): the same outputs as run directly."""
    from tierlm.kernels.speculative_step import triton as kernels

    case = cases(3, torch.float32, torch.Generator().manual_seed(1))
    on = {name: value.cuda() for name, value in case.items() if isinstance(value, torch.Tensor)}
    direct, direct_following = buffers(case, "cuda")
    kernels.accept_drafts(on["best"], on["token_ids"], on["positions"], on["row_slots"], on["tables"], BLOCK_SIZE,
                          SCRATCH_BLOCK, direct)
    kernels.finish_step(direct, on["drafts"].T, direct_following)
    replayed, following = buffers(case, "cuda")
    start = copy.deepcopy(following)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        kernels.accept_drafts(on["best"], on["token_ids"], on["positions"], on["row_slots"], on["tables"],
                              BLOCK_SIZE, SCRATCH_BLOCK, replayed)
        kernels.finish_step(replayed, on["drafts"].T, copy.deepcopy(following))
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        kernels.accept_drafts(on["best"], on["token_ids"], on["positions"], on["row_slots"], on["tables"],
                              BLOCK_SIZE, SCRATCH_BLOCK, replayed)
        kernels.finish_step(replayed, on["drafts"].T, following)
    for name in ("input_ids", "positions", "context_lens", "slots", "verify_slots"):  # as before the capture
        getattr(following, name).copy_(getattr(start, name))
    replayed.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert replayed.tolist() == direct.tolist()
    for name in ("input_ids", "positions", "context_lens", "slots", "verify_slots"):
        assert getattr(following, name).tolist() == getattr(direct_following, name).tolist(), name
