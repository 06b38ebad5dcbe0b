"""The indexer's decode key store (`kernels/qsa_block_keys`): the Triton kernel against the torch reference
under TRITON_INTERPRET=1 on CPU (compiled on a GPU): the ring bit for bit; the compressed keys of the
groups that close (the scratch block aside) in fp32 within 1e-6 relative, in bf16 within 2x the torch bf16
path's own distance from fp32 (the project's rule, as `test_norm_rope`)."""

from __future__ import annotations

import torch
from interpreted import on_cuda_else_interpreted
from test_norm_rope import rel_rms

from tierlm.kernels.qsa_block_keys import store_decode_block_keys
from tierlm.model.layers.rotary import RotaryEmbedding

RATIO, BLOCK_SIZE, DIM, ROTARY, BLOCKS = 4, 8, 24, 12, 12  # DIM not a power of two; partial rotary
SCRATCH = BLOCKS - 1
CONTEXTS = torch.tensor([3, 7, 10, 15, 0, 4094])  # context % R == R - 1: the new key closes a group


def run(device: str, dtype: torch.dtype, fused: bool, inputs: torch.dtype | None = None):
    """One decode step's store on a random ring and pool (values rounded to `inputs`, computed in `dtype`);
    returns the ring and the pool without its scratch block."""
    from tierlm.kernels.qsa_block_keys.triton import triton_store_decode_block_keys

    gen = torch.Generator().manual_seed(0)
    batch = len(CONTEXTS)
    raw = (torch.randn(batch, DIM + 5, generator=gen) * 2).to(inputs or dtype).to(dtype)[:, :DIM]  # strided
    ring = torch.randn(batch + 2, RATIO, DIM, generator=gen).to(inputs or dtype).to(dtype)
    pool = torch.randn(BLOCKS, BLOCK_SIZE // RATIO, DIM, generator=gen).to(inputs or dtype).to(dtype)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    tables = torch.full((batch, 4096 // BLOCK_SIZE), -1)  # each request's open group in a block of its own
    tables[torch.arange(batch), CONTEXTS // BLOCK_SIZE] = torch.randperm(SCRATCH, generator=gen)[:batch]
    weight = torch.randn(DIM, generator=gen) * 0.1
    inv_freq = RotaryEmbedding(ROTARY, 10000.0).inv_freq
    tensors = [t.to(device) for t in (raw, ring, pool, slots, CONTEXTS, tables, weight)]
    form = triton_store_decode_block_keys if fused else store_decode_block_keys
    form(*tensors, 1e-6, inv_freq.to(device), BLOCK_SIZE, SCRATCH)
    return tensors[1].cpu(), tensors[2][:SCRATCH].cpu()


def compare(device: str) -> None:
    ring, keys = run(device, torch.float32, True)
    expected_ring, expected_keys = run("cpu", torch.float32, False)
    assert torch.equal(ring, expected_ring)
    assert rel_rms(keys, expected_keys) < 1e-6, rel_rms(keys, expected_keys)
    ring, keys = run(device, torch.bfloat16, True)
    expected_ring, reference = run("cpu", torch.bfloat16, False)
    _, exact = run("cpu", torch.float32, False, inputs=torch.bfloat16)
    assert torch.equal(ring, expected_ring)
    assert rel_rms(keys, exact) <= 2 * rel_rms(reference, exact), (rel_rms(keys, exact), rel_rms(reference, exact))


def test_triton_block_key_store_equals_the_reference():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY, "test_triton_block_key_store_equals_the_reference")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_block_key_store_equals_the_reference": ("import test_qsa_block_keys as t; t.compare('cpu')",),
}
