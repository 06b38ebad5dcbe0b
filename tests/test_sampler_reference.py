"""The sampler's batched pass (`sample_rows`) gives, token for token, what the plain per-row reference
gives, on a batch that mixes every kind of row, for fp32 and bf16 logits; the counter-based noise is the
same hash on the host and the device, and Exp(1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.sampler_reference import reference_edit_logits, reference_sample_rows
from tierlm.engine.sampling_noise import exponential_noise, exponential_noise_np, seeded_keys
from tierlm.engine.sampling_pass import STATUS_MASKED, STATUS_NAN, STATUS_OK, edit_logits, sample_rows
from tierlm.engine.sampling_plan import plan_rows
from tierlm.engine.structured_output import BitmaskGrammar
from tierlm.sampling_params import SamplingParams

VOCAB = 300


def _batch() -> tuple[torch.Tensor, list[Request]]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(17, VOCAB, generator=generator) * 3
    bitmask = torch.randint(-(2**31), 2**31, ((VOCAB + 31) // 32,), dtype=torch.int64, generator=generator)
    rows = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1, top_k=20),
        SamplingParams(temperature=0.7, top_p=0.5, frequency_penalty=1.0, presence_penalty=0.5),  # sorted draw
        SamplingParams(temperature=0, logit_bias={7: 50.0, 8: -3.0}),
        SamplingParams(temperature=1.0, seed=3, min_p=0.2),  # whole-vocabulary draw, no sort
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, allowed_token_ids=[3, 10, 200, 10**6]),
        SamplingParams(temperature=1.0, top_k=50, seed=5),  # with a grammar bitmask
        SamplingParams(temperature=1.0, top_p=0.95, min_tokens=10, repetition_penalty=0.8),  # EOS banned
        SamplingParams(temperature=1.0),  # NaN logits
        SamplingParams(temperature=1.0, allowed_token_ids=[4]),  # nothing left
        SamplingParams(temperature=1.0, top_k=3),  # a +inf logit
        SamplingParams(temperature=2.0, top_p=0.3, top_k=VOCAB + 5),  # top_k past the vocabulary: none
    ] + [SamplingParams(temperature=100.0, top_k=2)] * 4  # near-uniform over the 2 best, never a third
    logits[:, [1, 2, 3, 5, 9, 250, 299]] += 6  # the ids seen: the penalties decide among them
    logits[9, 17] = math.nan
    logits[10, 4] = -math.inf
    logits[11, 42] = math.inf
    requests = []
    for i, params in enumerate(rows):
        request = Request(f"r{i}", [1, 2, 3, 250, 2], params.with_defaults(None, None, None), frozenset({0}), 1024,
                          output_token_ids=[5, 5, 9, 2, 299, 5])
        if i == 7:
            request.structured_output = BitmaskGrammar(bitmask.to(torch.int32))
        requests.append(request)
    return logits, requests


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batched_pass_is_the_reference(dtype, device):
    logits, requests = _batch()
    logits = logits.to(dtype).float().to(device)
    for seed in range(6):
        plan = plan_rows(requests, VOCAB, Sampler(seed).row_keys(requests))
        if seed == 0:  # penalties, biases, bans, bitmask: the same values, bit for bit on the CPU; a GPU's
            # batched and per-row kernels may round a division or a multiply-add one ulp apart (H200: 2 of 5100)
            edited = edit_logits(logits, plan)
            ulps = 0 if device == "cpu" else 2 * torch.finfo(torch.float32).eps
            torch.testing.assert_close(edited, reference_edit_logits(logits, plan), rtol=ulps, atol=0, equal_nan=True)
            assert torch.equal(edited[0], logits[0])  # a row without edits is left as it was
            assert edited[6].isfinite().nonzero().flatten().tolist() == [3, 10, 200]
        tokens, status = sample_rows(logits, plan)
        expected_tokens, expected_status = reference_sample_rows(logits, plan)
        assert status.tolist() == expected_status.tolist()
        assert tokens.tolist() == expected_tokens.tolist(), seed
    status, tokens = status.cpu(), tokens.cpu()
    assert status[9] == STATUS_NAN and status[10] == STATUS_MASKED and (status[:9] == STATUS_OK).all()
    assert tokens[3] == 7 and tokens[11] == 42 and tokens[6] in (3, 10, 200) and tokens[8] != 0


def test_the_noise_is_one_hash_on_host_and_device_and_exponential():
    keys = seeded_keys([0, -5, 2**63 - 1], [0, 7, 100])
    host = exponential_noise_np(keys, 4096)
    device = exponential_noise(torch.from_numpy(keys.view(np.int64)), torch.arange(4096)).numpy()
    np.testing.assert_allclose(host, device, rtol=1e-6)  # the same bits hashed; each library's own log
    assert (host > 0).all() and abs(host.mean() - 1) < 0.05 and abs(host.var() - 1) < 0.1
    assert len({tuple(row[:8]) for row in host}) == 3  # keys differ by seed and position
    assert seeded_keys([7], [3]) != seeded_keys([7], [4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_rows_skip_the_plan_and_sample_the_same(dtype, device):
    """Greedy rows with no edit take `Sampler.launch`'s unplanned path (a row with an edit, here min_tokens'
    EOS ban, does not); it gives the planned pass's tokens and statuses (a NaN row, a row of -inf), and the
    generator's keys advance the same either way (the next batch's draws are equal). bf16 logits: the
    unplanned path takes their argmax as they are, the planned one of their fp32 copy; ties (row 3's two
    best, equal) go to the lower id in both."""
    from tierlm.engine.sampling_plan import plain_greedy

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 3], logits[2] = math.nan, -math.inf
    logits[3, 40] = logits[3, 200] = logits[3].max() + 1
    logits = logits.to(dtype).to(device)
    banned = SamplingParams(temperature=0, min_tokens=10).with_defaults(None, None, None)
    assert not plain_greedy(Request("b", [1, 2], banned, frozenset({0}), 1024, output_token_ids=[5]))
    params = SamplingParams(temperature=0).with_defaults(None, None, None)
    requests = [Request(f"g{i}", [1, 2], params, frozenset({0}), 1024, output_token_ids=[5]) for i in range(4)]
    assert all(plain_greedy(r) for r in requests)
    sampler, planned = Sampler(7), Sampler(7)
    pending = sampler.launch(logits, requests)
    tokens, status = sample_rows(logits.float(), plan_rows(requests, VOCAB, planned.row_keys(requests)))
    if pending.ready is not None:
        pending.ready.synchronize()
    assert torch.equal(pending.tokens, tokens) and torch.equal(pending.host_ids[1], status.cpu())
    assert pending.host_ids[1].tolist() == [STATUS_OK, STATUS_NAN, STATUS_MASKED, STATUS_OK] and tokens[3].item() == 40
    assert np.array_equal(sampler.row_keys(requests), planned.row_keys(requests))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_probs_is_the_distribution_the_pass_draws_from(dtype, device):
    """`sampling_probs` (speculative verification's target) is the reference's distribution, row for row, on
    the batch's rows that sample (edited as the pass edits them), and where ties meet a cut: a tie at the
    k-th place keeps the lower id, equal probabilities at the top-p boundary keep the lower ids."""
    from tierlm.engine.sampler_reference import reference_sampling_probs
    from tierlm.engine.sampling_pass import sampling_probs

    logits, requests = _batch()
    tie = torch.zeros(2, VOCAB)
    tie[:, [5, 9]] = torch.tensor([3.0, 2.0])  # 5, 9, then equal logits: 298 in the top-p row,
    tie[0, [100, 40, 70, 20]], tie[0, 200:] = 1.0, -5.0  # 4 in the top-k row (within best_first's TIE_MARGIN)
    params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5)]
    logits = torch.cat([logits, tie]).to(dtype).float().to(device)
    requests += [Request(f"t{i}", [1], p.with_defaults(None, None, None), frozenset({0}), 1024)
                 for i, p in enumerate(params)]
    edited = edit_logits(logits, plan_rows(requests, VOCAB, Sampler(0).row_keys(requests)))
    rows = [i for i in range(len(requests)) if i not in (9, 10)]  # not NaN, not all masked
    probs = sampling_probs(edited[rows], [requests[i] for i in rows])
    torch.testing.assert_close(probs, reference_sampling_probs(edited[rows], [requests[i] for i in rows]))
    top_k, top_p = probs[-2].nonzero().flatten().tolist(), probs[-1].nonzero().flatten().tolist()
    assert top_k == [5, 9, 20]
    lowest = [i for i in range(VOCAB) if i not in (5, 9)][: len(top_p) - 2]
    assert top_p == sorted([5, 9, *lowest]) and 100 < len(top_p) < 200
