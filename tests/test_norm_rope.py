"""Norm + rotary fused (`kernels/norm_rope`): the Triton kernel against the torch reference under
TRITON_INTERPRET=1 on CPU (compiled on a GPU), on a strided input (the query half of [query | gate]) with
a partial rotary.

fp32: equal up to the sum of squares' order (1e-6 relative). bf16: the project's rule, the kernel's
distance from the fp32 computation within 2x the torch bf16 path's own."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from interpreted import run_interpreted

from tierlm.kernels.norm_rope import norm_rope
from tierlm.kernels.norm_rope.naive import apply_rotary
from tierlm.model.layers.rotary import RotaryEmbedding

TOKENS, HEADS, DIM, ROTARY = 5, 3, 48, 12  # DIM not a power of two


def workload(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    packed = torch.randn(TOKENS, HEADS, 2 * DIM, generator=gen) * 3
    x = packed.to(dtype)[..., :DIM]  # strided: every head's row is followed by its gate
    weight = torch.randn(DIM, generator=gen) * 0.1
    cos, sin = RotaryEmbedding(ROTARY, 10000.0).cos_sin(torch.tensor([0, 7, 300, 4095, 70000]), dtype)
    return x, weight, cos, sin


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


def test_triton_norm_rope_equals_the_reference():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        compare("cuda")
        return
    run_interpreted(*INTERPRETED_EARLY["test_triton_norm_rope_equals_the_reference"])


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
