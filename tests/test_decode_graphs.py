"""Padded static decode batches (what CUDA graphs replay) give the same logits as plain decode steps."""

from __future__ import annotations

import copy

import pytest
import torch
from reference_models import build_reference

from tierlm.model.decode_graphs import DecodeGraphRunner, captured_sizes
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache


def test_captured_sizes():
    assert captured_sizes(1) == [1]
    assert captured_sizes(4) == [1, 2, 4]
    assert captured_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padded_static_batches_match_plain_decode(tmp_path):
    build_reference("hc4_ple", tmp_path)
    model, config = load_model(tmp_path, dtype="float32", device="cpu")
    block_size, width = 8, 12
    cache = ModelCache(config, 4, 40, block_size, torch.float32)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(3)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 7, 19)]
    for slot in range(3):
        cache.reset_slot(slot)
    model(ForwardBatch.build(prompts, [0, 0, 0], [0, 1, 2], tables, block_size), cache)
    padded_cache = copy.deepcopy(cache)
    runner = DecodeGraphRunner(model, padded_cache, max_batch=4, max_blocks_per_request=width, capture=False)
    positions = [len(p) for p in prompts]
    for step in range(40):
        active = [0, 1, 2] if step % 3 else [2, 0]  # batch sizes 3 and 2, padded to 4 and 2
        tokens = [[int(torch.randint(2, config.vocab_size, (1,), generator=gen))] for _ in active]
        batch = ForwardBatch.build(tokens, [positions[r] for r in active], active, [tables[r] for r in active],
                                   block_size)
        plain = model(batch, cache)
        padded = runner.run(batch)
        assert torch.allclose(plain, padded, atol=1e-5, rtol=0)
        for r in active:
            positions[r] += 1
    # padding touched only the scratch slot and block: real state is the same in both caches
    for state, padded_state in zip(cache.layers, padded_cache.layers):
        for name in ("gdn_conv", "gdn_recurrent", "ple_conv", "index_ring"):
            if getattr(state, name) is not None:
                assert torch.allclose(getattr(state, name)[:3], getattr(padded_state, name)[:3], atol=1e-5)
        if state.key_cache is not None:
            assert torch.allclose(state.key_cache[:40], padded_state.key_cache[:40], atol=1e-5)
            assert torch.allclose(state.index_keys[:40], padded_state.index_keys[:40], atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_match_eager_decode_on_gpu(tmp_path):
    build_reference("hc4_ple", tmp_path)
    model, config = load_model(tmp_path, dtype="float32", device="cuda")
    block_size, width = 8, 40
    cache = ModelCache(config, 8, 200, block_size, torch.float32, "cuda")
    tables = [list(range(i * width, (i + 1) * width)) for i in range(5)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 7, 19, 64, 3)]
    for slot in range(5):
        cache.reset_slot(slot)
    model(ForwardBatch.build(prompts, [0] * 5, list(range(5)), tables, block_size, device="cuda"), cache)
    graph_cache = copy.deepcopy(cache)
    runner = DecodeGraphRunner(model, graph_cache, max_batch=8, max_blocks_per_request=width)
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    positions = [len(p) for p in prompts]
    for step in range(200):
        active = [r for r in range(5) if (step + r) % 4] or [0]
        tokens = [[int(torch.randint(2, config.vocab_size, (1,), generator=gen))] for _ in active]
        batch = ForwardBatch.build(tokens, [positions[r] for r in active], active, [tables[r] for r in active],
                                   block_size, device="cuda")
        eager = model(batch, cache)
        replayed = runner.run(batch)
        assert torch.allclose(eager, replayed, atol=1e-4, rtol=0), step
        for r in active:
            positions[r] += 1
