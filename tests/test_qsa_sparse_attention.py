"""QSA prefill attention: the Triton kernel (rows read by index from the pool, online softmax) against the
torch reference (gather + SDPA, the torch prefill path), under TRITON_INTERPRET=1 on CPU (compiled on a GPU).

fp32: both compute in fp32, so they differ by summation order only (1e-5 relative RMS). bf16: the bound is
the project's rule, twice the reference's own bf16 error: each form's distance from the fp32 reference
computed on the same (bf16-rounded) inputs, the kernel's within 2x the reference's."""

from __future__ import annotations

import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.qsa_sparse_attention import sparse_attention
from tierlm.kernels.qsa_sparse_attention.naive import merge_parts, sparse_attention_lse

HEADS, KV_HEADS, DIM, ROWS, SELECTED = 6, 2, 24, 80, 45  # DIM not a power of two; S spans two row blocks


def workload(dtype: torch.dtype, seed: int = 0):
    """Seven queries over a pool of 80 rows, each with 45 entries, some invalid (-1 padded -> scratch row 0):
    query 0 all valid, query 1 only its open tail (the last 3 entries), the rest random."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(ROWS, KV_HEADS, DIM, generator=gen) * 2
    values = torch.randn(ROWS, KV_HEADS, DIM, generator=gen)
    q = torch.randn(7, HEADS, DIM, generator=gen)
    rows = torch.randint(1, ROWS, (7, SELECTED), generator=gen)
    valid = torch.rand(7, SELECTED, generator=gen) < 0.7
    valid[0] = True
    valid[1] = False
    valid[1, -3:] = True
    valid[:, -1] = True  # every query sees at least its own row
    rows = torch.where(valid, rows, 0)
    return q.to(dtype), keys.to(dtype), values.to(dtype), rows, valid


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def compare(device: str) -> None:
    from tierlm.kernels.qsa_sparse_attention.triton import triton_sparse_attention

    scale = DIM**-0.5
    q, keys, values, rows, valid = workload(torch.float32)
    expected = sparse_attention(q, keys, values, rows, valid, scale)
    got = triton_sparse_attention(*(x.to(device) for x in (q, keys, values, rows, valid)), scale).cpu()
    assert got.dtype == torch.float32 and rel_rms(got, expected) < 1e-5, rel_rms(got, expected)
    # invalid entries are not read: garbage in their rows changes nothing
    poisoned_keys = keys.clone()
    poisoned_keys[0] = 1e4
    again = triton_sparse_attention(*(x.to(device) for x in (q, poisoned_keys, values, rows, valid)), scale).cpu()
    assert torch.equal(again, got)

    inputs = workload(torch.bfloat16)
    exact = sparse_attention(*(x.float() if x.is_floating_point() else x for x in inputs), scale)
    reference = sparse_attention(*inputs, scale)
    got = triton_sparse_attention(*(x.to(device) for x in inputs), scale).cpu()
    assert got.dtype == torch.bfloat16
    assert rel_rms(got, exact) <= 2 * rel_rms(reference, exact), (rel_rms(got, exact), rel_rms(reference, exact))


def compare_parts(device: str) -> None:
    """with_lse: the fp32 output and log-sum-exp of the reference; two disjoint parts of the rows (a query
    may have no valid entry in one: zeros, -inf), merged, give the attention over all of them. bf16: the
    outputs (the GPU multiplies the weights by V in TF32) within 2x the torch bf16 path's own error."""
    from tierlm.kernels.qsa_sparse_attention.triton import triton_sparse_attention

    scale = DIM**-0.5
    for dtype in (torch.float32, torch.bfloat16):
        q, keys, values, rows, valid = workload(dtype)
        first = valid & (torch.arange(SELECTED) < SELECTED // 2)
        parts = [first, valid & ~first]
        assert not parts[0][1].any()  # query 1's valid entries are all in the second part
        got = [triton_sparse_attention(*(x.to(device) for x in (q, keys, values, rows, part)), scale, with_lse=True)
               for part in parts]
        want = [sparse_attention_lse(q, keys, values, rows, part, scale) for part in parts]
        for (out, lse), (ref_out, ref_lse), part in zip(got, want, parts):
            out, lse = out.cpu(), lse.cpu()
            assert out.dtype == lse.dtype == torch.float32
            assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
            finite = torch.isfinite(ref_lse)
            assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
            seen = part.any(dim=1)
            assert (out[~seen] == 0).all()
            if dtype == torch.float32:
                assert rel_rms(out, ref_out) < 1e-5
            else:
                own = sparse_attention(q[seen], keys, values, rows[seen], part[seen], scale)
                assert rel_rms(out[seen], ref_out[seen]) <= 2 * rel_rms(own, ref_out[seen])
        merged = merge_parts([o.cpu() for o, _ in got], [lse.cpu() for _, lse in got], dtype)
        exact = sparse_attention(q.float(), keys.float(), values.float(), rows, valid, scale)
        assert merged.dtype == dtype
        if dtype == torch.float32:
            assert rel_rms(merged, exact) < 1e-5
        else:
            assert rel_rms(merged, exact) <= 2 * rel_rms(sparse_attention(q, keys, values, rows, valid, scale), exact)


def test_triton_sparse_attention_equals_the_reference():
    def on_cuda():
        compare("cuda")
        compare_parts("cuda")

    on_cuda_else_interpreted(on_cuda, INTERPRETED_EARLY, "test_triton_sparse_attention_equals_the_reference")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_sparse_attention_equals_the_reference": ("import test_qsa_sparse_attention as t; t.compare('cpu'); t.compare_parts('cpu')",),
}


def test_parts_merged_equal_the_whole_reference():
    q, keys, values, rows, valid = workload(torch.float32)
    first = valid & (torch.arange(SELECTED) < SELECTED // 2)
    parts = [first, valid & ~first]
    outs, lses = zip(*(sparse_attention_lse(q, keys, values, rows, part, DIM**-0.5) for part in parts))
    assert torch.isinf(lses[0][1]).all()  # query 1 has all its rows in the second part
    whole = sparse_attention(q, keys, values, rows, valid, DIM**-0.5)
    assert rel_rms(merge_parts(list(outs), list(lses), torch.float32), whole) < 1e-6


def test_reference_attends_to_valid_rows_only():
    q, keys, values, rows, valid = workload(torch.float32)
    out = sparse_attention(q, keys, values, rows, valid, DIM**-0.5)
    group = HEADS // KV_HEADS
    for m in range(q.shape[0]):
        picked = rows[m][valid[m]]
        for h in range(HEADS):
            k, v = keys[picked, h // group], values[picked, h // group]
            expected = torch.softmax(q[m, h] @ k.T * DIM**-0.5, -1) @ v
            torch.testing.assert_close(out[m, h], expected, rtol=1e-5, atol=1e-5)
