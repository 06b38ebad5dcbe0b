"""The chunked gated delta rule's Triton kernel (one launch over a varlen batch, states in a pool) against
the torch chunked reference with the same signature, under TRITON_INTERPRET=1 on CPU (compiled on a GPU).

Both forms compute in fp32 from the same inputs (bf16 values upcast exactly), so they may differ only by
fp32 summation order. The bound says what that means: the kernel's distance from the reference must be
under 1% of what rounding the inputs to bf16 moves the reference's own output (measured per case), and
under 1e-5 relative RMS in fp32 (the reference's own bound against the per-token rule)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from interpreted import on_cuda_else_interpreted, run_interpreted

from tierlm.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tierlm.kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_varlen

# (sequence lengths, key heads, value heads, Dk, Dv): lengths not multiples of 64, length 1, several
# sequences; Dv not a power of two (masked columns, two column blocks), grouped key heads
CASES = {
    "one_long": ([130], 1, 1, 16, 16),
    "mixed_lengths": ([1, 70, 5, 64], 2, 4, 16, 24),
    "single_tokens": ([1, 1, 1], 1, 2, 32, 16),
}


def workload(lengths, hk, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 3
    beta = torch.rand(n, hv, generator=gen)
    pool = torch.randn(len(lengths) + 3, hv, dk, dv, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    indices = torch.randperm(pool.shape[0], generator=gen)[: len(lengths)]  # unused slots stay untouched
    return (q, k, v, g, beta), cu_seqlens, pool, indices


def rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def run(rule, inputs, cu_seqlens, pool, indices, device="cpu"):
    pool = pool.clone().to(device)
    out = rule(*(x.to(device) for x in inputs), cu_seqlens.to(device), pool, indices.to(device))
    return out.cpu(), pool.cpu()


def compare(case: str, device: str) -> None:
    from tierlm.kernels.gated_delta_rule.chunk_triton import triton_chunk_gated_delta_rule_varlen as kernel

    inputs, cu_seqlens, pool, indices = workload(*CASES[case])
    o_ref, s_ref = run(chunk_gated_delta_rule_varlen, inputs, cu_seqlens, pool, indices)
    o, s = run(kernel, inputs, cu_seqlens, pool, indices, device)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[indices] = False
    assert torch.equal(s[untouched], pool[untouched])
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5, (rel_rms(o, o_ref), rel_rms(s, s_ref))

    rounded = tuple(x.bfloat16() for x in inputs)  # as the layer hands them over in a bf16 model
    ob_ref, sb_ref = run(chunk_gated_delta_rule_varlen, rounded, cu_seqlens, pool, indices)
    ob, sb = run(kernel, rounded, cu_seqlens, pool, indices, device)
    bf16_cost = min(rel_rms(ob_ref, o_ref), rel_rms(sb_ref, s_ref))
    assert 1e-4 < bf16_cost  # the yardstick is a real bf16 effect
    assert rel_rms(ob, ob_ref) < 0.01 * bf16_cost and rel_rms(sb, sb_ref) < 0.01 * bf16_cost


@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_chunk_rule_equals_the_reference(case):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        compare(case, "cuda")
        return
    run_interpreted(*chunk_child(case))


def chunk_child(case: str) -> tuple[str]:
    return (f"import test_gated_delta_rule_triton as t; t.compare({case!r}, 'cpu')",)


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_chunk_rule_equals_the_reference": chunk_child,
    "test_layer_prefill_through_the_kernel_equals_its_torch_path": (
        "import test_gated_delta_rule_triton as t; t.compare_layer('cpu')",),
}


def test_varlen_reference_is_the_per_sequence_rule():
    """The varlen wrapper repeats key heads, reads and writes the right slots, and splits at cu_seqlens."""
    inputs, cu_seqlens, pool, indices = workload(*CASES["mixed_lengths"])
    out, final_pool = run(chunk_gated_delta_rule_varlen, inputs, cu_seqlens, pool, indices)
    q, k, v, g, beta = inputs
    repeat = v.shape[1] // k.shape[1]
    for i, slot in enumerate(indices.tolist()):
        lo, hi = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        per_seq = (q[lo:hi].repeat_interleave(repeat, 1), k[lo:hi].repeat_interleave(repeat, 1), v[lo:hi], g[lo:hi],
                   beta[lo:hi])
        o_ref, s_ref = recurrent_gated_delta_rule(*(x[None] for x in per_seq), pool[slot][None])
        assert rel_rms(out[lo:hi], o_ref[0]) < 1e-5 and rel_rms(final_pool[slot], s_ref[0]) < 1e-5
        o_chunk, _ = chunk_gated_delta_rule(*(x[None] for x in per_seq), pool[slot][None])
        assert torch.equal(out[lo:hi], o_chunk[0])


def compare_layer(device: str) -> None:
    """GatedDeltaNet's prefill with the rule in one Triton launch against its torch path: same outputs,
    same conv windows and recurrent states left in the slots (three requests of 1, 70 and 5 tokens)."""
    from types import SimpleNamespace

    from tierlm.model.cache import GDNState
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.layers.gated_deltanet import GatedDeltaNet

    torch.manual_seed(0)
    config = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-6,
                             output_gate_act="silu")
    layer = GatedDeltaNet(config)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    layer = layer.to(device)
    lengths, slots = [1, 70, 5], [3, 0, 1]
    batch = ForwardBatch.build([[2] * n for n in lengths], [9, 0, 3], slots, [[0], [1], [2]], 128, device)
    mixed = torch.randn(sum(lengths), layer.conv_dim, device=device)
    beta = torch.rand(sum(lengths), layer.num_v_heads, device=device)
    g = -torch.rand(sum(lengths), layer.num_v_heads, device=device) * 3
    conv0 = torch.randn(4, layer.conv_dim, layer.kernel - 1, device=device)
    rec0 = torch.randn(4, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device)
    torch_state = GDNState(conv0.clone(), rec0.clone())
    kernel_state = GDNState(conv0.clone(), rec0.clone())
    expected = torch_chunks(layer, mixed, beta, g, batch, torch_state)
    got = layer._chunks_triton(mixed, beta, g, batch, kernel_state, layer.conv1d.weight.squeeze(1))
    assert torch.equal(kernel_state.conv, torch_state.conv)
    assert rel_rms(got.cpu(), expected.cpu()) < 1e-5
    assert rel_rms(kernel_state.recurrent.cpu(), torch_state.recurrent.cpu()) < 1e-5


def torch_chunks(layer, mixed, beta, g, batch, state):
    """The layer's torch path, whatever device the tensors are on (the kill switch forces it on CUDA)."""
    saved = os.environ.get("TIERLM_NO_TRITON_GDN_PREFILL")
    os.environ["TIERLM_NO_TRITON_GDN_PREFILL"] = "1"
    try:
        return layer._chunks(mixed, beta, g, batch, state)
    finally:
        if saved is None:
            del os.environ["TIERLM_NO_TRITON_GDN_PREFILL"]


def test_layer_prefill_through_the_kernel_equals_its_torch_path():
    on_cuda_else_interpreted(lambda: compare_layer("cuda"), INTERPRETED_EARLY, "test_layer_prefill_through_the_kernel_equals_its_torch_path")


def test_kernel_refuses_bad_inputs():
    """Checked before any launch: an fp16 state pool, an empty sequence in cu_seqlens."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from tierlm.kernels.gated_delta_rule.chunk_triton import triton_chunk_gated_delta_rule_varlen as kernel

    inputs, cu_seqlens, pool, indices = workload(*CASES["mixed_lengths"])
    with pytest.raises(ValueError, match="state pool must be fp32"):
        kernel(*inputs, cu_seqlens, pool.half(), indices)
    with pytest.raises(ValueError, match="empty or decreasing"):
        kernel(*inputs, torch.tensor([0, 1, 1, 76, 140]), pool, indices)
