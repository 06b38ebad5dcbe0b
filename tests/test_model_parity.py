"""tierlm's model against transformers' Qwen4ExpForCausalLM: same checkpoint, same logits (fp32)."""

from __future__ import annotations

import pytest
import torch
from reference_models import CONFIGS, build_reference, reference_logits

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache

TOLERANCE = 1e-4
BLOCK_SIZE = 12  # a multiple of every test config's compress ratio (3 and 4)
BLOCKS_PER_REQUEST = 20


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(reference model, tierlm model, config, eos) for one tiny config."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(request.param, folder)
    model, config = load_model(folder, dtype="float32", device="cpu")
    return reference, model, config


def prompt_ids(config, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random ids with EOS planted mid-sequence (and right after another EOS once)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size, (batch, length), generator=gen)
    eos = config.eos_token_id if config.eos_token_id is not None else 1
    ids[:, length // 3] = eos
    ids[0, length // 2] = eos
    ids[0, length // 2 + 1] = eos
    return ids


class Runner:
    """Drives the tierlm model over several requests with disjoint slots and block tables."""

    def __init__(self, model, config, num_requests: int) -> None:
        self.model = model
        self.cache = ModelCache(config, num_requests, num_requests * BLOCKS_PER_REQUEST, BLOCK_SIZE, torch.float32)
        self.tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(num_requests)]
        self.positions = [0] * num_requests
        for slot in range(num_requests):
            self.cache.reset_slot(slot)

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute the next chunk of each named request in ONE forward; logits per request [T, V]."""
        reqs = sorted(chunks)
        batch = ForwardBatch.build(
            [chunks[r] for r in reqs], [self.positions[r] for r in reqs], reqs,
            [self.tables[r] for r in reqs], BLOCK_SIZE, logits="all",
        )
        logits = self.model(batch, self.cache)
        out = {}
        for r, (start, end) in zip(reqs, batch.bounds):
            out[r] = logits[start:end]
            self.positions[r] += end - start
        return out


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
