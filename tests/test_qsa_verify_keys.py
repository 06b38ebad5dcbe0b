"""A verification batch's indexer block keys taken row by row through the decode key store
(`qsa_attention.store_verify_keys_by_row`, the layer's CUDA path) against the layer's torch path (rotary
tables at the group starts, the torch compress): with the decode store's torch reference, equal bit for bit
(the ring pool, and the key pool but its scratch block); with its Triton launch (under TRITON_INTERPRET=1 on
CPU, compiled on a GPU), fp32 within 1e-6 relative, bf16 within 2x the torch bf16 path's own distance from
fp32 (`test_qsa_block_keys`' rule)."""

from __future__ import annotations

import torch
from interpreted import on_cuda_else_interpreted
from reference_models import BASE
from test_norm_rope import rel_rms

from tierlm.kernels.qsa_block_keys.naive import store_decode_block_keys
from tierlm.kernels.qsa_ring import ring_after_rows
from tierlm.model.layers.qsa_attention import store_verify_keys_by_row

BLOCK_SIZE, SCRATCH, ROWS = 8, 9, 3
CONTEXTS = torch.tensor([5, 8, 2])  # ring offsets 1, 0, 2: rows that close a group, groups opened in the batch


def indexer(dtype: torch.dtype):
    from tierlm.config import ModelConfig
    from tierlm.model.layers.qsa_attention import QSAIndexer

    module = QSAIndexer(ModelConfig.from_dict(BASE))
    with torch.no_grad():
        module.k_layernorm.weight.copy_(0.1 * torch.randn(module.head_dim, generator=torch.Generator().manual_seed(3)))
    return module.to(dtype)


def workload(dtype: torch.dtype, inputs: torch.dtype | None = None):
    """3 requests of 3 rows (their own slots last in their row slots), raw keys a view with a row stride (as
    the projection's split), a random ring pool and key pool; values rounded to `inputs`, held in dtype."""
    from tierlm.model.cache import QSAIndexerState
    from tierlm.model.forward_batch import ForwardBatch

    gen = torch.Generator().manual_seed(0)
    dim, ratio = BASE["indexer_head_dim"], BASE["indexer_compress_ratio"]
    def values(*shape):
        return torch.randn(*shape, generator=gen).to(inputs or dtype).to(dtype)
    state = QSAIndexerState(values(12, ratio, dim), values(SCRATCH + 1, BLOCK_SIZE // ratio, dim), BLOCK_SIZE, SCRATCH)
    raw_keys = values(3 * ROWS, dim + 5)[:, :dim]
    positions = (CONTEXTS[:, None] + torch.arange(ROWS)).flatten()
    batch = ForwardBatch(
        token_ids=torch.zeros(3 * ROWS, dtype=torch.int64), positions=positions, context_lens=CONTEXTS.tolist(),
        query_lens=[ROWS] * 3, state_slots=[2, 5, 0], block_tables=torch.tensor([[3, 1, -1, -1], [0, 4, 2, -1],
                                                                                 [5, -1, -1, -1]]),
        slot_mapping=torch.zeros(3 * ROWS, dtype=torch.int64), logits_rows=torch.arange(3 * ROWS),
        logits_every_row=True, slots=torch.tensor([2, 5, 0]), context_lens_tensor=CONTEXTS, static=True,
        verify_slots=torch.tensor([[6, 7, 2], [8, 9, 5], [10, 11, 0]]))
    return raw_keys, batch, state


def layer_path(dtype: torch.dtype, inputs: torch.dtype | None = None):
    """The layer's torch path (CPU): the ring pool and the key pool without its scratch block."""
    from tierlm.model.layers.rotary import Rope, RotaryEmbedding

    raw_keys, batch, state = workload(dtype, inputs)
    rotary = RotaryEmbedding(BASE["head_dim"] // 2, BASE["rope_parameters"]["rope_theta"])
    indexer(dtype).store_block_keys_verify(raw_keys, batch, state, Rope(rotary, batch, dtype))
    return state.ring, state.keys[:SCRATCH]


def by_row(device: str, dtype: torch.dtype, store, inputs: torch.dtype | None = None):
    """The rings (`kernels/qsa_ring`'s reference), then `store_verify_keys_by_row` with `store` on `device`."""
    from tierlm.model.layers.rotary import RotaryEmbedding

    raw_keys, batch, state = workload(dtype, inputs)
    ring_after_rows(state.ring, batch.slots, raw_keys, batch.positions, batch.context_lens_tensor,
                    batch.verify_slots, batch.block_tables, BLOCK_SIZE, SCRATCH)
    norm = indexer(dtype).k_layernorm
    inv_freq = RotaryEmbedding(BASE["head_dim"] // 2, BASE["rope_parameters"]["rope_theta"]).inv_freq
    ring, keys = state.ring.to(device), state.keys.to(device)
    store_verify_keys_by_row(raw_keys.to(device), ring, keys, batch.verify_slots.to(device),
                             batch.positions.to(device), batch.verify_row_tables().to(device),
                             norm.weight.detach().to(device),
                             norm.eps, inv_freq.to(device), BLOCK_SIZE, SCRATCH, store)
    return ring.cpu(), keys[:SCRATCH].cpu()


def test_by_row_with_the_torch_store_is_the_layer_path():
    for dtype in (torch.float32, torch.bfloat16):
        ring, keys = layer_path(dtype)
        before = workload(dtype)[2].keys[:SCRATCH]
        assert not torch.equal(keys, before)  # some groups close
        got_ring, got_keys = by_row("cpu", dtype, store_decode_block_keys)
        assert torch.equal(got_ring, ring) and torch.equal(got_keys, keys), dtype


def compare(device: str) -> None:
    from tierlm.kernels.qsa_block_keys.triton import triton_store_decode_block_keys as fused

    ring, keys = by_row(device, torch.float32, fused)
    expected_ring, expected_keys = layer_path(torch.float32)
    assert torch.equal(ring, expected_ring)
    assert rel_rms(keys, expected_keys) < 1e-6, rel_rms(keys, expected_keys)
    ring, keys = by_row(device, torch.bfloat16, fused)
    expected_ring, reference = layer_path(torch.bfloat16)
    _, exact = layer_path(torch.float32, inputs=torch.bfloat16)
    assert torch.equal(ring, expected_ring)
    assert rel_rms(keys, exact) <= 2 * rel_rms(reference, exact), (rel_rms(keys, exact), rel_rms(reference, exact))


def test_by_row_with_the_kernel_matches_the_layer_path():
    on_cuda_else_interpreted(lambda: compare("cuda"), INTERPRETED_EARLY,
                             "test_by_row_with_the_kernel_matches_the_layer_path")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_by_row_with_the_kernel_matches_the_layer_path": ("import test_qsa_verify_keys as t; t.compare('cpu')",),
}
