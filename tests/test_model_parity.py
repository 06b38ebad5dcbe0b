"""tierlm's model against transformers' Qwen4ExpForCausalLM: same checkpoint, same logits (fp32)."""

from __future__ import annotations

import pytest
import torch
from reference_models import CONFIGS, Runner, build_reference, prompt_ids, reference_logits

from tierlm.model.loader import load_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(reference model, tierlm model, config, eos) for one tiny config."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(request.param, folder)
    model, config = load_model(folder, dtype="float32", device="cpu")
    return reference, model, config


def test_full_sequence_forward(pair):
    reference, model, config = pair
    ids = prompt_ids(config, 2, 45, seed=1)
    expected = reference_logits(reference, ids)
    runner = Runner(model, config, 2)
    got = runner.step({0: ids[0].tolist(), 1: ids[1].tolist()})
    for r in (0, 1):
        assert (got[r] - expected[r]).abs().max().item() <= TOLERANCE


def test_prefill_in_uneven_chunks(pair):
    reference, model, config = pair
    ids = prompt_ids(config, 1, 53, seed=2)[0]
    expected = reference_logits(reference, ids[None])[0]
    runner = Runner(model, config, 1)
    pieces, start = [], 0
    for size in (5, 1, 13, 2, 7, 25):
        pieces.append(runner.step({0: ids[start : start + size].tolist()})[0])
        start += size
    assert start == ids.shape[0]
    assert (torch.cat(pieces) - expected).abs().max().item() <= TOLERANCE


def test_prefill_then_decode_64_steps(pair):
    reference, model, config = pair
    prompt_len, steps = 23, 64
    ids = prompt_ids(config, 1, prompt_len + steps, seed=3)[0]
    expected = reference_logits(reference, ids[None])[0]
    runner = Runner(model, config, 1)
    pieces = [runner.step({0: ids[:prompt_len].tolist()})[0]]
    for t in range(prompt_len, prompt_len + steps):
        pieces.append(runner.step({0: [int(ids[t])]})[0])
    assert (torch.cat(pieces) - expected).abs().max().item() <= TOLERANCE


def test_batched_forward_mixes_positions_and_lengths(pair):
    """One forward holding: a decode at position 40, a fresh 17-token prefill, a 9-token chunk at 26."""
    reference, model, config = pair
    ids = prompt_ids(config, 3, 41, seed=4)
    expected = reference_logits(reference, ids)
    runner = Runner(model, config, 3)
    runner.step({0: ids[0, :40].tolist()})
    runner.step({2: ids[2, :26].tolist()})
    got = runner.step({0: [int(ids[0, 40])], 1: ids[1, :17].tolist(), 2: ids[2, 26:35].tolist()})
    assert (got[0] - expected[0, 40:41]).abs().max().item() <= TOLERANCE
    assert (got[1] - expected[1, :17]).abs().max().item() <= TOLERANCE
    assert (got[2] - expected[2, 26:35]).abs().max().item() <= TOLERANCE
    # and the decode-only path, all three requests one token each
    got = runner.step({0: [5], 1: [int(ids[1, 17])], 2: [int(ids[2, 35])]})
    assert (got[1] - expected[1, 17:18]).abs().max().item() <= TOLERANCE
    assert (got[2] - expected[2, 35:36]).abs().max().item() <= TOLERANCE
