"""Norm + rotary fused (`kernels/norm_rope`): the Triton kernel against the torch reference under
TRITON_INTERPRET=1 on CPU (compiled on a GPU), on a strided input (the query half of [query | gate]) with
a partial rotary; with cos/sin given, computed from positions, and with the keys and values written into
pool rows.

fp32: equal up to the sum of squares' order (1e-6 relative). bf16: the project's rule, the kernel's
distance from the fp32 computation within 2x the torch bf16 path's own."""

from __future__ import annotations

import math

import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.norm_rope import norm_rope
from tierlm.kernels.norm_rope.naive import apply_rotary, norm_rope_at, norm_rope_kv_write
from tierlm.model.layers.rotary import RotaryEmbedding

TOKENS, HEADS, DIM, ROTARY = 5, 3, 48, 12  # DIM not a power of two


POSITIONS = torch.tensor([0, 7, 300, 4095, 70000])
INV_FREQ = RotaryEmbedding(ROTARY, 10000.0).inv_freq


def workload(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randn(TOKENS, HEADS, 2 * DIM, generator=gen) * 3
    x = packed.to(dtype)[..., :DIM]  # strided: every head's row is followed by its gate
    weight = torch.randn(DIM, generator=gen) * 0.1
    cos, sin = RotaryEmbedding(ROTARY, 10000.0).cos_sin(POSITIONS, dtype)
    return x, weight, cos, sin


def at_positions(device: str, dtype: torch.dtype, fused: bool, inputs: torch.dtype | None = None) -> torch.Tensor:
    """Norm + rotary in `dtype` from positions (of inputs rounded to `inputs`): keys written into shuffled
    pool rows (with the values) by `norm_rope_kv_write` for the first three tokens, `norm_rope_at`'s output
    for all; the keys [T, H, D]."""
    from tierlm.kernels.norm_rope.triton import triton_norm_rope_at, triton_norm_rope_kv_write

    x, weight, _, _ = workload(inputs or dtype)
    x = x.to(dtype)
    values = x.flip(0) * 2
    rows = torch.tensor([6, 1, 3])
    pools = torch.zeros(2, 8, HEADS, DIM, dtype=dtype)
    args = [t.to(device) for t in (x[:3], weight)] + [1e-6] + [t.to(device) for t in (POSITIONS[:3], INV_FREQ)]
    pool_args = [t.to(device) for t in (values[:3], rows, *pools)]
    (triton_norm_rope_kv_write if fused else norm_rope_kv_write)(*args, *pool_args)
    key_pool, value_pool = (t.cpu() for t in pool_args[2:])
    assert torch.equal(value_pool[rows], values[:3]) and not key_pool[[0, 2, 4, 5, 7]].any()
    form = triton_norm_rope_at if fused else norm_rope_at
    out = form(*(t.to(device) for t in (x, weight)), 1e-6, POSITIONS.to(device), INV_FREQ.to(device)).cpu()
    assert torch.equal(out[:3], key_pool[rows])  # the same kernel: the same bits
    return out


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def compare(device: str) -> None:
    from tierlm.kernels.norm_rope.triton import triton_norm_rope

    x, weight, cos, sin = workload(torch.float32)
    expected = norm_rope(x, weight, 1e-6, cos, sin)
    got = triton_norm_rope(*(t.to(device) for t in (x, weight)), 1e-6, cos.to(device), sin.to(device)).cpu()
    assert got.shape == expected.shape and rel_rms(got, expected) < 1e-6, rel_rms(got, expected)
    assert torch.equal(got[..., ROTARY:] != 0, expected[..., ROTARY:] != 0)

    x, weight, cos, sin = workload(torch.bfloat16)
    exact = norm_rope(x.float(), weight, 1e-6, cos.float(), sin.float())
    reference = norm_rope(x, weight, 1e-6, cos, sin)
    got = triton_norm_rope(*(t.to(device) for t in (x, weight)), 1e-6, cos.to(device), sin.to(device)).cpu()
    assert got.dtype == torch.bfloat16
    assert rel_rms(got, exact) <= 2 * rel_rms(reference, exact), (rel_rms(got, exact), rel_rms(reference, exact))

    # cos/sin from positions inside the kernel
    got, expected = at_positions(device, torch.float32, True), at_positions("cpu", torch.float32, False)
    assert rel_rms(got, expected) < 1e-6, rel_rms(got, expected)
    exact = at_positions("cpu", torch.float32, False, inputs=torch.bfloat16)
    got, reference = at_positions(device, torch.bfloat16, True), at_positions("cpu", torch.bfloat16, False)
    assert rel_rms(got, exact) <= 2 * rel_rms(reference, exact), (rel_rms(got, exact), rel_rms(reference, exact))


def test_triton_norm_rope_equals_the_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_triton_norm_rope_equals_the_reference")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_norm_rope_equals_the_reference": ("import test_norm_rope as t; t.compare('cpu')",),
}


def test_reference_is_a_gemma_norm_then_a_rotation_of_the_first_dims():
    x, weight, cos, sin = workload(torch.float32)
    out = norm_rope(x, weight, 1e-6, cos, sin)
    normed = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (1 + weight)
    assert torch.allclose(out[..., ROTARY:], normed[..., ROTARY:], atol=1e-5)
    # a rotation keeps each (i, i + rd/2) pair's length
    half = ROTARY // 2
    pairs = lambda t: t[..., :half].pow(2) + t[..., half:ROTARY].pow(2)
    assert torch.allclose(pairs(out), pairs(normed), rtol=1e-5)
    assert math.isclose(apply_rotary(normed, cos[:1].expand(TOKENS, -1), sin[:1].expand(TOKENS, -1))[0, 0, 0].item(),
                        normed[0, 0, 0].item(), rel_tol=1e-6)  # position 0: cos 1, sin 0
